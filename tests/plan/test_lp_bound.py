"""The schedule objective's solve from its interior-point LP bound (``solver.solve_by_lp_bound``)
is exact: the same optimum as HiGHS's MIP on the whole model, with a bound that is a bound, on
small configs; under a tight memory budget too; and a relative gap stops it early only within
that gap."""

from __future__ import annotations

import numpy as np
import pytest

from shardwise.cost.step import torchtitan_options
from shardwise.plan import ilp, solver
from shardwise.plan.objective import ScheduleObjective
from shardwise.plan.planner import default_budget
from tests.plan.test_pricing import CASES, REL, TIME_LIMIT_S, _problem

LOOSE_GAP = 0.5


def _solve(problem, budget: float, **kw):
    tr, ns, clus, costs = problem
    schedule = ScheduleObjective(tr, clus, costs, torchtitan_options(tr))
    return ilp.solve(tr, ns, clus, costs, memory_budget=budget, time_limit_s=TIME_LIMIT_S, schedule=schedule,
                     **kw)


def _built(problem, budget: float) -> ilp.IlpModel:
    """The schedule objective's ILP of ``problem`` under ``budget``, not solved."""
    tr, ns, clus, costs = problem
    return ilp.build(tr, ns, clus, costs, memory_budget=budget,
                     schedule=ScheduleObjective(tr, clus, costs, torchtitan_options(tr)))


def _floor(problem) -> int:
    """The smallest memory row any plan of ``problem`` reaches (every value fully sharded)."""
    tr, ns, clus, costs = problem
    return ilp.solve(tr, ns, clus, costs, memory_budget=1.0, time_limit_s=TIME_LIMIT_S).min_memory_bytes


@pytest.fixture(scope="module")
def tiny():
    model, mesh, shape = CASES["llama-tiny 4"]
    return _problem(model, mesh, **shape), mesh


@pytest.mark.parametrize("case", ["llama-tiny 4", "hf qwen2 2x2"])
def test_the_lp_bound_solve_finds_the_whole_models_optimum(case):
    model, mesh, shape = CASES[case]
    problem = _problem(model, mesh, **shape)
    by_bound = _solve(problem, default_budget(mesh))
    whole = _solve(problem, default_budget(mesh), pricing=False)
    assert whole.status == by_bound.status == "optimal"
    assert by_bound.objective_s == pytest.approx(whole.objective_s, rel=REL)
    assert by_bound.bound_s <= by_bound.objective_s
    # reduced-cost fixing left the last MIP fewer columns than the model has
    assert by_bound.stats["columns_solved"] < by_bound.n_vars


@pytest.mark.parametrize("times_floor", [1.2, 1.5])
def test_under_a_tight_budget_the_lp_bound_solve_is_exact(tiny, times_floor):
    problem, _ = tiny
    floor = _floor(problem)
    whole = _solve(problem, times_floor * floor, pricing=False)
    by_bound = _solve(problem, times_floor * floor)
    assert whole.status == by_bound.status == "optimal"
    assert by_bound.objective_s == pytest.approx(whole.objective_s, rel=REL)


@pytest.fixture
def tolerances(monkeypatch) -> list:
    """The interior-point tolerance of every LP started (None: HiGHS's own)."""
    seen = []
    real_run = solver.LpRun.__init__

    def run(self, m, unit, time_limit_s, tolerance=None, **kw):
        seen.append(tolerance)
        real_run(self, m, unit, time_limit_s, tolerance, **kw)

    monkeypatch.setattr(solver.LpRun, "__init__", run)
    return seen


def test_a_loose_gap_stops_within_it(tiny, tolerances):
    problem, mesh = tiny
    whole = _solve(problem, default_budget(mesh), pricing=False)
    early = _solve(problem, default_budget(mesh), rel_gap=LOOSE_GAP)
    assert tolerances == [pytest.approx(LOOSE_GAP / 10)]  # a loose gap: a tenth of it for the interior point
    assert early.objective_s >= whole.objective_s * (1 - REL)
    assert early.bound_s <= whole.objective_s * (1 + REL)
    assert early.objective_s - early.bound_s <= LOOSE_GAP * early.objective_s
    tolerances.clear()
    exact = _solve(problem, default_budget(mesh))
    assert tolerances == [None]  # to the optimum: HiGHS's own tolerance
    assert exact.objective_s == pytest.approx(whole.objective_s, rel=REL)


