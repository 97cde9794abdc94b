"""The points the schedule objective's solve works from: the LP point rounded with its activation
checkpointing counts kept (``solver.round_lp``), completed (``solver.complete``), hand plans that
start the ILP with more checkpointing than they run, and a planner that solves and prices no
more than its bounds ask for (``planner._fit_by_schedule``, ``planner._Pricer``)."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

import shardwise.cost.step as step
import shardwise.plan.objective as objective
import shardwise.plan.planner as planner
from shardwise.passes.remat import ACPolicy
from shardwise.plan import make_plan, solver
from shardwise.plan.planner import plan_with_baselines
from tests.helpers import AC_LAYERS as LAYERS
from tests.helpers import ddp_plan

BIG = 2**40  # a budget nothing reaches
NO_TIME_S = 1e-9  # HiGHS stops before it has read the start point


@pytest.fixture(scope="module")
def tiny(tiny_four_layers):
    return tiny_four_layers


@pytest.fixture(scope="module")
def mesh(mesh_of_two):
    return mesh_of_two


@pytest.mark.parametrize(("values", "total", "upper", "want"), [
    ([0.2, 0.7, 0.1], 1, [1, 1, 1], [0, 1, 0]),  # one-hot: the largest
    ([0.34, 0.33, 0.33], 1, [1, 1, 1], [1, 0, 0]),  # a tie goes to the first
    ([1.4, 2.3, 0.3], 4, [4, 4, 4], [2, 2, 0]),  # floors 1 + 2, the largest remainder gets the 4th
    ([1.0000001, 2.9999999, -1e-9], 4, [4, 4, 4], [1, 3, 0]),  # an interior point's noise
    ([3.6, 0.4, 0.0], 4, [2, 4, 4], [2, 2, 0]),  # within the upper bounds
    ([0.0, 0.0, 0.0], 4, [4, 4, 4], [4, 0, 0]),  # nothing decided: the total still holds
])
def test_round_group_keeps_the_total(values, total, upper, want):
    got = solver.round_group(np.array(values, dtype=float), total, np.array(upper, dtype=float))
    assert got.tolist() == want and got.sum() == total


def test_complete_sets_edges_then_moves_then_blocks():
    """Columns: x0 x1 | x2 x3 (one-hot), e4 (x0 -> x2), e5 (x1 -> x3), a move t6 >= 2 e4, 3 e5,
    a block w7 >= t6 + e4 and >= 0 (read after t6), and c8 set by ``fill``."""
    m = solver.Model()
    for _ in range(4):
        m.var(0.0)
    m.vars(2)
    t, w = m.var(1.0, ub=math.inf, integer=False), m.var(1.0, ub=math.inf, integer=False)
    c = m.var(0.0, ub=5.0, integer=False)
    m.ends = {4: ([0], [2]), 5: ([1], [3])}
    m.t_rows = {t: [{4: 2.0}, {5: 3.0}], w: [{t: 1.0, 4: 1.0}, {}]}
    m.fill = lambda val: val.__setitem__(c, 2.0 * val[0])
    for x0, x2, e4, e5, tv, wv in [(1, 1, 1, 0, 2, 3), (0, 0, 0, 1, 3, 3), (1, 0, 0, 0, 0, 0)]:
        val = np.zeros(9)
        val[0 if x0 else 1] = val[2 if x2 else 3] = 1.0
        got = solver.complete(m, val)
        assert got[[4, 5, 6, 7, 8]].tolist() == [e4, e5, tv, wv, 2.0 * x0]


def test_rounding_the_lp_keeps_the_checkpointing_counts(tiny, mesh, monkeypatch):
    """With the budget between all-none and all-selective the LP mixes policies; its point
    rounded keeps each group's counts summing to its layers, with the spread columns filled,
    and breaks no row but (perhaps) the memory row."""
    models = []
    real = objective.solve_by_lp_bound

    def spy(m, unit, *args, **kw):
        models.append((m, unit))
        return real(m, unit, *args, **kw)

    none = ddp_plan(tiny, mesh, BIG, ACPolicy.NONE).estimate.memory_bytes
    selective = ddp_plan(tiny, mesh, BIG, ACPolicy.SELECTIVE).estimate.memory_bytes
    monkeypatch.setattr(objective, "solve_by_lp_bound", spy)
    plan = ddp_plan(tiny, mesh, (none + selective) / 2)
    assert plan.ac.groups[0].none < LAYERS  # checkpointing was decided, and some layers use it
    m, unit = models[-1]
    counts = [(cols, total) for cols, total in solver._integer_groups(m) if total == LAYERS]
    assert counts  # the row n[none] + n[selective] + n[full] = layers
    lp = solver._lp_bound(m, unit, 60.0)
    rounded, _ = solver.round_lp(m, lp.primal)
    for cols, total in counts:
        assert rounded[cols].sum() == total and np.all(rounded[cols] == np.round(rounded[cols]))
    m.row_ub[m.memory_row] = math.inf
    assert solver.violated_rows(m, rounded) == 0


def test_a_hand_plan_too_big_without_checkpointing_starts_the_ilp_with_it(tiny, mesh):
    """ddp as it runs (no checkpointing) breaks the budget; with full checkpointing it fits, so
    it is the start point and, without time to search, the plan."""
    hand = ddp_plan(tiny, mesh, BIG, ACPolicy.NONE)
    full = ddp_plan(tiny, mesh, BIG, ACPolicy.FULL).estimate.memory_bytes
    budget = (hand.estimate.memory_bytes + full) / 2
    assert hand.estimate.memory_bytes > budget
    auto = make_plan(tiny, mesh, memory_budget=budget, step_options={}, start_from=[hand],
                     time_limit_s=NO_TIME_S)
    assert auto.status == "feasible" and auto.info["started_from"] == "ddp"
    assert auto.params == hand.params and auto.ac.describe() != "none"
    # Without checkpointing decided there is no such start: nothing fits.
    fixed = make_plan(tiny, mesh, memory_budget=budget, step_options={"ac": ACPolicy.NONE}, start_from=[hand],
                      time_limit_s=NO_TIME_S)
    assert fixed.status == "unsolved"


def test_no_memory_pressure_one_auto_solve_and_each_plan_priced_once(tiny, mesh, monkeypatch):
    """The budget is far from binding: the ILP's budget-free bound shows that no larger budget
    pays, so the auto ILP is solved once; and no plan is laid out on the schedule twice."""
    solves, priced = Counter(), Counter()
    real_prepare, real_price = planner.prepare_plan, step.price_plan

    def prepare(*args, **kw):  # every ILP is built by it: make_plan's and plan_with_baselines' own
        solves[kw.get("baseline")] += 1
        return real_prepare(*args, **kw)

    def price(traced, plan, *args, **kw):
        priced[(id(plan), plan.ac)] += 1
        return real_price(traced, plan, *args, **kw)

    monkeypatch.setattr(planner, "prepare_plan", prepare)
    monkeypatch.setattr(step, "price_plan", price)
    auto, _ = plan_with_baselines(tiny, mesh, step_options={})
    assert auto.info["schedule"]["fits"]
    assert auto.info["bound_any_budget_s"] <= auto.info["bound_s"] <= auto.info["objective_s"]
    assert solves[None] == 1
    assert priced and max(priced.values()) == 1


def test_the_budget_fit_follows_the_peaks_line_when_the_overhead_grows():
    """A model where what the schedule holds beyond the ILP's memory row grows as the budget
    shrinks (peak = 80 + 0.2 x budget GiB, limit 90): the limit less the last overhead alone
    creeps down (96 -> 94.6 -> 93.5 -> 92.6 -> 91.9 GiB) and no plan fits in FIT_ROUNDS;
    stepping where the line through the last two peaks meets the limit, the second re-solve fits."""
    from types import SimpleNamespace

    gib = 2.0**30
    limit = 90 * gib

    def plan_at(budget):
        estimate = SimpleNamespace(memory_bytes=budget, total_s=1.0)
        return SimpleNamespace(status="feasible", ac=None, estimate=estimate,
                               info={"memory_budget_bytes": budget, "bound_s": 1.0,
                                     "objective_s": 1.0 + 1e-3 * (80 * gib - budget) / gib})

    def price(plan):
        peak = 80 * gib + 0.2 * plan.info["memory_budget_bytes"]
        return SimpleNamespace(fits=peak <= limit, step_s=plan.info["objective_s"],
                               memory_per_device_bytes=peak, ac=None)

    solved = []

    def again(budget, start_from, time_limit_s):
        solved.append(budget)
        return plan_at(budget)

    prepared = SimpleNamespace(time_limit_s=60.0, finish_again=again, alternatives=[])
    got = planner._fit_by_schedule(prepared, plan_at(80 * gib), limit, [], price)
    assert price(got).fits
    assert price(plan_at(solved[1])).fits  # the second re-solve, on the line


@pytest.mark.parametrize(("hand_step_s", "hand_fits", "again"), [(1.5, True, False), (2.5, True, True),
                                                              (1.5, False, True)])
def test_the_budget_fit_stops_where_a_hand_plan_that_fits_is_faster_already(hand_step_s, hand_fits, again):
    """The ILP's plan does not fit (peak 100 against a 90 GiB limit) and runs 2 s: a lower budget's
    plan would be slower still, so with a hand plan that fits at 1.5 s no re-solve is made; a
    slower hand plan, or one that does not fit, leaves the fit to go on."""
    from types import SimpleNamespace

    gib = 2.0**30
    limit = 90 * gib

    def plan_at(budget):
        estimate = SimpleNamespace(memory_bytes=budget, total_s=1.0)
        return SimpleNamespace(status="feasible", ac=None, estimate=estimate,
                               info={"memory_budget_bytes": budget, "bound_s": 1.0, "objective_s": 2.0})

    hand = SimpleNamespace(fits=hand_fits, step_s=hand_step_s, memory_per_device_bytes=limit, ac=None)

    def price(plan):
        if plan == "hand":
            return hand
        peak = plan.info["memory_budget_bytes"] + 20 * gib
        return SimpleNamespace(fits=peak <= limit, step_s=2.0, memory_per_device_bytes=peak, ac=None)

    solved = []

    def solve_again(budget, start_from, time_limit_s):
        solved.append(budget)
        return plan_at(budget)

    prepared = SimpleNamespace(time_limit_s=60.0, finish_again=solve_again, alternatives=[])
    planner._fit_by_schedule(prepared, plan_at(80 * gib), limit, ["hand"], price)
    assert bool(solved) == again


@pytest.mark.parametrize(("row_gib", "solves"), [(1.2, 0), (60.0, 1)])
def test_the_budget_fit_tries_a_larger_budget_only_where_the_row_is_near_it(row_gib, solves):
    """A plan that fits (the solver stopped at its time limit: its bounds are no help): its memory
    row at 1.2 of a 67 GiB budget (Phi-3, 1 layer, 2x2), no larger budget is tried; at 60 GiB one
    is (the schedule's peak leaves room under the 80 GiB limit)."""
    from types import SimpleNamespace

    gib = 2.0**30
    limit, budget = 80 * gib, 67 * gib

    def plan_at(budget, row):
        estimate = SimpleNamespace(memory_bytes=row, total_s=1.0)
        return SimpleNamespace(status="feasible", ac=None, estimate=estimate,
                               info={"memory_budget_bytes": budget, "bound_s": 0.0, "bound_any_budget_s": 0.0,
                                     "objective_s": 1.0})

    def price(plan):
        peak = plan.estimate.memory_bytes + 1.3 * gib
        return SimpleNamespace(fits=peak <= limit, step_s=1.0, memory_per_device_bytes=peak, ac=None)

    solved = []

    def again(budget, start_from, time_limit_s):
        solved.append(budget)
        return plan_at(budget, row_gib * gib)

    prepared = SimpleNamespace(time_limit_s=60.0, finish_again=again, alternatives=[])
    first = plan_at(budget, row_gib * gib)
    got = planner._fit_by_schedule(prepared, first, limit, [], price)
    assert len(solved) == solves and price(got).fits
    assert all(b > budget for b in solved)


def test_the_other_plans_a_solve_finds_are_handed_to_the_schedule(monkeypatch):
    """The plans of the auto ILP's solve besides its solution (here the rounded LP point, dearer
    than the neighbourhood's plan) reach the step schedule's choice as plans of their own: other
    placements, priced at their own objective, and none faster than the auto plan by more than
    ALTERNATIVE_GAIN."""
    from shardwise.ir.trace import trace_model
    from shardwise.mesh import parse_mesh
    from shardwise.passes.pipeline import canonicalize

    tr = trace_model("llama-tiny", layers=1, batch=8, seq=64)
    canonicalize(tr)
    mesh = parse_mesh("4", None, "h100")
    seen = []
    real = planner._fastest_solution

    def fastest(plan, others, price):
        seen.append((plan, list(others), price))
        return real(plan, others, price)

    monkeypatch.setattr(planner, "_fastest_solution", fastest)
    auto, _ = plan_with_baselines(tr, mesh, step_options={"ac": ACPolicy.NONE}, rel_gap=0.5)
    (plan, others, price), = seen
    assert others
    for other in others:
        assert other.nodes != plan.nodes
        assert other.info["objective_s"] >= plan.info["objective_s"] * (1 - 1e-9)
        assert price(other).step_s >= auto.info["schedule"]["step_s"] * (1 - planner.ALTERNATIVE_GAIN)
