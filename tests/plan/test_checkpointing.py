"""Activation checkpointing decided by the placement ILP (``plan/checkpointing.py``)."""

from __future__ import annotations

import pytest

from shardwise.cost.step import price_plan
from shardwise.passes.remat import ACPolicy
from shardwise.plan.planner import NO_PLAN, plan_with_baselines
from tests.helpers import AC_BATCH as BATCH
from tests.helpers import AC_LAYERS as LAYERS
from tests.helpers import AC_SEQ as SEQ
from tests.helpers import cli, ddp_plan, json_object

BIG = 2**40  # a budget nothing reaches
MiB = 2**20


@pytest.fixture(scope="module")
def tiny(tiny_four_layers):
    return tiny_four_layers


@pytest.fixture(scope="module")
def mesh(mesh_of_two):
    return mesh_of_two


@pytest.fixture(scope="module")
def uniform(tiny, mesh):
    """The ddp placements with every layer none (decided under no memory pressure), selective,
    full: (ILP memory row, ILP objective) each."""
    out = {ACPolicy.NONE: ddp_plan(tiny, mesh, BIG)}
    for p in (ACPolicy.SELECTIVE, ACPolicy.FULL):
        out[p] = ddp_plan(tiny, mesh, BIG, p)
    return {p: (plan.estimate.memory_bytes, plan.info["objective_s"], plan) for p, plan in out.items()}


def test_no_memory_pressure_runs_no_checkpointing(uniform):
    plan = uniform[ACPolicy.NONE][2]
    assert plan.ac.describe() == "none"
    assert plan.info["ilp"]["checkpointing"]["decided"]


def test_a_fixed_policy_is_not_decided(uniform):
    for p in (ACPolicy.SELECTIVE, ACPolicy.FULL):
        plan = uniform[p][2]
        assert plan.ac.describe() == p.value
        assert not plan.info["ilp"]["checkpointing"]["decided"]
    mem = [uniform[p][0] for p in (ACPolicy.FULL, ACPolicy.SELECTIVE, ACPolicy.NONE)]
    obj = [uniform[p][1] for p in (ACPolicy.NONE, ACPolicy.SELECTIVE, ACPolicy.FULL)]
    assert mem == sorted(set(mem)) and obj == sorted(set(obj))


def test_a_budget_between_policies_mixes_them_exactly(tiny, mesh, uniform):
    """With a budget between all-none and all-selective, some layers run none and the others
    checkpoint; the memory row at the solution is exactly the layers' mix of the uniform ones
    (the linearisation is exact), within the budget, and the objective lies between."""
    (m_none, o_none, _), (m_sel, o_sel, _), (m_full, o_full, _) = (
        uniform[p] for p in (ACPolicy.NONE, ACPolicy.SELECTIVE, ACPolicy.FULL))
    budget = (m_none + m_sel) / 2
    plan = ddp_plan(tiny, mesh, budget)
    (g,) = plan.ac.groups
    assert 0 < g.none < LAYERS and g.selective + g.full > 0
    mix = m_none + (g.selective * (m_sel - m_none) + g.full * (m_full - m_none)) / LAYERS
    assert plan.estimate.memory_bytes == pytest.approx(mix, rel=1e-9)
    assert plan.estimate.memory_bytes <= budget
    assert o_none < plan.info["objective_s"] < o_full
    # The more memory, the fewer layers recompute.
    roomier = ddp_plan(tiny, mesh, (budget + m_none) / 2).ac.groups[0]
    assert roomier.none >= g.none


def test_no_policy_fits_a_budget_under_full(tiny, mesh, uniform):
    assert ddp_plan(tiny, mesh, uniform[ACPolicy.FULL][0] * 0.9).status in NO_PLAN


def test_hand_plans_run_the_first_policy_that_fits_and_auto_beats_them(tiny, mesh):
    """A limit under the no-checkpointing step's peak: every hand plan that applies runs the
    first of none, selective, full that fits by the schedule, and the auto plan fits and is
    at least as fast as each of them."""
    limit = 20 * MiB
    auto, hand = plan_with_baselines(tiny, mesh, memory_budget=limit, step_options={})
    assert auto.ac is not None and auto.info["schedule"]["fits"]
    for name, b in hand.items():
        if b is None or b.status in NO_PLAN:
            continue
        s = b.info["schedule"]
        assert s["fits"] and s["options"]["ac"] != "none", name
        assert price_plan(tiny, b, mesh, {"ac": ACPolicy.NONE}, limit).fits is False
        assert auto.info["schedule"]["step_s"] <= s["step_s"] * (1 + 1e-9), name
    assert price_plan(tiny, auto, mesh, {}, limit).step_s == pytest.approx(auto.info["schedule"]["step_s"],
                                                                             rel=1e-12)


def _cli(*args: str) -> dict:
    return json_object(cli(*args, "--json"))