def test_an_lp_that_fails_is_run_again_only_if_it_was_the_loose_one(tiny, tolerances, monkeypatch):
    """A loose LP without an optimal status is solved again at HiGHS's tolerance; one at that
    tolerance which failed is not (the MIP gets the time), and the solve still gives a plan."""
    problem, mesh = tiny
    monkeypatch.setattr(solver.LpRun, "result", lambda self: None)  # every LP ends without a bound
    loose = _solve(problem, default_budget(mesh), rel_gap=LOOSE_GAP)
    assert tolerances == [pytest.approx(LOOSE_GAP / 10), None]
    tolerances.clear()
    exact = _solve(problem, default_budget(mesh))
    assert tolerances == [None]
    assert loose.status in ("optimal", "feasible") and exact.status == "optimal"


def test_the_lp_bound_holds_for_any_duals():
    """min x0 + 2 x1 s.t. x0 + x1 = 1 (one-hot), x in {0,1}: the optimum is 1; the bound from
    the interior point's duals is at most it, and close to it (the LP is tight here)."""
    m = solver.Model()
    a, b = m.var(1.0), m.var(2.0)
    m.row(1.0, 1.0, {a: 1.0, b: 1.0})
    for tolerance in (None, solver.loose_ipm_tolerance(0.01)):
        got = solver._lp_bound(m, 1.0, TIME_LIMIT_S, tolerance)
        assert got is not None and got.bound <= 1.0 + 1e-9 and got.bound == pytest.approx(1.0, abs=1e-4)
    done = solver.solve_by_lp_bound(m, 1.0, TIME_LIMIT_S, None)
    assert done.status == "optimal" and np.round(done.solution).tolist() == [1.0, 0.0]



def test_an_lp_started_ahead_is_the_solves_own(tiny):
    """The LP relaxation run in a background thread (``ilp.IlpModel.start_lp``) gives the bound
    the solve would have computed itself, and the same plan; an LP of another model is refused."""
    problem, mesh = tiny
    model = _built(problem, default_budget(mesh))
    model.start_lp(TIME_LIMIT_S)
    assert model.lp_ahead is not None and model.lp_ahead._thread is not None  # runs in the background
    ahead = ilp.solve_built(model, time_limit_s=TIME_LIMIT_S)
    itself = ilp.solve_built(_built(problem, default_budget(mesh)), time_limit_s=TIME_LIMIT_S)
    assert ahead.status == itself.status == "optimal"
    assert ahead.choice == itself.choice and ahead.bound_s == pytest.approx(itself.bound_s, rel=1e-9)
    other = _built(problem, default_budget(mesh))
    other.lp_ahead = model.lp_ahead
    with pytest.raises(ValueError, match="another model's"):
        ilp.solve_built(other, time_limit_s=TIME_LIMIT_S)


def test_plan_with_baselines_prices_the_hand_plans_while_the_auto_lp_runs(tiny, monkeypatch):
    """The auto ILP's LP relaxation starts before the first hand plan is priced, and the auto
    solve takes that LP's result instead of solving it again."""
    from shardwise.plan import planner

    problem, mesh = tiny
    events = []
    real_run, real_make, real_solve = solver.LpRun.__init__, planner.make_plan, solver.solve_by_lp_bound

    def run(self, m, *args, background=True, **kw):
        events.append(("lp", background))
        real_run(self, m, *args, background=background, **kw)

    def make(*args, **kw):
        events.append(("hand", kw.get("baseline")))
        return real_make(*args, **kw)

    def solve(m, unit, time_limit_s, start, rel_gap, ahead=None):
        events.append(("solve", ahead is not None and ahead.m is m))
        return real_solve(m, unit, time_limit_s, start, rel_gap, ahead)

    monkeypatch.setattr(solver.LpRun, "__init__", run)
    monkeypatch.setattr(planner, "make_plan", make)
    monkeypatch.setattr(solver, "solve_by_lp_bound", solve)
    monkeypatch.setattr("shardwise.plan.objective.solve_by_lp_bound", solve)
    auto, hand = planner.plan_with_baselines(problem[0], mesh, step_options={"ac": None})
    assert auto.status in ("optimal", "feasible") and any(p is not None for p in hand.values())
    first_hand = next(i for i, e in enumerate(events) if e[0] == "hand")
    assert events[0] == ("lp", True) and first_hand > 0  # the auto LP first, in the background
    assert ("solve", True) in events  # ... and the auto solve used it



