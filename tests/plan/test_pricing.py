"""Solving the placement ILP by a restricted LP and pricing (``plan/solver.py``) is exact: the
same optimum as HiGHS on the whole model, on small configs, in both of its endings (an
integral LP optimum, and the MIP after reduced-cost fixing under a tight memory budget)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from shardwise.cost.hardware import get_hardware
from shardwise.ir.trace import trace_model
from shardwise.mesh import Mesh
from shardwise.passes.pipeline import canonicalize
from shardwise.plan import ilp
from shardwise.plan.cluster import cluster
from shardwise.plan.costs import PlannerCosts
from shardwise.plan.planner import _placeholder_filter, default_budget
from shardwise.plan.strategies import enumerate_strategies

DATA = Path(__file__).resolve().parents[1] / "data"
# Plans are compared to this relative precision (the solver's gap is 1e-7).
REL = 1e-6
TIME_LIMIT_S = 120.0


def _problem(model: str, mesh: Mesh, **shape):
    tr = trace_model(model, **shape)
    canonicalize(tr)
    clus = cluster(tr, {})
    ns = enumerate_strategies(tr.gm, mesh.device_mesh(), placeholder_filter=_placeholder_filter({}, mesh),
                              rep=clus.rep)
    return tr, ns, clus, PlannerCosts(mesh.shape, get_hardware(mesh.hardware))


def _both(problem, budget: float):
    tr, ns, clus, costs = problem
    priced = ilp.solve(tr, ns, clus, costs, memory_budget=budget, time_limit_s=TIME_LIMIT_S)
    whole = ilp.solve(tr, ns, clus, costs, memory_budget=budget, time_limit_s=TIME_LIMIT_S, pricing=False)
    return priced, whole


# Small meshes keep these fast; so that their few placements still leave columns out, the
# tests keep 2 moves per line instead of CORE_PER_LINE (6, for 8x8 meshes).
CORE = 2
CASES = {
    "llama-tiny 4": ("llama-tiny", Mesh((4,), ("dp",), "h100"), {"layers": 1, "batch": 8, "seq": 32}),
    "hf qwen2 2x2": (f"hf:{DATA / 'hf_tiny_qwen2' / 'config.json'}", Mesh((2, 2), ("dp", "tp"), "h100"),
                     {"layers": 1, "batch": 4, "seq": 32}),
    "hf mistral 4": (f"hf:{DATA / 'hf_tiny_mistral' / 'config.json'}", Mesh((4,), ("dp",), "h100"),
                     {"layers": 2, "batch": 4, "seq": 32}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_pricing_finds_the_whole_models_optimum(case, monkeypatch):
    monkeypatch.setattr(ilp, "CORE_PER_LINE", CORE)
    model, mesh, shape = CASES[case]
    priced, whole = _both(_problem(model, mesh, **shape), default_budget(mesh))
    assert whole.status == priced.status == "optimal"
    assert priced.objective_s == pytest.approx(whole.objective_s, rel=REL)
    assert priced.bound_s == pytest.approx(whole.objective_s, rel=REL)
    # The restricted model really was smaller: columns were left out, some of them priced back.
    assert priced.stats["optional"] > 0 and priced.stats["pricing_rounds"] > 0
    assert priced.stats["columns_solved"] < priced.n_vars
    assert whole.stats["pricing_rounds"] == 0 and whole.stats["columns_solved"] == whole.n_vars


@pytest.mark.parametrize("times_floor", [1.2, 1.5])
def test_under_a_tight_budget_the_mip_after_fixing_is_exact(times_floor, monkeypatch):
    """A budget near the fully-sharded floor makes the LP optimum fractional: the MIP then runs
    over the columns reduced-cost fixing keeps, from a start point, and must agree with the MIP
    over every column.

    Without the moved activations in the memory row (``MemoryModel.moved_copies``): their
    product terms leave the root LP ~2.6% under the optimum at these budgets, and HiGHS then
    takes 6-10 s per MIP instead of 0.5 s, on the same fixing code path."""
    monkeypatch.setattr(ilp, "CORE_PER_LINE", CORE)
    model, mesh, shape = CASES["llama-tiny 4"]
    tr, ns, clus, costs = _problem(model, mesh, **shape)
    memory = ilp.MemoryModel(moved_copies=False)
    floor = ilp.solve(tr, ns, clus, costs, memory_budget=1.0, time_limit_s=TIME_LIMIT_S,
                      memory=memory).min_memory_bytes
    budget = times_floor * floor
    whole = ilp.solve(tr, ns, clus, costs, memory_budget=budget, time_limit_s=TIME_LIMIT_S, pricing=False,
                      memory=memory)
    assert whole.status == "optimal"
    priced = ilp.solve(tr, ns, clus, costs, memory_budget=budget, time_limit_s=TIME_LIMIT_S,
                       start=whole.choice, memory=memory)
    assert priced.status == "optimal"
    assert priced.objective_s == pytest.approx(whole.objective_s, rel=REL)
    assert priced.stats["pricing_rounds"] > 0 and not priced.stats["integral_lp"]
    assert priced.stats["columns_solved"] < priced.n_vars  # some columns fixed out by reduced cost


def test_core_pairs_keep_free_moves_and_the_cheapest_per_line(monkeypatch):
    monkeypatch.setattr(ilp, "CORE_PER_LINE", 1)
    times = np.array([[0.0, 5.0, 9.0, 1.0],
                      [3.0, 0.0, 2.0, 8.0],
                      [7.0, 6.0, 4.0, np.inf]])
    kept = {tuple(ij) for ij in np.argwhere(ilp._core_pairs(times)).tolist()}
    # free: (0,0), (1,1); cheapest out of row 2: (2,2); into column 2: (1,2); into column 3: (0,3)
    assert kept == {(0, 0), (1, 1), (2, 2), (1, 2), (0, 3)}
