"""An edge's moves as a flow over the hops they share (``PlannerCosts.move_network``,
``ilp._add_network``) price every move exactly: the cheapest flow from a source placement to a
destination costs that move's time, and one that no move allows has no flow; the placement ILP
with flow edges finds the optimum it finds with transport pairs only."""

from __future__ import annotations

import itertools

import highspy
import numpy as np
import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from shardwise.cost.hardware import get_hardware
from shardwise.cost.reshard import move_hops
from shardwise.cost.step import torchtitan_options
from shardwise.plan import ilp, solver
from shardwise.plan.costs import PlannerCosts
from shardwise.plan.objective import ScheduleObjective
from shardwise.plan.planner import default_budget
from shardwise.plan.strategies import intern
from tests.plan.test_pricing import CASES, REL, TIME_LIMIT_S, _problem

R, P = Replicate(), Partial()


def _placements(ndim: int, mesh_ndim: int) -> list:
    return [intern(t) for t in itertools.product([R, P, *(Shard(d) for d in range(ndim))], repeat=mesh_ndim)]


def _cheapest_flow(net, i: int, j: int) -> float:
    """The min-cost flow of one unit from source i's node to destination j's (inf: infeasible)."""
    h = solver._highs(TIME_LIMIT_S)  # one thread, as every HiGHS of the process must have
    for t in net.seconds:
        h.addVar(0.0, 1.0)
        h.changeColCost(h.getNumCol() - 1, float(t) * 1e6)
    for node in range(net.nodes):
        arcs = [(k, 1.0) for k, (a, _) in enumerate(net.arcs) if a == node]
        arcs += [(k, -1.0) for k, (_, b) in enumerate(net.arcs) if b == node]
        rhs = (node == net.src_node[i]) - (node == net.dst_node[j])
        h.addRow(rhs, rhs, len(arcs), [k for k, _ in arcs], [c for _, c in arcs])
    h.run()
    if h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
        return np.inf
    return h.getInfo().objective_function_value / 1e6


@pytest.mark.parametrize("mesh", [(8, 8), (2, 4)])
def test_the_cheapest_flow_is_each_moves_time(mesh):
    costs = PlannerCosts(mesh, get_hardware("h100"))
    val = torch.empty((16, 8192, 4096), dtype=torch.bfloat16, device="meta")
    ps = _placements(3, 2)
    net = costs.move_network(ps, ps, val)
    times = costs.move_times(ps, ps, val)
    assert net is not None
    assert len(net.arcs) < 0.6 * np.isfinite(times).sum()  # fewer columns than (p, q) pairs
    for (i, j), path in net.paths.items():
        assert sum(net.seconds[k] for k in path) == pytest.approx(times[i, j], rel=1e-12)
    rng = np.random.default_rng(0)
    pairs = [tuple(ij) for ij in rng.integers(0, len(ps), size=(12, 2))]
    # S(0) -> P is no move (the lowering makes a dim Partial only from Replicate, before any
    # redistribute), though R -> P is, and S(0) -> R on the way is: still no flow
    pairs.append((ps.index(intern((R, Shard(0)))), ps.index(intern((R, P)))))
    assert times[pairs[-1]] == np.inf
    for i, j in pairs:
        assert _cheapest_flow(net, i, j) == pytest.approx(times[i, j], rel=1e-9, abs=1e-12)


def test_a_network_that_would_shortcut_a_move_is_refused():
    """Moves priced by another rule than the hops' shortest paths: the network is not exact."""
    costs = PlannerCosts((8, 8), get_hardware("h100"))
    val = torch.empty((16, 8192, 4096), dtype=torch.bfloat16, device="meta")
    ps = _placements(3, 2)
    net = costs.move_network(ps, ps, val)
    times = costs.move_times(ps, ps, val).copy()
    assert net.prices(times)
    i, j = next((i, j) for (i, j), path in net.paths.items() if len(path) > 1 and times[i, j] > 0.0)
    times[i, j] *= 0.5  # a move cheaper than its hops
    assert not net.prices(times)
    times[i, j] = np.inf  # or none at all
    assert not net.prices(times)