def test_cli_plan_prints_the_chosen_ac_and_estimate_of_the_saved_plan_agrees(tmp_path):
    model = ("--model", "llama-tiny", "--layers", str(LAYERS), "--batch", str(BATCH), "--seq", str(SEQ),
             "--mesh", "2", "--hardware", "h100")
    path = tmp_path / "auto.json"
    out = _cli("plan", *model, "--memory", "20MiB", "--save", str(path))
    auto = out["plans"]["auto"]
    assert auto["fits"] and auto["ac"] == out["ac_policy"] != "none"
    assert not out["ac_given"]
    est = _cli("estimate", *model, "--memory", "20MiB", "--plan", str(path))
    assert est["ac"] == auto["ac"] and est["fits"]
    assert est["step_s"] == pytest.approx(auto["step_s"], rel=1e-9)
    fixed = _cli("plan", *model, "--ac", "full", "--no-baselines")
    assert fixed["ac_policy"] == fixed["plans"]["auto"]["ac"] == "full" and fixed["ac_given"]


@pytest.mark.parametrize("ac", [None, ACPolicy.SELECTIVE, ACPolicy.FULL])
def test_the_memory_row_holds_the_moved_activations_the_backward_keeps(tiny, ac):
    """Under sequence parallelism the layers' norm outputs are gathered for the forward's
    matmuls and the backward's weight gradients read the same gathered copy: the step keeps it
    (the schedule's saved activations named ``x -> placement``), and the ILP's memory row counts
    exactly those bytes beyond the activations themselves, whatever the checkpointing."""
    from shardwise.mesh import parse_mesh
    from shardwise.plan.ilp import MemoryModel
    from shardwise.plan.planner import prepare_plan

    mesh = parse_mesh("2x2", "dp,tp", "h100")
    so = {} if ac is None else {"ac": ac}
    # One plan, its memory row in two models: with and without the moved copies. (Each model
    # solved on its own may pick another of the plans that tie on the objective.)
    rows = {moved: prepare_plan(tiny, mesh, baseline="fsdp_tp_sp", memory_budget=BIG, step_options=so,
                                memory=MemoryModel(moved_copies=moved)) for moved in (False, True)}
    plan = rows[True].finish()
    est = price_plan(tiny, plan, mesh, so)
    kept = sum(lt.size for lt in est.schedule.lifetimes
               if lt.category == "saved_activations" and " -> " in lt.name)
    assert kept > 0
    moved = _memory_row_at(rows[True], plan) - _memory_row_at(rows[False], plan)
    assert moved == pytest.approx(kept, rel=1e-9)


def _memory_row_at(prepared, plan) -> float:
    """The bytes the ILP's memory row holds at ``plan`` (a point of the prepared model)."""
    from shardwise.plan.ilp import _start_vector
    from shardwise.plan.planner import _choices_of

    model = prepared.model
    choice = _choices_of(plan, prepared.ns, prepared.clus)
    assert choice is not None
    val = _start_vector(model.m, model.deciding, choice, model.one, model.checkpointing, plan.ac)
    return sum(b * val[v] for v, b in model.mem_terms.items())



def _lp_runs(tiny, mesh, baseline):
    """The ILP of ``baseline`` (placements fixed, checkpointing decided) under no memory
    pressure, and its LP started without the memory row and whole."""
    from shardwise.plan.ilp import OBJECTIVE_UNIT_S
    from shardwise.plan.planner import prepare_plan
    from shardwise.plan.solver import LpRun

    model = prepare_plan(tiny, mesh, baseline=baseline, memory_budget=BIG, step_options={"ac": None}).model
    return model, [LpRun(model.m, OBJECTIVE_UNIT_S, 60.0, background=False, memory=memory)
                   for memory in (False, True)]


@pytest.mark.parametrize("mesh_name, baseline", [("2", "ddp"), ("2x2", "fsdp_tp_sp")])
def test_the_lp_without_the_memory_row_is_the_whole_lp_where_its_point_keeps_to_it(tiny, mesh_name, baseline):
    """The interior-point LP first runs without the memory row and what only that row reads
    (``solver.MemoryPart``: the checkpointing counts and spreads, the kept moved copies): a
    smaller LP. Under no memory pressure its point (no checkpointing) keeps to the row, and its
    bound is the whole LP's, with no second LP."""
    from shardwise.mesh import parse_mesh

    mesh = parse_mesh(mesh_name, "dp,tp" if "x" in mesh_name else None, "h100")
    _, (first, whole) = _lp_runs(tiny, mesh, baseline)
    assert first.lp.num_col_ < whole.lp.num_col_ and first.lp.num_row_ < whole.lp.num_row_
    assert first.result().bound == pytest.approx(whole.result().bound, rel=1e-5)
    assert not first.memory  # no second LP


def test_an_lp_whose_point_breaks_the_memory_row_is_solved_whole(tiny, mesh, uniform):
    """Under a budget between no checkpointing and selective, the point of the LP without the
    memory row (no checkpointing) breaks it: the whole LP is solved instead, its bound higher."""
    from shardwise.plan.ilp import OBJECTIVE_UNIT_S
    from shardwise.plan.solver import LpRun

    model, (first, _) = _lp_runs(tiny, mesh, "ddp")
    slack = first.result()
    model.set_budget((uniform[ACPolicy.NONE][0] + uniform[ACPolicy.SELECTIVE][0]) / 2)
    tight = first.result()
    assert first.memory  # the row broke: the whole LP
    whole = LpRun(model.m, OBJECTIVE_UNIT_S, 60.0, background=False, memory=True)
    assert tight.bound == pytest.approx(whole.result().bound, rel=1e-5)
    assert tight.bound > slack.bound * (1 + 1e-4)
