"""``solver._run_mip`` from a start point: HiGHS is not handed the start (HiGHS 1.16 can take a
start for a cheaper point than it is); the start's cost is its objective bound, the run ends
once its bound is within the gap of that cost, and the start stands where HiGHS finds nothing
cheaper. A run whose gap stalls is stopped (``solver._StallGuard``), one that makes progress
is not.

HiGHS is replaced by a stand-in that plays such runs, on a clock the test moves."""

from __future__ import annotations

from dataclasses import dataclass, field

import highspy
import numpy as np
import pytest

from shardwise.plan import solver
from shardwise.plan.solver import FEASIBLE_SOLUTION, _run_mip

COST = np.array([3.0, 5.0])
START = np.array([1.0, 0.0])  # costs 3
CHEAPER = np.array([0.0, 0.5])  # costs 2.5
LIMIT_S = 50.0
GAP = 0.01
Status = highspy.HighsModelStatus


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
    """A run takes ``run_s`` of the clock, calling the interrupt callback at ``progress``
    ((seconds into the run, HiGHS's plan, its bound)), and ends with ``result`` (a solution, or
    None), ``status`` and ``bound``; HiGHS reports a solution at ``reported`` (its cost where
    not given)."""

    def __init__(self, clock: _Clock, run_s: float, result: np.ndarray | None, status=Status.kTimeLimit,
                 bound: float = 1.0, progress: list[tuple[float, float, float]] = (), rel_gap: float = GAP,
                 reported: float | None = None) -> None:
        self.clock, self.run_s, self.result, self.status, self.bound = clock, run_s, result, status, bound
        self.progress, self.reported = list(progress), reported
        self.options = {"time_limit": LIMIT_S, "mip_rel_gap": rel_gap}
        self.callback = None
        self.interrupted = False

    def setSolution(self, n, index, values) -> None:  # noqa: N802 (HiGHS's names)
        raise AssertionError("the start is not handed to HiGHS")

    def getOptionValue(self, name):  # noqa: N802
        return 0, self.options[name]  # highspy's (status, value)

    def setOptionValue(self, name, value) -> None:  # noqa: N802
        self.options[name] = value

    def setCallback(self, callback, _data) -> None:  # noqa: N802
        self.callback = callback

    def startCallback(self, _kind) -> None:  # noqa: N802
        pass

    def run(self) -> None:
        began = self.clock.now
        for t, plan, bound in self.progress:
            if t > self.run_s:
                break
            self.clock.now = began + t
            asked = _CallbackIn()
            self.callback(None, "", _CallbackOut(plan, bound), asked, None)
            if asked.user_interrupt:
                self.interrupted, self.status = True, Status.kInterrupt
                return
        self.clock.now = began + self.run_s

    def getInfo(self) -> _Info:  # noqa: N802
        if self.result is None:
            return _Info(0, float("inf"), self.bound)
        reported = float(COST @ self.result) if self.reported is None else self.reported
        return _Info(FEASIBLE_SOLUTION, reported, self.bound)

    def getSolution(self) -> _Values:  # noqa: N802
        return _Values(self.result if self.result is not None else np.zeros(2))

    def getLp(self) -> _Lp:  # noqa: N802
        return _Lp()

    def getModelStatus(self):  # noqa: N802
        return self.status


@pytest.fixture
def clock(monkeypatch) -> _Clock:
    c = _Clock()
    monkeypatch.setattr(solver.time, "perf_counter", c)
    return c


def test_the_start_is_the_objective_bound_and_stands_where_nothing_cheaper_is_found(clock):
    h = _Highs(clock, run_s=LIMIT_S, result=None, bound=2.0)
    got = _run_mip(h, START, 2)
    assert h.options["objective_bound"] == pytest.approx(3.0)
    assert np.array_equal(got.solution, START) and got.objective == pytest.approx(3.0)
    assert got.bound == pytest.approx(2.0) and got.status == "feasible"  # 2 < 3: nothing proves it


def test_a_point_no_cheaper_than_the_start_leaves_the_start(clock):
    """HiGHS's own point at the start's cost or above (or reported cheaper than it costs, as
    HiGHS 1.16 did with a start) does not replace the start: plans are priced by the cost vector."""
    for reported in (None, 2.0):
        h = _Highs(clock, run_s=5.0, result=np.array([0.0, 1.0]), reported=reported)  # costs 5
        got = _run_mip(h, START, 2)
        assert np.array_equal(got.solution, START) and got.objective == pytest.approx(3.0)


def test_nothing_cheaper_proven_makes_the_start_optimal(clock):
    for status in (Status.kInfeasible, Status.kObjectiveBound):
        got = _run_mip(_Highs(clock, run_s=5.0, result=None, status=status, bound=float("inf")), START, 2)
        assert np.array_equal(got.solution, START)
        assert got.bound == pytest.approx(3.0) and got.status == "optimal"


