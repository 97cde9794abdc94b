"""``solver._run_mip`` when HiGHS reports a start point at a cost that is not its cost (HiGHS
1.16 does on some models): the MIP runs again without the start, within what is left of the
time limit, and the start stands where that run finds nothing cheaper. And a run whose gap
stalls is stopped (``solver._StallGuard``), one that makes progress is not.

HiGHS is replaced by a stand-in that plays such runs, on a clock the test moves."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

from shardwise.plan import solver
from shardwise.plan.solver import FEASIBLE_SOLUTION, _run_mip

COST = np.array([3.0, 5.0])
START = np.array([1.0, 0.0])  # costs 3
LIMIT_S = 50.0


@dataclass
class _Info:
    primal_solution_status: int
    objective_function_value: float
    mip_dual_bound: float = 1.0


@dataclass
class _Values:
    col_value: np.ndarray


@dataclass
class _CallbackOut:
    mip_primal_bound: float
    mip_dual_bound: float


@dataclass
class _CallbackIn:
    user_interrupt: bool = False


@dataclass
class _Lp:
    col_cost_: np.ndarray = field(default_factory=lambda: COST)


class _Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


class _Highs:
    """Each run takes ``run_s`` of the clock and ends at the next of ``results``: (reported
    objective, solution), or None for no solution."""

    def __init__(self, clock: _Clock, run_s: float, results: list, bounds: tuple[float, ...] = (),
                 progress: tuple[list[tuple[float, float, float]], ...] = ()) -> None:
        self.clock, self.run_s, self.results = clock, run_s, list(results)
        self.bounds = list(bounds)  # each run's dual bound (1.0 where not given)
        # Each run's calls of the MIP interrupt callback: (seconds into the run, plan, bound).
        self.progress = list(progress)
        self.callback = None
        self.interrupted: list[bool] = []
        self.options = {"time_limit": LIMIT_S, "mip_rel_gap": solver.MIP_REL_GAP}
        self.limits: list[float] = []  # the time limit of each run
        self.result = None

    def setSolution(self, n, index, values) -> None:  # noqa: N802 (HiGHS's names)
        pass

    def getOptionValue(self, name):  # noqa: N802
        return 0, self.options[name]  # highspy's (status, value)

    def setOptionValue(self, name, value) -> None:  # noqa: N802
        self.options[name] = value

    def setCallback(self, callback, _data) -> None:  # noqa: N802
        self.callback = callback

    def startCallback(self, _kind) -> None:  # noqa: N802
        pass

    def run(self) -> None:
        limit = self.options["time_limit"]
        self.limits.append(limit)
        began, stopped = self.clock.now, False
        for t, plan, bound in (self.progress.pop(0) if self.progress else []):
            if t > min(self.run_s, limit):
                break
            self.clock.now = began + t
            asked = _CallbackIn()
            self.callback(None, "", _CallbackOut(plan, bound), asked, None)
            if asked.user_interrupt:
                stopped = True
                break
        self.interrupted.append(stopped)
        if not stopped:
            self.clock.now = began + min(self.run_s, limit)
        self.result = self.results.pop(0)
        self.bound = self.bounds.pop(0) if self.bounds else 1.0

    def clearSolver(self) -> None:  # noqa: N802
        pass

    def getInfo(self) -> _Info:  # noqa: N802
        if self.result is None:
            return _Info(0, float("inf"))
        return _Info(FEASIBLE_SOLUTION, self.result[0], self.bound)

    def getSolution(self) -> _Values:  # noqa: N802
        return _Values(self.result[1] if self.result is not None else np.zeros(2))

    def getLp(self) -> _Lp:  # noqa: N802
        return _Lp()

    def getModelStatus(self):  # noqa: N802
        return None


@pytest.fixture
def clock(monkeypatch) -> _Clock:
    c = _Clock()
    monkeypatch.setattr(solver.time, "perf_counter", c)
    return c


def test_the_run_again_without_the_start_has_only_the_time_left(clock):
    # The start, reported at 2 (its cost is 3); without it, HiGHS finds the other point.
    h = _Highs(clock, run_s=30.0, results=[(2.0, START), (5.0, np.array([0.0, 1.0]))])
    got = _run_mip(h, START, 2)
    assert h.limits == [LIMIT_S, LIMIT_S - 30.0]
    assert clock.now == pytest.approx(LIMIT_S)
    # ... dearer than the start (5 > 3): the start stands, at its own cost, with the runs' bound.
    assert got.objective == pytest.approx(3.0)
    assert np.array_equal(got.solution, START)
    assert got.bound == pytest.approx(1.0)
    assert got.status == "feasible"  # 1 < 3: nothing proves the start optimal


def test_the_start_kept_is_optimal_where_the_run_again_proves_it(clock):
    # Without the start HiGHS proves the optimum, a rounding error above the start's cost.
    above = 3.0 * (1.0 + 1e-12)
    h = _Highs(clock, run_s=5.0, results=[(2.0, START), (above, START)], bounds=(1.0, above))
    got = _run_mip(h, START, 2)
    assert np.array_equal(got.solution, START)
    assert got.bound == pytest.approx(3.0) and got.status == "optimal"


def test_no_time_left_keeps_the_start(clock):
    h = _Highs(clock, run_s=LIMIT_S, results=[(2.0, START)])
    got = _run_mip(h, START, 2)
    assert h.limits == [LIMIT_S]  # no second run
    assert got.status == "feasible"
    assert got.bound == pytest.approx(1.0)  # the first run's
    assert got.objective == pytest.approx(3.0)
    assert np.array_equal(got.solution, START)


def test_a_cheaper_point_found_without_the_start_is_taken(clock):
    cheaper = np.array([0.0, 0.5])  # costs 2.5
    h = _Highs(clock, run_s=10.0, results=[(2.0, START), (2.5, cheaper)])
    got = _run_mip(h, START, 2)
    assert got.objective == pytest.approx(2.5)
    assert np.array_equal(got.solution, cheaper)


def _gap_closing(share: float) -> list[tuple[float, float, float]]:
    """A run at one plan (3) whose bound climbs from 1 by ``share`` of what is left each second."""
    calls, bound = [], 1.0
    for t in range(1, 40):
        calls.append((float(t), 3.0, bound))
        bound += share * (3.0 - bound)
    return calls


def test_a_run_whose_gap_stalls_is_stopped_and_not_run_again(clock):
    # The bound creeps (0.1% of the gap a second): stopped once STALL_MIN_S has passed and its
    # last STALL_WINDOW_SHARE closed under STALL_PROGRESS of the gap; no run again without the
    # start although HiGHS misreported it (2 for a start that costs 3).
    h = _Highs(clock, run_s=LIMIT_S, results=[(2.0, START)], progress=(_gap_closing(0.001),))
    got = _run_mip(h, START, 2)
    assert h.interrupted == [True] and h.limits == [LIMIT_S]
    assert solver.STALL_MIN_S <= clock.now < LIMIT_S / 2
    assert np.array_equal(got.solution, START) and got.objective == pytest.approx(3.0)


def test_a_run_that_closes_its_gap_or_improves_its_plan_runs_on(clock):
    closing = _gap_closing(0.05)  # 5% of the gap a second: over STALL_PROGRESS in any window
    improving = [(float(t), 3.0 - 0.01 * t, 1.0) for t in range(1, 40)]  # the bound still, the plan better
    for calls in (closing, improving):
        h = _Highs(clock, run_s=LIMIT_S, results=[(3.0, START)], progress=(calls,))
        _run_mip(h, START, 2)
        assert h.interrupted == [False]