@pytest.mark.parametrize("case", ["llama-tiny 4", "hf qwen2 2x2"])
def test_flow_edges_give_the_transport_models_optimum(case, monkeypatch):
    """Under the schedule objective; the serial one keeps its transport rows."""
    model, mesh, shape = CASES[case]
    tr, ns, clus, costs = _problem(model, mesh, **shape)

    def solve():
        return ilp.solve(tr, ns, clus, costs, memory_budget=default_budget(mesh), time_limit_s=TIME_LIMIT_S,
                         schedule=ScheduleObjective(tr, clus, costs, torchtitan_options(tr)))

    built = []
    real_add = ilp._add_network
    monkeypatch.setattr(ilp, "_add_network", lambda *a: built.append(1) or real_add(*a))
    ilp.build(tr, ns, clus, costs, memory_budget=default_budget(mesh))
    assert not built
    flows = solve()
    assert built  # the model has flow edges
    monkeypatch.setattr(PlannerCosts, "move_network", lambda self, *a: None)
    transport = solve()
    assert flows.status == transport.status == "optimal"
    assert flows.objective_s == pytest.approx(transport.objective_s, rel=REL)
    assert flows.n_vars < transport.n_vars


def test_only_the_arcs_of_moves_still_open_stay_in_the_mip():
    """``solver.restrict_flows``: with one source and one destination left open, the arcs left
    are those of that move's path (all of them where every placement is open)."""
    costs = PlannerCosts((8, 8), get_hardware("h100"))
    val = torch.empty((16, 8192, 4096), dtype=torch.bfloat16, device="meta")
    ps = _placements(3, 2)
    net = costs.move_network(ps, ps, val)
    m = ilp._Model()
    supply, demand = ({p: [m.var(0.0)] for p in ps} for _ in range(2))
    ilp._add_network(m, supply, demand, net)
    (flow,) = m.flows
    ub = np.array(m.ub)
    solver.restrict_flows(m, ub)
    assert (ub[flow.arcs] == 1.0).all()
    (i, j), path = max(net.paths.items(), key=lambda kv: len(kv[1]))
    for p in ps:
        if p is not ps[i]:
            ub[supply[p]] = 0.0
        if p is not ps[j]:
            ub[demand[p]] = 0.0
    solver.restrict_flows(m, ub)
    assert set(np.flatnonzero(ub[flow.arcs]).tolist()) == set(path) and len(path) > 1


def test_a_producers_flow_edges_pay_a_hop_they_share_once():
    """Two readers of one value, one in (R, S(2)) and one in (R, R): the flow edges of their
    group pay the hop to (R, S(2)), which both moves take, once (``ilp._charge_moves`` by hop);
    transport pairs pay both whole moves. The flow model is a relaxation of the pairs'
    (``ilp.py``): never dearer, and the same where the readers' moves share no hop."""
    costs = PlannerCosts((8, 8), get_hardware("h100"))
    val = torch.empty((16, 8192, 4096), dtype=torch.bfloat16, device="meta")
    ps = _placements(3, 2)
    src, first, second = intern((Shard(0), Shard(2))), intern((R, Shard(2))), intern((R, R))
    hops = move_hops(src, second, tuple(val.shape), val.element_size(), costs.topology)
    assert [b for _, b, _ in hops] == [first, second]  # the move to (R, R) passes (R, S(2))

    def cost_at(flows: bool, dests: tuple) -> float:
        m = ilp._Model()
        supply = {p: [m.var(0.0)] for p in ps}
        demands, paid = [], []
        for _ in dests:
            demand = {p: [m.var(0.0)] for p in ps}
            net = costs.move_network(ps, ps, val) if flows else None
            paid.append(ilp._add_network(m, supply, demand, net) if net is not None
                        else ilp._add_edge(m, supply, demand, costs.move_times(ps, ps, val)))
            demands.append(demand)
        ilp._charge_moves(m, paid, 1, list(range(len(dests))))
        x = np.zeros(len(m.cost))
        x[supply[src]] = 1.0
        for demand, q in zip(demands, dests, strict=True):
            x[demand[q]] = 1.0
        return float(np.dot(m.cost, solver.complete(m, x)))

    def move(a, b):
        return costs.reshard(a, b, val).time_s

    assert cost_at(False, (first, second)) == pytest.approx(move(src, first) + move(src, second), rel=1e-9)
    assert cost_at(True, (first, second)) == pytest.approx(move(src, first) + move(first, second), rel=1e-9)
    assert cost_at(True, (first, second)) < cost_at(False, (first, second))
    apart = (intern((Shard(0), R)), intern((Shard(2), Shard(0))))
    assert cost_at(True, apart) == pytest.approx(cost_at(False, apart), rel=1e-9)