def test_a_cheaper_point_is_taken_at_its_cost(clock):
    h = _Highs(clock, run_s=10.0, result=CHEAPER, status=Status.kOptimal, bound=2.5, reported=2.4)
    got = _run_mip(h, START, 2)
    assert np.array_equal(got.solution, CHEAPER)
    assert got.objective == pytest.approx(2.5) and got.status == "optimal"


def test_without_a_start_no_plan_is_unsolved(clock):
    h = _Highs(clock, run_s=LIMIT_S, result=None)
    got = _run_mip(h, None, 2)
    assert got.solution is None and got.status == "unsolved"
    assert "objective_bound" not in h.options


def test_a_bound_within_the_gap_of_the_start_ends_the_run(clock):
    """HiGHS has no plan of its own (its primal bound infinite); its bound reaches 2.98, within 1%
    of the start's 3: stopped there, the start kept, "optimal" at the gap asked."""
    calls = [(1.0, float("inf"), 2.0), (2.0, float("inf"), 2.5), (3.0, float("inf"), 2.98), (4.0, 3.0, 2.99)]
    h = _Highs(clock, run_s=LIMIT_S, result=None, bound=2.98, progress=calls)
    got = _run_mip(h, START, 2)
    assert h.interrupted and clock.now == pytest.approx(3.0)
    assert np.array_equal(got.solution, START) and got.status == "optimal"
    assert got.bound == pytest.approx(2.98)


def _gap_closing(share: float) -> list[tuple[float, float, float]]:
    """Callbacks of a run without a plan of its own whose bound climbs from 1 towards the start's
    3 by ``share`` of what is left each second."""
    calls, bound = [], 1.0
    for t in range(1, 40):
        calls.append((float(t), float("inf"), bound))
        bound += share * (3.0 - bound)
    return calls


def test_a_run_whose_gap_stalls_is_stopped(clock):
    # The bound creeps (0.1% of the gap a second) against the start, HiGHS without a plan of its
    # own: stopped once STALL_MIN_S has passed and its last STALL_WINDOW_SHARE closed under
    # STALL_PROGRESS of the gap.
    h = _Highs(clock, run_s=LIMIT_S, result=None, progress=_gap_closing(0.001), rel_gap=solver.MIP_REL_GAP)
    got = _run_mip(h, START, 2)
    assert h.interrupted
    assert solver.STALL_MIN_S <= clock.now < LIMIT_S / 2
    assert np.array_equal(got.solution, START) and got.objective == pytest.approx(3.0)


def test_a_loose_run_is_taken_for_stalled_from_its_own_minimum(clock):
    # The same creeping bound in a loose gap's last MIP, begun at the bound 1: stopped once
    # LOOSE_STALL_MIN_S has passed, well before STALL_MIN_S.
    h = _Highs(clock, run_s=LIMIT_S, result=None, progress=_gap_closing(0.001), rel_gap=solver.MIP_REL_GAP)
    got = _run_mip(h, START, 2, loose_from=1.0)
    assert h.interrupted
    assert solver.LOOSE_STALL_MIN_S <= clock.now < solver.STALL_MIN_S
    assert np.array_equal(got.solution, START)


@pytest.mark.parametrize("loose", [True, False])
def test_a_loose_run_whose_root_reports_late_is_measured_from_the_bound_it_began_at(clock, loose):
    # HiGHS's first report comes at 9 s (its root LP), its bound hardly above the 1 it began at:
    # a loose run stops there; another runs on (nothing to measure before 4.5 s, and under
    # STALL_MIN_S).
    calls = [(9.0, float("inf"), 1.001), (12.0, float("inf"), 1.002)]
    h = _Highs(clock, run_s=LIMIT_S, result=None, progress=calls, rel_gap=solver.MIP_REL_GAP)
    got = _run_mip(h, START, 2, loose_from=1.0 if loose else None)
    assert h.interrupted == loose
    assert clock.now == pytest.approx(9.0 if loose else LIMIT_S)
    assert np.array_equal(got.solution, START)


def test_a_run_that_closes_its_gap_or_improves_its_plan_runs_on(clock):
    closing = _gap_closing(0.05)  # 5% of the gap a second: over STALL_PROGRESS in any window
    improving = [(float(t), 2.99 - 0.01 * t, 1.0) for t in range(1, 40)]  # the bound still, the plan better
    for calls in (closing, improving):
        h = _Highs(clock, run_s=LIMIT_S, result=None, progress=calls, rel_gap=solver.MIP_REL_GAP)
        _run_mip(h, START, 2)
        assert not h.interrupted