def test_a_process_that_exits_while_an_lp_runs_exits_cleanly():
    """A CLI that fails (exit 2) while the LP started ahead still runs must exit with its own
    code: HiGHS running while Python shuts down aborts the process (exit 134)."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import sys
        import numpy as np
        from shardwise.plan import solver
        m = solver.Model()
        cols = [m.var(float(c)) for c in np.random.default_rng(0).random(100_000)]
        for k in range(0, len(cols), 50):
            m.row(1.0, 1.0, {c: 1.0 for c in cols[k:k + 50]})
        for k in range(50):
            m.row(0.0, 2500.0, {c: 1.0 for c in cols[k::50]})
        run = solver.LpRun(m, 1.0, 60.0)
        print(run._thread.is_alive(), flush=True)
        sys.exit(2)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "terminate called" not in done.stderr


def test_the_bound_of_the_row_scaled_lp_is_the_lp_optimum_of_the_rows_as_written():
    """The interior point solves rows divided by their largest coefficient; the point and the
    bound are those of the rows as the model writes them (a bound from the scaled rows' duals
    taken as the written rows' would be off by the factors, 1e6 here)."""
    m = solver.Model()
    x1, x2 = m.var(0.0), m.var(0.0)
    w = m.var(1.0, ub=1e7, integer=False)
    m.row(1.0, 1.0, {x1: 1.0, x2: 1.0})
    m.row(0.0, np.inf, {w: 1.0, x1: -3e6, x2: -1e6})  # w >= 3e6 x1 + 1e6 x2
    m.row(0.0, np.inf, {w: 1.0, x2: -4e6})  # w >= 4e6 x2
    run = solver.LpRun(m, 1.0, TIME_LIMIT_S, background=False)
    assert run.row_scale.tolist() == pytest.approx([1.0, 1 / 3e6, 1 / 4e6])
    got = run.result()
    # the max of the two rows is least at x2 = 1/2: w = 2e6 (the whole plans cost 3e6 and 4e6)
    assert got.bound == pytest.approx(2e6, rel=1e-6)
    assert got.primal[x2] == pytest.approx(0.5, abs=1e-6) and got.primal[w] == pytest.approx(2e6, rel=1e-6)
    assert solver.violated_rows(m, np.round(got.primal, 6)) == 0


def test_the_part_the_lp_leaves_out_lowers_its_bound_and_the_solve_prices_it():
    """``Model.relaxed_from``: the interior point solves the model without its last columns
    (at least 0, in the cost) and the rows that read them, a relaxation whose bound holds; the
    point it returns covers the whole model, and the solve from it prices the part left out."""
    m = solver.Model()
    x1, x2 = m.var(1.0), m.var(2.0)
    m.row(1.0, 1.0, {x1: 1.0, x2: 1.0})
    m.relaxed_from = (len(m.cost), len(m.row_lb))
    d = m.var(1.0, ub=np.inf, integer=False)
    m.at_least(d, [{x1: 5.0}])  # x1 costs 1 + 5, x2 costs 2: the optimum is x2
    got = solver.LpRun(m, 1.0, TIME_LIMIT_S, background=False).result()
    assert got.bound == pytest.approx(1.0, abs=1e-6)  # x1 alone, the drain left out
    assert len(got.primal) == len(m.cost) and got.primal[d] == 0.0
    solved = solver.solve_by_lp_bound(m, 1.0, TIME_LIMIT_S, None)
    assert solved.objective == pytest.approx(2.0, abs=1e-6)
    assert solved.solution[x2] == pytest.approx(1.0) and solved.bound <= solved.objective + 1e-9


def test_a_model_solved_again_under_another_budget_keeps_its_lp_and_finds_its_optimum(tiny, tolerances):
    """``IlpModel.set_budget`` (the planner's budget fit): the same model under a tighter memory
    budget, solved again, finds the optimum of a model built with that budget, within it, and
    its bound is a bound. The first LP left the memory row out (its point kept to the default
    budget): the tighter budget solves the whole LP once, and a third budget none."""
    problem, mesh = tiny
    model = _built(problem, default_budget(mesh))
    model.start_lp(TIME_LIMIT_S)
    first = ilp.solve_built(model, time_limit_s=TIME_LIMIT_S)
    tight = 1.2 * _floor(problem)
    assert first.memory_bytes > tight  # the first plan breaks the tighter budget
    model.set_budget(1.5 * _floor(problem))
    tolerances.clear()
    ilp.solve_built(model, time_limit_s=TIME_LIMIT_S)
    assert tolerances == [None]  # the whole LP, once
    model.set_budget(tight)
    again = ilp.solve_built(model, time_limit_s=TIME_LIMIT_S)
    assert tolerances == [None]  # kept: no interior point solved again
    fresh = ilp.solve_built(_built(problem, tight), time_limit_s=TIME_LIMIT_S)
    assert again.status == fresh.status == "optimal"
    assert again.objective_s == pytest.approx(fresh.objective_s, rel=REL)
    assert again.objective_s > first.objective_s
    assert again.memory_bytes <= tight * (1 + REL)
    assert again.bound_s <= fresh.objective_s * (1 + REL)


def test_a_solve_again_gives_the_whole_lp_it_needs_its_own_time(tiny, tolerances):
    """Solved again under a budget the first LP's point breaks, the model solves the whole LP
    within the time of that solve, not what was left of the first LP's: a budget fit's re-solve
    comes after the hand plans and the first solve (on Gemma-2, 26 layers over 2x4, its whole LP
    had 6.4 s left of its 27 and stopped, and the MIP over every column ran to the stall)."""
    problem, mesh = tiny
    model = _built(problem, default_budget(mesh))
    model.start_lp(TIME_LIMIT_S)
    first = ilp.solve_built(model, time_limit_s=TIME_LIMIT_S)
    lp = model.lp_ahead
    lp.deadline = 0.0  # the first LP's time is spent
    tight = 1.2 * _floor(problem)
    assert first.memory_bytes > tight
    model.set_budget(tight)
    tolerances.clear()
    again = ilp.solve_built(model, time_limit_s=TIME_LIMIT_S)
    assert tolerances == [None]  # the whole LP, once, in ``lp``'s HiGHS from then on
    _, whole_limit_s = lp.h.getOptionValue("time_limit")
    assert whole_limit_s > 0.5 * solver.LP_BOUND_SHARE * TIME_LIMIT_S
    assert lp.h.getModelStatus() in solver._SOLVED
    assert again.status == "optimal" and again.memory_bytes <= tight * (1 + REL)


def test_an_lp_solved_under_a_tight_budget_bounds_a_larger_one_no_worse_than_without_its_row(tiny):
    """The LP solved under a tight budget, asked again for a larger one (the budget fit's way up):
    the Lagrangian bound with its memory multiplier falls as the budget grows, and the same duals
    without that multiplier bound every budget: the larger of the two is taken, with the reduced
    costs that go with it, and stays a bound on the larger budget's optimum."""
    problem, mesh = tiny
    model = _built(problem, 1.2 * _floor(problem))
    model.start_lp(TIME_LIMIT_S)
    tight = model.lp_ahead.result()
    assert tight is not None and tight.bound > tight.any_budget  # the memory row binds the LP
    model.set_budget(100 * default_budget(mesh))
    loose = model.lp_ahead.result()
    assert loose.bound == pytest.approx(tight.any_budget)
    assert loose.any_budget == pytest.approx(tight.any_budget)
    optimum = ilp.solve_built(model, time_limit_s=TIME_LIMIT_S)
    assert optimum.status == "optimal"
    assert loose.bound * ilp.OBJECTIVE_UNIT_S <= optimum.objective_s * (1 + REL)


def test_a_loose_gap_gives_the_last_mip_at_most_its_own_time(tiny, monkeypatch):
    """Where no plan in hand is within a loose gap, the neighbourhood MIP and the whole MIP after
    it run ``LOOSE_MIP_S`` at most, the last one's stall measured from the LP bound; to the
    optimum it gets all the time left and the stall guard's own rule."""
    problem, mesh = tiny
    limits = []
    real_mip = solver._mip

    def mip(m, unit, time_limit_s, start, upper, h=None, rel_gap=solver.MIP_REL_GAP, loose_from=None):
        limits.append((time_limit_s, rel_gap, loose_from))
        return real_mip(m, unit, time_limit_s, start, upper, h, rel_gap, loose_from)

    monkeypatch.setattr(solver, "_mip", mip)
    monkeypatch.setattr(solver, "_within", lambda *args: False)  # no plan in hand is close enough
    gap = 10 * solver.LOOSE_GAP
    loose = _solve(problem, default_budget(mesh), rel_gap=gap)
    assert limits[-1][1] == gap and 0.0 < limits[-1][0] <= solver.LOOSE_MIP_S
    # the neighbourhood before it too, though half the time left is more
    assert len(limits) == 2
    assert 0.0 < limits[0][0] <= solver.LOOSE_MIP_S < solver.RINS_SHARE * TIME_LIMIT_S / 2
    # measured from the LP bound (the bound the solve returns is the larger of it and the MIP's)
    assert 0.0 < limits[-1][2] <= loose.bound_s / ilp.OBJECTIVE_UNIT_S * (1 + REL)
    limits.clear()
    exact = _solve(problem, default_budget(mesh))
    assert limits[-1][1] == solver.MIP_REL_GAP and limits[-1][0] > solver.LOOSE_MIP_S
    assert limits[-1][2] is None
    assert loose.status in ("optimal", "feasible") and exact.status == "optimal"


def test_a_loose_gap_runs_no_last_mip_where_fixing_leaves_most_columns(tiny, monkeypatch):
    """Where reduced-cost fixing leaves more than ``LOOSE_MIP_MAX_LEFT`` of the columns, a loose
    gap's solve ends after the neighbourhood, with its plan and the LP bound: the last MIP's root
    LP would be most of the model's, by simplex. To the optimum the MIP runs."""
    problem, mesh = tiny
    calls = []
    real_mip = solver._mip

    def mip(*args, **kw):
        calls.append(kw.get("loose_from"))
        return real_mip(*args, **kw)

    monkeypatch.setattr(solver, "_mip", mip)
    monkeypatch.setattr(solver, "_within", lambda *args: False)  # no plan in hand is close enough
    monkeypatch.setattr(solver, "LOOSE_MIP_MAX_LEFT", 0.0)  # any column left is too many
    loose = _solve(problem, default_budget(mesh), rel_gap=10 * solver.LOOSE_GAP)
    assert calls == [None]  # the neighbourhood alone
    assert loose.status == "feasible" and loose.bound_s <= loose.objective_s * (1 + REL)
    calls.clear()
    exact = _solve(problem, default_budget(mesh))
    assert len(calls) == 2 and exact.status == "optimal"
    assert exact.objective_s <= loose.objective_s * (1 + REL)


def _worse_rounding(monkeypatch) -> None:
    """Make ``round_lp`` hand back a dearer point than the LP's rounding: one one-hot group moved
    to another strategy that keeps the point feasible, and nothing fixed for the neighbourhood."""
    real_round = solver.round_lp

    def round_lp(m, primal):
        rounded, _ = real_round(m, primal)
        cost = np.asarray(m.cost)
        for cols, total in solver._integer_groups(m):
            if total != 1 or len(cols) < 2:
                continue
            for other in cols[rounded[cols] < 0.5]:
                point = rounded.copy()
                point[cols] = 0.0
                point[other] = 1.0
                point = solver.complete(m, point)
                if not solver.violated_rows(m, point) and cost @ point > cost @ rounded * (1 + 1e-3):
                    return point, np.array(m.ub, dtype=np.float64)
        raise AssertionError("no dearer feasible rounding")

    monkeypatch.setattr(solver, "round_lp", round_lp)


def test_a_rounded_point_within_the_gap_is_still_polished_by_the_neighbourhood(tiny, monkeypatch):
    """Within even a 100% gap the neighbourhood MIP runs (POLISH_S at most) and its cheaper plan
    is the solution; the dearer rounded point comes back as an alternative, a point of the model."""
    problem, mesh = tiny
    whole = _solve(problem, default_budget(mesh), pricing=False)
    _worse_rounding(monkeypatch)
    limits = []
    real_mip = solver._mip

    def mip(m, unit, time_limit_s, start, upper, h=None, rel_gap=solver.MIP_REL_GAP, loose_from=None):
        limits.append(time_limit_s)
        return real_mip(m, unit, time_limit_s, start, upper, h, rel_gap, loose_from)

    monkeypatch.setattr(solver, "_mip", mip)
    got = _solve(problem, default_budget(mesh), rel_gap=1.0)
    assert len(limits) == 1 and 0.0 < limits[0] <= solver.POLISH_S  # the neighbourhood, and no more
    assert got.objective_s == pytest.approx(whole.objective_s, rel=REL)  # here it holds the optimum
    assert got.alternatives, "the rounded point is no alternative"
    for point in got.alternatives:
        assert point.choice != got.choice
        assert point.objective_s > got.objective_s


def test_the_solves_other_points_are_distinct_plans_no_cheaper_than_its_solution():
    model_name, mesh, shape = CASES["hf qwen2 2x2"]
    model = _built(_problem(model_name, mesh, **shape), default_budget(mesh))
    got = ilp.solve_built(model, time_limit_s=TIME_LIMIT_S, rel_gap=LOOSE_GAP)
    assert got.alternatives  # here the rounded LP point, dearer than the neighbourhood's plan
    choices = [got.choice, *(p.choice for p in got.alternatives)]
    assert all(a != b for i, a in enumerate(choices) for b in choices[i + 1:])
    for point in got.alternatives:
        assert point.objective_s >= got.objective_s * (1 - REL)
        assert point.memory_bytes is not None and point.memory_bytes <= default_budget(mesh)


def test_the_search_the_lp_thread_makes_is_the_solves_own(tiny):
    """An LP started ahead (``IlpModel.start_lp``) rounds its point and searches the
    neighbourhood in its own thread, while the planner goes on; the solve takes that search and
    ends where a solve that searches itself does. A search is taken once, and not after the
    budget changed (``IlpModel.set_budget``): the neighbourhood was another model's."""
    problem, mesh = tiny
    budget = default_budget(mesh)
    itself = _solve(problem, budget, rel_gap=LOOSE_GAP)
    model = _built(problem, budget)
    model.start_lp(TIME_LIMIT_S, LOOSE_GAP)
    model.lp_ahead.result()  # the thread has ended: its search is made
    assert model.lp_ahead._found is not None and model.lp_ahead._found[2] is not None
    ahead = ilp.solve_built(model, time_limit_s=TIME_LIMIT_S, rel_gap=LOOSE_GAP)
    assert model.lp_ahead.search() is None
    assert ahead.choice == itself.choice and ahead.objective_s == pytest.approx(itself.objective_s, rel=REL)
    assert ahead.bound_s == pytest.approx(itself.bound_s, rel=REL)

    other = _built(problem, budget)
    other.start_lp(TIME_LIMIT_S, LOOSE_GAP)
    other.lp_ahead.result()
    other.set_budget(budget / 2)
    assert other.lp_ahead.search() is None
