r"""Solving the placement model with HiGHS: a restricted LP, pricing, then (if needed) the MIP.

Most columns of the placement ILP are edge transport variables e[k,p,q] (``ilp._add_edge``),
and most of those are dear moves that no good plan makes. The model is solved smaller, and
exactly, in three steps:

1. **Restricted LP.** The LP relaxation without the optional columns (``Model.optional``: each
   edge keeps its free moves and its few cheapest moves out of every source and into every
   destination, and the start point's moves).
2. **Pricing.** With the LP's row duals y, every left-out column j has reduced cost
   rc_j = c_j - y.A_j. Columns with rc_j < 0 could lower the objective: they join the LP,
   which HiGHS re-solves from its basis. When none is left, the restricted LP's optimum is the
   full LP's (LP duality: y is dual feasible for every column), so its value LB is a lower
   bound on the ILP. If the x it chose are integral, that point is the ILP's optimum: done.
3. **MIP with reduced-cost fixing.** Otherwise, for any feasible point z of the full model,
   c.z >= LB + sum_j rc_j z_j (every term of the reduced-cost expansion is >= 0 at an optimal
   basis). At integral x an edge variable is 0 or 1, so a plan that uses a left-out column j is
   dearer than LB + rc_j; where that exceeds UB (the start point's objective) it cannot beat the
   start, and the column stays out. The others rejoin, and HiGHS solves the MIP over them,
   started from the start point. Its optimum is the full model's: every plan it cannot see costs
   more than one it can.

If steps 1-2 cannot finish within PRICING_SHARE of the time limit (or the restricted LP has no
point), the MIP over every column gets the rest of the time, as if nothing had been left out.

The schedule objective's models are solved from their interior-point LP bound instead
(``solve_by_lp_bound``), whose LP can be started ahead in a background thread (``LpRun``:
HiGHS leaves Python's GIL while it runs), so that the planner prices the hand plans meanwhile.
That LP first leaves out the memory row and what only it reads (``MemoryPart``): where its
point, extended to that part, keeps to the row, it is the whole LP's optimum too; otherwise the
whole LP is solved.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import highspy
import numpy as np

from shardwise.stdio import native_stdout_silenced

log = logging.getLogger(__name__)

# Relative MIP gap at which HiGHS may stop and report "optimal": tighter than the 1e-6 to which
# plans are compared, loose enough that the solver does not chase rounding noise.
MIP_REL_GAP = 1e-7
# HiGHS's default dual feasibility tolerance (option dual_feasibility_tolerance): a reduced
# cost above -this is non-negative to the solver, so pricing uses the same threshold.
DUAL_FEASIBILITY_TOL = 1e-7
# HiGHS's default primal feasibility tolerance (option primal_feasibility_tolerance).
FEASIBILITY_TOL = 1e-7
# HiGHS's default MIP feasibility tolerance (option mip_feasibility_tolerance): an integer
# column of the LP solution this close to 0 or 1 is integral.
INTEGRALITY_TOL = 1e-6
# HiGHS's primal_solution_status for a feasible point.
FEASIBLE_SOLUTION = int(highspy.SolutionStatus.kSolutionStatusFeasible)
# Pricing rounds before giving up on the restricted LP (llama3-8b and 70B over 8x8 converge in
# 3-6; a model that needs many more is better solved whole).
MAX_PRICING_ROUNDS = 25
# Share of the time limit steps 1-2 may take before the whole MIP gets the rest. On llama3-8b
# over 8x8 they take ~2-5 s of 60. On Phi-3 over 2x4 (hf_families, 30 s) the first LP takes
# ~9 s and already finds the optimum, but each re-solve after pricing runs ~30k simplex
# iterations: the whole MIP then starts from that plan (it needs ~28 s to prove it optimal).
PRICING_SHARE = 0.4
# A MIP whose gap stalls is stopped (``_StallGuard``): after STALL_MIN_S, when over the last
# STALL_WINDOW_SHARE of its run it neither improved its plan nor closed STALL_PROGRESS of the
# gap it had at the window's start. On llama3-70b over 8x8 the MIP over what reduced-cost fixing
# leaves sat at its root node for 48 s, its bound 1.67649 -> 1.67699 s against a plan at 1.72546
# (stop 40's log and stop 46's), and returned the plan it started from. Long and wide enough
# that a MIP slowed by a busy machine is not taken for a stalled one: llama-tiny's under a tight
# budget proves its optimum in 3.6 s on a quiet machine, its bound pausing up to 0.5 s at a time,
# and was stopped at 10 s "feasible" beside the test suite with a 10-s minimum and a 40% window.
STALL_MIN_S = 20.0
STALL_WINDOW_SHARE = 0.5
STALL_PROGRESS = 0.1


@dataclass
class Flow:
    """A flow edge's columns: its arcs, and each move's arc columns with the x of its source and
    destination placements (an arc is 1 where some move over it is chosen)."""

    first: int  # the first arc's column
    n_arcs: int
    paths: dict[tuple[int, int], list[int]]  # (source, destination) -> its move's arcs, from 0
    sources: list[list[int]]  # the x of each source placement
    destinations: list[list[int]]

    @property
    def arcs(self) -> np.ndarray:
        return self.first + np.arange(self.n_arcs)

    @functools.cached_property
    def moves(self) -> list[tuple[list[int], list[int], list[int]]]:
        """Made when a solve first reads them, not while the model is built (the critical path)."""
        return [([self.first + k for k in path], self.sources[i], self.destinations[j])
                for (i, j), path in self.paths.items()]


def restrict_flows(m: Model, ub: np.ndarray) -> None:
    """Fix out (``ub`` 0) every arc of a flow edge that no move between a source and a
    destination still open under ``ub`` (some x of each above 0) runs: the cheapest flow of a
    plan within ``ub`` is one of those moves. A transport pair whose end is fixed out is left
    by presolve; a flow's other paths would stay in every LP of the MIP (llama3-70b over 8x8:
    the neighbourhood MIP 7.9 s with transport pairs, 16.4 s with flows, 6.8-9.4 s restricted)."""
    n, (arc_cols, arc_of), (src_cols, src_of), (dst_cols, dst_of), arcs = _flow_moves(m)
    open_src = np.bincount(src_of, weights=ub[src_cols] > 0.0, minlength=n) > 0.0
    open_dst = np.bincount(dst_of, weights=ub[dst_cols] > 0.0, minlength=n) > 0.0
    keep = np.zeros(len(ub), dtype=bool)
    keep[arc_cols[(open_src & open_dst)[arc_of]]] = True
    ub[arcs[~keep[arcs]]] = 0.0


def _flow_moves(m: Model) -> tuple:
    """``m``'s flow moves as flat arrays (``restrict_flows``), built on the first call: their
    count, their arcs', sources' and destinations' columns each with the move they belong to,
    and every arc column."""
    if m._flow_moves is None:
        moves = [move for flow in m.flows for move in flow.moves]
        arcs = np.concatenate([flow.arcs for flow in m.flows]) if m.flows else np.zeros(0, dtype=np.int64)
        m._flow_moves = (len(moves), *(_flat([move[side] for move in moves]) for side in range(3)), arcs)
    return m._flow_moves


@dataclass
class Model:
    """The ILP as the builder writes it: columns, then rows in row-wise sparse form."""

    cost: list[float] = field(default_factory=list)
    lb: list[float] = field(default_factory=list)
    ub: list[float] = field(default_factory=list)
    integer: list[bool] = field(default_factory=list)
    # Columns the solver may start without (dear transport pairs, see ``ilp._add_edge``):
    # left out of the first LP and priced back in by their reduced costs.
    optional: list[bool] = field(default_factory=list)
    row_lb: list[float] = field(default_factory=list)
    row_ub: list[float] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    index: list[int] = field(default_factory=list)
    value: list[float] = field(default_factory=list)
    # What a start point needs to fill in the continuous columns from the x it fixes: each edge
    # variable's two ends (the x that make its producer yield p, its consumer need q), each move
    # variable t's rows (t >= sum of terms).
    ends: dict[int, tuple[list[int], list[int]]] = field(default_factory=dict)
    # ... and each flow edge's (``ilp._add_network``).
    flows: list[Flow] = field(default_factory=list)
    t_rows: dict[int, list[dict[int, float]]] = field(default_factory=dict)
    # Fills columns that follow from the integer ones but are neither edge nor move variables
    # (``checkpointing.py``'s spread columns, from the counts and the x), before ``t_rows``
    # read them; None where there are none.
    fill: Callable[[np.ndarray], None] | None = None
    # The memory row (index), if any: ``solve_by_lp_bound`` also gives a bound without it.
    memory_row: int | None = None
    # (first column, first row) of the model's last part, which the interior-point LP leaves out:
    # columns at least 0 that only add to the cost, and the rows that read them (the schedule
    # objective's drain), so that the LP is a relaxation of the model; None: nothing left out.
    relaxed_from: tuple[int, int] | None = None
    # What only the memory row needs, which the interior-point LP first leaves out with that
    # row (``MemoryPart``, ``LpRun``); None: nothing.
    memory_part: MemoryPart | None = None
    # ``complete``'s index arrays, built on its first call (the model is final by then), and
    # ``restrict_flows``'s: (moves, each move's arcs, sources' x, destinations' x, every arc).
    _completion: _Completion | None = field(default=None, repr=False)
    _flow_moves: tuple | None = field(default=None, repr=False)
    _arrays: _Arrays | None = field(default=None, repr=False)

    def var(self, cost: float, ub: float = 1.0, integer: bool = True, lb: float = 0.0) -> int:
        self.cost.append(cost)
        self.lb.append(lb)
        self.ub.append(ub)
        self.integer.append(integer)
        self.optional.append(False)
        return len(self.cost) - 1

    def vars(self, n: int) -> int:
        """``n`` continuous variables in [0, 1] at no cost; returns the first one's index."""
        first = len(self.cost)
        self.cost.extend([0.0] * n)
        self.lb.extend([0.0] * n)
        self.ub.extend([1.0] * n)
        self.integer.extend([False] * n)
        self.optional.extend([False] * n)
        return first

    def row(self, lo: float, hi: float, terms: dict[int, float]) -> None:
        self.row_lb.append(lo)
        self.row_ub.append(hi)
        self.starts.append(len(self.index))
        self.index.extend(terms.keys())
        self.value.extend(terms.values())

    def entry_rows(self) -> np.ndarray:
        """The row of each entry of ``index`` and ``value``."""
        return self.arrays().entry_rows

    def arrays(self) -> _Arrays:
        """The columns and entries as numpy arrays, made on the first call after the model
        last grew (the solver reads them many times; the builder only writes the lists)."""
        a = self._arrays
        if a is None or (len(a.cost), len(a.starts), len(a.index)) != (len(self.cost), len(self.starts) + 1,
                                                                        len(self.index)):
            starts = np.array(self.starts + [len(self.index)], dtype=np.int64)
            a = self._arrays = _Arrays(
                np.array(self.cost, dtype=np.float64), np.array(self.lb, dtype=np.float64),
                np.array(self.ub, dtype=np.float64), np.array(self.integer, dtype=bool), starts,
                np.array(self.index, dtype=np.int64), np.array(self.value, dtype=np.float64),
                np.repeat(np.arange(len(self.row_lb)), np.diff(starts)))
        return a

    def at_least(self, t: int, rows: list[dict[int, float]]) -> None:
        """t >= sum(terms) for each of ``rows``: rows of the model, and ``t_rows`` (a start point
        sets t to the largest; add t after the variables its rows read)."""
        self.t_rows[t] = rows
        for terms in rows:
            self.row(-math.inf, 0.0, {**terms, t: -1.0})


@dataclass
class _Arrays:
    """``Model``'s lists as numpy arrays (``Model.arrays``); read only."""

    cost: np.ndarray
    lb: np.ndarray
    ub: np.ndarray
    integer: np.ndarray  # bool
    starts: np.ndarray  # each row's first entry, and the number of entries last
    index: np.ndarray
    value: np.ndarray
    entry_rows: np.ndarray  # the row of each entry
    # ``_integer_groups`` and ``_bound_ub``, found on their first call.
    groups: list[tuple[np.ndarray, int]] | None = None
    bound_ub: np.ndarray | None = None


@dataclass
class MemoryPart:
    """Columns and rows of a model that serve only its memory row: activation checkpointing's
    counts and spread columns (``checkpointing.py``) and the kept moved copies
    (``ilp._saved_moves``). Without them and the memory row, the model plans with no activation
    checkpointing and no memory limit: a relaxation (recomputation only adds to the cost, and
    the part's other columns cost nothing). ``fill`` sets the part's columns at a point of the
    rest as that relaxation has them: every layer with no checkpointing (its spreads then
    follow from the x, fractional or not); ``LpRun`` sets the part's move variables
    (``Model.t_rows``) after it, each at the largest of its rows."""

    cols: range
    rows: range
    fill: Callable[[np.ndarray], None] | None  # None: nothing but move variables


def add_terms(into: dict[int, float], terms: dict[int, float]) -> None:
    """Add a row's coefficients ``terms`` into ``into``, column by column."""
    for c, b in terms.items():
        into[c] = into.get(c, 0.0) + b


@dataclass
class Solved:
    """What the solver found, in the model's own cost units."""

    status: str  # "optimal" | "feasible" | "infeasible" | "unsolved"
    objective: float  # math.inf without a solution
    bound: float  # lower bound on the optimum (-inf before the solver has one)
    solution: np.ndarray | None
    pricing_rounds: int = 0  # LP solves of step 1-2 (0: the model was solved whole)
    priced_in: int = 0  # optional columns the pricing added
    columns: int = 0  # columns the last solve could use (the rest fixed at 0)
    integral_lp: bool = False  # pricing ended on an integral LP optimum (no MIP needed)
    # A lower bound on the optimum whatever the memory row's budget (-inf where none is known).
    bound_any_budget: float = -math.inf
    # Other points of the model the solve found on its way (the rounded LP point, the
    # neighbourhood's plan), complete and integral, each placing something otherwise than
    # ``solution`` and than one another: the caller may price them by another measure.
    alternatives: list[np.ndarray] = field(default_factory=list)


def solve_model(m: Model, unit: float, time_limit_s: float, start: np.ndarray | None,
                pricing: bool = True, rel_gap: float = MIP_REL_GAP) -> Solved:
    """Solve ``m`` (costs divided by ``unit`` for the solver), from the complete feasible point
    ``start`` if given; ``pricing=False`` hands HiGHS the whole MIP at once."""
    deadline = time.perf_counter() + time_limit_s
    optional = np.array(m.optional, dtype=bool) if pricing else np.zeros(len(m.cost), dtype=bool)
    if start is not None:
        optional &= start <= 0.5  # the start's own moves stay in: it must remain a point
    if optional.any():
        done, found = _by_pricing(m, unit, optional, deadline, start,
                                  time.perf_counter() + PRICING_SHARE * time_limit_s)
        if done is not None:
            return done
        if found is not None and (start is None or _dearer(m, start, found)):
            start = found  # an integral restricted-LP optimum: a plan, and often the best one
    h = _highs(max(0.0, deadline - time.perf_counter()), rel_gap)
    h.passModel(_highs_lp(m, unit))
    return _run_mip(h, start, len(m.cost))


def _highs(time_limit_s: float, rel_gap: float = MIP_REL_GAP) -> highspy.Highs:
    with native_stdout_silenced():  # HiGHS prints its banner on stdout as it is built
        h = highspy.Highs()
        h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", float(time_limit_s))
    h.setOptionValue("mip_rel_gap", rel_gap)
    h.setOptionValue("threads", 1)
    return h


def _until(h: highspy.Highs, deadline: float) -> None:
    """Let ``h``'s next run go on until ``deadline`` (HiGHS's time limit counts all its runs)."""
    h.setOptionValue("time_limit", h.getRunTime() + max(0.0, deadline - time.perf_counter()))


def _highs_lp(m: Model, unit: float) -> highspy.HighsLp:
    a = m.arrays()
    lp = highspy.HighsLp()
    lp.num_col_ = len(a.cost)
    lp.num_row_ = len(m.row_lb)
    lp.col_cost_ = a.cost / unit
    lp.col_lower_ = a.lb
    lp.col_upper_ = a.ub
    lp.row_lower_ = np.array(m.row_lb, dtype=np.float64)
    lp.row_upper_ = np.array(m.row_ub, dtype=np.float64)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.start_ = a.starts.astype(np.int32)
    lp.a_matrix_.index_ = a.index.astype(np.int32)
    lp.a_matrix_.value_ = a.value
    lp.integrality_ = np.where(a.integer, highspy.HighsVarType.kInteger, highspy.HighsVarType.kContinuous)
    return lp


def _dearer(m: Model, a: np.ndarray, b: np.ndarray) -> bool:
    """Whether point ``a`` costs more than point ``b``."""
    cost = np.array(m.cost)
    return float(np.dot(cost, a)) > float(np.dot(cost, b))


def _integral(sol: np.ndarray, integer: np.ndarray) -> bool:
    frac = np.abs(sol[integer] - np.round(sol[integer]))
    return not len(frac) or frac.max() <= INTEGRALITY_TOL


def _by_pricing(m: Model, unit: float, left_out: np.ndarray, deadline: float,
                start: np.ndarray | None, lp_deadline: float) -> tuple[Solved | None, np.ndarray | None]:
    """Steps 1-3 of the module docstring (steps 1-2 by ``lp_deadline``, step 3 by ``deadline``).
    Where steps 1-2 cannot finish in time: (None, the last integral restricted-LP optimum, a
    feasible point of the whole model, or None) for the whole MIP to start from."""
    n = len(m.cost)
    integer = np.array(m.integer, dtype=bool)
    relaxed = _highs_lp(m, unit)
    relaxed.integrality_ = []
    cost = np.asarray(relaxed.col_cost_).copy()
    ub = np.asarray(relaxed.col_upper_).copy()
    index = np.array(m.index, dtype=np.int64)
    value = np.array(m.value, dtype=np.float64)
    row_of = m.entry_rows()
    restricted_ub = ub.copy()
    restricted_ub[left_out] = 0.0
    relaxed.col_upper_ = restricted_ub
    h = _highs(max(0.0, lp_deadline - time.perf_counter()))
    h.passModel(relaxed)
    left_out = left_out.copy()
    priced_in, rounds, found = 0, 0, None
    while True:
        rounds += 1
        if rounds > MAX_PRICING_ROUNDS:
            return None, found
        _until(h, lp_deadline)
        h.run()
        if h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
            return None, found  # out of time, or the restricted LP has no point: solve it whole
        sol = np.asarray(h.getSolution().col_value)
        if _integral(sol, integer):
            found = np.where(np.asarray(m.integer), np.round(sol), sol)
        duals = np.asarray(h.getSolution().row_dual)
        reduced = cost - np.bincount(index, weights=value * duals[row_of], minlength=n)
        enter = np.nonzero(left_out & (reduced < -DUAL_FEASIBILITY_TOL))[0]
        if not len(enter):
            break
        left_out[enter] = False
        priced_in += len(enter)
        h.changeColsBounds(len(enter), enter.astype(np.int32), np.zeros(len(enter)), ub[enter])
    lower = float(h.getInfo().objective_function_value)
    if _integral(sol, integer):  # an integral LP optimum: the ILP's
        return Solved("optimal", lower, lower, sol, rounds, priced_in, int((~left_out).sum()), True), None
    # Reduced-cost fixing against the start (step 3): columns that could still pay rejoin.
    if found is not None and (start is None or _dearer(m, start, found)):
        start = found  # a restricted LP's integral optimum is a point of the whole model too
    upper = float(np.dot(cost, start)) if start is not None else math.inf
    rejoin = left_out & (reduced <= upper - lower + DUAL_FEASIBILITY_TOL)
    left_out &= ~rejoin
    h.changeColsBounds(int(rejoin.sum()), np.nonzero(rejoin)[0].astype(np.int32),
                       np.zeros(int(rejoin.sum())), ub[rejoin])
    ints = np.nonzero(integer)[0].astype(np.int32)
    h.changeColsIntegrality(len(ints), ints, np.array([highspy.HighsVarType.kInteger] * len(ints)))
    _until(h, deadline)
    done = _run_mip(h, start, n)
    done.bound = max(done.bound, lower)
    done.pricing_rounds, done.priced_in, done.columns = rounds, priced_in, int((~left_out).sum())
    return done, None


class _StallGuard:
    """HiGHS's MIP interrupt callback: stops the run whose gap stalls (STALL_* above), and the run
    whose bound has come within ``rel_gap`` of the start it was not handed (``_run_mip``: HiGHS
    knows no plan of its own to measure its gap by). HiGHS calls it between its steps (on
    llama3-70b 27 times in 48 s at the root node, 212 in a 12-s neighbourhood MIP), so it costs
    nothing to speak of. ``loose_from``: the run is a loose gap's last MIP, begun at this
    bound: its progress is measured from that bound and the start from the first moment on, and
    it is taken for stalled from LOOSE_STALL_MIN_S on (the caller asked for a plan soon, not the
    optimum; a run whose root LP takes long makes no report before)."""

    def __init__(self, h: highspy.Highs, start_cost: float, rel_gap: float,
                 loose_from: float | None = None) -> None:
        self.began = time.perf_counter()
        self.start_cost, self.rel_gap = start_cost, rel_gap
        self.min_s = STALL_MIN_S if loose_from is None else LOOSE_STALL_MIN_S
        self.seen: list[tuple[float, float, float]] = []  # (seconds, plan, bound) while both are finite
        if loose_from is not None and math.isfinite(start_cost) and math.isfinite(loose_from):
            self.seen.append((0.0, start_cost, loose_from))
        h.setCallback(self, None)
        h.startCallback(highspy.cb.HighsCallbackType.kCallbackMipInterrupt)

    def __call__(self, _kind, _message, data_out, data_in, _user) -> None:
        t = time.perf_counter() - self.began
        own, bound = float(data_out.mip_primal_bound), float(data_out.mip_dual_bound)
        plan = min(own, self.start_cost)
        if not (math.isfinite(plan) and math.isfinite(bound)):
            return
        if own >= self.start_cost and _within_gap(plan, bound, self.rel_gap):
            data_in.user_interrupt = True  # as HiGHS stops where its own plan is within the gap
            return
        self.seen.append((t, plan, bound))
        if t < self.min_s:
            return
        then = [r for r in self.seen if r[0] <= (1.0 - STALL_WINDOW_SHARE) * t]
        if not then:
            return
        _, plan0, bound0 = then[-1]
        if plan < plan0 or (plan0 - bound0) - (plan - bound) >= STALL_PROGRESS * (plan0 - bound0):
            return
        log.debug("MIP stalled after %.1f s: plan %.6g, bound %.6g -> %.6g", t, plan, bound0, bound)
        data_in.user_interrupt = True


def _run_mip(h: highspy.Highs, start: np.ndarray | None, n: int, loose_from: float | None = None) -> Solved:
    """Run HiGHS's MIP on the model it holds; ``start`` (a complete feasible point, if given) is
    the plan to beat; ``loose_from``: ``_StallGuard``'s.

    The start is not handed to HiGHS as a solution: HiGHS 1.16 can take a start for a better
    one than it is, and then prunes against, and reports, that price. On llama-tiny over 4
    devices under a tight memory budget it reported a neighbourhood MIP "optimal" at 386.6 us,
    below the LP bound (460.2), returning the start itself (468.8 by its cost vector); on
    llama3-70b over 8x8 its neighbourhood MIP "optimal" at 1.70521 s after 3.6 s, the start
    itself, which costs 1.72546. The start's cost is HiGHS's objective bound instead (no
    point dearer than it is of any use), ``_StallGuard`` ends the run once its bound is within
    the gap asked of that cost, and the start stands where HiGHS finds nothing cheaper. That
    70B neighbourhood MIP: 6.6 s to the start's plan, proven optimal, where the run from the
    start and then again without it (as this function did before) took 3.6 + 8.3 s. A run whose
    gap stalls is stopped. Every plan is priced by the model's own cost vector."""
    cost = np.asarray(h.getLp().col_cost_)
    start_cost = float(np.dot(cost, start)) if start is not None else math.inf
    if start is not None:
        h.setOptionValue("objective_bound", start_cost)
    _, rel_gap = h.getOptionValue("mip_rel_gap")  # highspy's (status, value)
    _StallGuard(h, start_cost, rel_gap, loose_from)
    h.run()
    status, info = h.getModelStatus(), h.getInfo()
    bound = _dual_bound(h)
    found = info.primal_solution_status == FEASIBLE_SOLUTION
    solution = np.asarray(h.getSolution().col_value) if found else None
    objective = float(np.dot(cost, solution)) if found else math.inf
    if start is not None and objective >= start_cost:
        if status in (highspy.HighsModelStatus.kInfeasible, highspy.HighsModelStatus.kObjectiveBound):
            bound = start_cost  # nothing cheaper than the start exists
        bound = min(bound, start_cost)
        label = "optimal" if _within_gap(start_cost, bound, rel_gap) else "feasible"
        return Solved(label, start_cost, bound, start, columns=n)
    if not found:  # no plan
        label = "infeasible" if status == highspy.HighsModelStatus.kInfeasible else "unsolved"
        return Solved(label, math.inf, bound, None, columns=n)
    proven = status == highspy.HighsModelStatus.kOptimal or _within_gap(objective, bound, rel_gap)
    return Solved("optimal" if proven else "feasible", objective, bound, solution, columns=n)


def _within_gap(plan: float, bound: float, rel_gap: float) -> bool:
    """Whether ``bound`` proves ``plan`` within ``rel_gap`` (HiGHS's MIP gap, as HiGHS measures it:
    a run that proves the optimum may report it a rounding error dearer than the start)."""
    return plan - bound <= rel_gap * max(1.0, abs(plan))


def _dual_bound(h: highspy.Highs) -> float:
    """The bound HiGHS's last run proved (-inf where it proved none)."""
    bound = float(h.getInfo().mip_dual_bound)
    return bound if math.isfinite(bound) else -math.inf


# ---- by the LP bound: interior point, rounding, a neighbourhood, reduced-cost fixing ---------

# Share of the time limit the interior-point LP may take: on llama3-8b over 8x8 it needs 12-15 s
# of one core (more on a loaded machine, the limit being wall time), and without its bound the
# whole MIP rarely improves on the start in what is left.
LP_BOUND_SHARE = 0.9
# A one-hot group whose LP value is at least this is kept at its LP choice in the neighbourhood
# MIP (RINS, Danna et al. 2005: fix what the LP relaxation already decides).
RINS_FIX = 0.99
# Share of the time left that the neighbourhood MIP may take (on llama3-8b it needs < 1 s).
RINS_SHARE = 0.5
# Where the rounded LP point is within the gap asked, the neighbourhood MIP gets at most this
# long (``solve_by_lp_bound``): where the LP decides nearly every group, it needs well under 1 s.
POLISH_S = 5.0
# Where a loose gap is asked, the whole MIP after the neighbourhood gets at most LOOSE_MIP_S, and
# the stall guard measures it from the LP bound it began at, from LOOSE_STALL_MIN_S on
# (``_StallGuard``'s ``loose_from``). On llama3-70b it ran 52 s (the stall guard did not stop it)
# without a better plan; at stop 54 it ran 20 s at its root node, its first report at 9.4 s (the
# root LP by simplex), its bound 1.69949e6 -> 1.69957e6 against a plan at 1.78142e6 (0.1% of the
# gap); it now stops at that first report, with the same plan.
LOOSE_MIP_S = STALL_MIN_S
LOOSE_STALL_MIN_S = 5.0
# ... and none where reduced-cost fixing leaves more than this share of the columns: HiGHS's root
# LP is then most of the model's by dual simplex, what the interior point was chosen over. On
# llama3-70b over 8x8 (82% of 59,492 left) it ran 9-10 s to its first report, 0.1% of the gap
# closed; on llama3-405b over 16x8 (94% of 55,029) 13.5 s, 0.2%; the same plans without it.
LOOSE_MIP_MAX_LEFT = 0.5
# Where the caller accepts a plan at least this far from the bound (``rel_gap``), the interior
# point stops at ``loose_ipm_tolerance`` (a tenth of the gap) instead of HiGHS's 1e-8: the bound
# is valid for any duals (``_lp_bound``), and the LP value's error is small beside the gap. On
# llama3-8b over 8x8 at --gap 0.01 the plans and gaps are the same, the whole plan 17.4 -> 14.3 s
# (2 layers) and 21.3 -> 19.7 s (32 layers) at 1e-5. At 1e-3 (stop 54) the 2-layer LP takes 31
# iterations instead of 34 (2.91 s against 3.09 s), its bound 53,807.1 against 53,807.3 us, the
# plan the same; it ends "unknown" (no optimal status), which serves as well (``LpRun.result``).
# Not to the optimum: its reduced-cost fixing wants accurate duals (2 layers 28.1 -> 36.6 s with
# them loose).
LOOSE_GAP = 1e-3
IPM_TOLERANCE_PER_GAP = 0.1


def loose_ipm_tolerance(rel_gap: float) -> float | None:
    """The interior point's optimality tolerance for a solve to within ``rel_gap`` (None:
    HiGHS's own)."""
    return IPM_TOLERANCE_PER_GAP * rel_gap if rel_gap >= LOOSE_GAP else None


@dataclass
class _Completion:
    """``Model.ends``, ``Model.paths`` and ``Model.t_rows`` as flat index arrays, so that
    ``complete`` is a few numpy reductions instead of a Python loop over ~100k columns."""

    edge_cols: np.ndarray  # the edge or arc column of each (column, move) entry
    src_cols: np.ndarray  # the x of their sources, concatenated ...
    src_of: np.ndarray  # ... and which entry (position in edge_cols) each belongs to
    dst_cols: np.ndarray
    dst_of: np.ndarray
    # Move and block variables by level: a variable whose rows read another one comes after it.
    # Per level: (the variables, their terms' columns, coefficients, row of each term, variable
    # (position in the level) of each row).
    levels: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]]


def _completion(m: Model) -> _Completion:
    """``m``'s ``_Completion``, built on the first call (the model is final by then)."""
    if m._completion is None:
        m._completion = _build_completion(m)
    return m._completion


def _build_completion(m: Model) -> _Completion:
    entries = [(col, *ends) for col, ends in m.ends.items()]
    entries += [(col, srcs, dsts) for flow in m.flows for cols, srcs, dsts in flow.moves for col in cols]
    edge_cols = np.fromiter((e[0] for e in entries), dtype=np.int64, count=len(entries))

    level: dict[int, int] = {}
    for t, rows in m.t_rows.items():  # in the order added: what a row reads is levelled first
        level[t] = 1 + max((level.get(e, -1) for terms in rows for e in terms), default=-1)
    levels = []
    for lv in range(max(level.values(), default=-1) + 1):
        ts = [t for t, k in level.items() if k == lv]
        cols, coefs, row_of, t_of, r = [], [], [], [], 0
        for i, t in enumerate(ts):
            for terms in m.t_rows[t]:
                cols.extend(terms)
                coefs.extend(terms.values())
                row_of.extend([r] * len(terms))
                t_of.append(i)
                r += 1
        levels.append((np.array(ts, dtype=np.int64), np.array(cols, dtype=np.int64),
                       np.array(coefs, dtype=np.float64), np.array(row_of, dtype=np.int64),
                       np.array(t_of, dtype=np.int64)))
    return _Completion(edge_cols, *_flat([e[1] for e in entries]), *_flat([e[2] for e in entries]), levels)


def _flat(lists: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Lists of columns concatenated, and the list each column came from."""
    cols = np.fromiter((c for cs in lists for c in cs), dtype=np.int64)
    return cols, np.repeat(np.arange(len(lists)), [len(cs) for cs in lists])


def round_lp(m: Model, primal: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The LP point ``primal`` rounded (every group of ``_integer_groups`` by ``round_group``)
    and completed into a point of ``m`` (it may still break the memory row), and the column
    upper bounds of the neighbourhood MIP: the one-hot groups the LP decides (>= RINS_FIX)
    fixed at their choice."""
    a = m.arrays()
    ub = a.ub
    rounded = np.where(a.integer, 0.0, a.lb)
    rins_ub = ub.copy()
    for cols, total in _integer_groups(m):
        rounded[cols] = round_group(primal[cols], total, ub[cols])
        if total == 1 and primal[cols].max() >= RINS_FIX:  # a one-hot group the LP decides
            rins_ub[cols] = rounded[cols]
    restrict_flows(m, rins_ub)
    return complete(m, rounded), rins_ub


def complete(m: Model, val: np.ndarray) -> np.ndarray:
    """``val`` with its integer columns (and the constant) set, completed into a point of the
    model: the columns ``Model.fill`` sets, each edge variable 1 where both its ends are chosen,
    each arc 1 where a move over it is (``Model.flows``), each move or block variable at the
    largest of its rows (``Model.ends``, ``Model.t_rows``; a variable after those its rows read)."""
    val = val.copy()
    if m.fill is not None:
        m.fill(val)
    c = _completion(m)
    n = len(c.edge_cols)
    src = np.bincount(c.src_of, weights=val[c.src_cols], minlength=n)
    dst = np.bincount(c.dst_of, weights=val[c.dst_cols], minlength=n)
    val[c.edge_cols] = 0.0
    np.maximum.at(val, c.edge_cols, ((src > 0.5) & (dst > 0.5)).astype(np.float64))
    for ts, cols, coefs, row_of, t_of in c.levels:
        rows = np.bincount(row_of, weights=coefs * val[cols], minlength=len(t_of))
        best = np.zeros(len(ts))  # a move or block variable is at least 0
        np.maximum.at(best, t_of, rows)
        val[ts] = best
    return val


def violated_rows(m: Model, val: np.ndarray, rows: list[int] | None = None) -> int:
    """How many rows ``val`` breaks (beyond HiGHS's feasibility tolerance), of ``rows`` (all by
    default)."""
    a = m.arrays()
    activity = np.bincount(a.entry_rows, weights=a.value * val[a.index], minlength=len(m.row_lb))
    lo, hi = np.array(m.row_lb), np.array(m.row_ub)
    broken = (activity < lo - FEASIBILITY_TOL) | (activity > hi + FEASIBILITY_TOL)
    return int(broken.sum() if rows is None else broken[rows].sum())


def _bound_ub(m: Model) -> np.ndarray:
    """The column upper bounds, each move or block variable's the largest value its rows can
    force (the Lagrangian bound of ``LpRun.result`` reads them)."""
    a = m.arrays()
    if a.bound_ub is None:
        ub = a.ub.copy()
        for t, rows in m.t_rows.items():  # in the order added: after the columns they read
            ub[t] = min(ub[t], max(sum(max(0.0, c) * ub[e] for e, c in terms.items()) for terms in rows))
        a.bound_ub = ub  # whole: ``LpRun``'s thread may ask at the same time
    return a.bound_ub


def _integer_groups(m: Model) -> list[tuple[np.ndarray, int]]:
    """The columns and the total of each row sum_j n_j = K over integer columns with
    coefficients 1 and a whole K: the one-hot rows sum_s x[r,s] = 1, and the activation
    checkpointing counts n[g,none] + n[g,selective] + n[g,full] = L_g (``checkpointing.py``)."""
    a = m.arrays()
    if a.groups is None:
        groups = []
        for r, (lo, hi) in enumerate(zip(m.row_lb, m.row_ub, strict=True)):
            if lo == hi and lo >= 1.0 and float(lo).is_integer():
                cols = a.index[a.starts[r]:a.starts[r + 1]]
                if a.integer[cols].all() and (a.value[a.starts[r]:a.starts[r + 1]] == 1.0).all():
                    groups.append((cols, int(lo)))
        a.groups = groups  # whole: ``LpRun``'s thread may ask at the same time
    return a.groups


def round_group(values: np.ndarray, total: int, upper: np.ndarray) -> np.ndarray:
    """Whole numbers summing to ``total``, each within [0, upper], nearest to ``values`` by the
    largest remainder (Hamilton's method): each value's floor, then one more to the largest
    fractions until the total is reached. A one-hot group (total 1) takes its largest value."""
    v = np.clip(values, 0.0, upper)
    out = np.minimum(np.floor(v + INTEGRALITY_TOL), upper)
    for i in np.argsort(-(v - out), kind="stable"):
        if out.sum() >= total:
            break
        out[i] += min(upper[i] - out[i], total - out.sum())
    while out.sum() > total:  # floors over the total (an interior point just above a whole)
        out[int(np.argmax(out))] -= 1.0
    return out


@dataclass
class _LpBound:
    bound: float  # a lower bound on the MIP (solver units)
    primal: np.ndarray  # the LP's (interior) point
    reduced: np.ndarray  # the reduced costs the bound was taken with
    any_budget: float  # the same bound with the memory row's dual at 0: it holds for any budget


def _lp_bound(m: Model, unit: float, time_limit_s: float, tolerance: float | None = None) -> _LpBound | None:
    """The LP relaxation by HiGHS's interior point method, without crossover (to its
    optimality ``tolerance``, HiGHS's own by default), and a bound that holds whatever the
    duals' accuracy: for row duals y, every point costs at least
    L(y) = sum_i y_i * (lo_i if y_i > 0 else hi_i) + sum_j min(rc_j * lb_j, rc_j * ub_j),
    rc = c - A'y (Lagrangian duality), with a move or block variable's upper bound the largest
    value its rows can force. None if the LP does not finish in time."""
    run = LpRun(m, unit, time_limit_s, tolerance, background=False)
    return run.result()


def _relaxation(m: Model, unit: float, cols: np.ndarray, rows: np.ndarray) -> highspy.HighsLp:
    """The LP relaxation ``LpRun`` solves: ``m`` without its integrality, on the columns and
    rows the masks ``cols`` and ``rows`` keep (``_kept``; a kept row reads kept columns, or
    left-out ones that are 0 at the points the relaxation stands for)."""
    lp = _highs_lp(m, unit)
    lp.integrality_ = []
    if cols.all() and rows.all():
        return lp
    index = np.asarray(lp.a_matrix_.index_)
    entry_rows = m.entry_rows()
    entries = rows[entry_rows] & cols[index]
    new_col = np.cumsum(cols) - 1
    lp.num_col_, lp.num_row_ = int(cols.sum()), int(rows.sum())
    for name in ("col_cost_", "col_lower_", "col_upper_"):
        setattr(lp, name, np.asarray(getattr(lp, name))[cols])
    lp.row_lower_, lp.row_upper_ = np.asarray(lp.row_lower_)[rows], np.asarray(lp.row_upper_)[rows]
    lp.a_matrix_.start_ = np.concatenate(
        [[0], np.cumsum(np.bincount(entry_rows[entries], minlength=len(rows))[rows])]).astype(np.int32)
    lp.a_matrix_.index_ = new_col[index[entries]].astype(np.int32)
    lp.a_matrix_.value_ = np.asarray(lp.a_matrix_.value_)[entries]
    return lp


def _kept(m: Model, memory: bool) -> tuple[np.ndarray, np.ndarray]:
    """The columns and rows of ``m``'s LP relaxation (masks): all but the part
    ``Model.relaxed_from`` names and, with ``memory`` False, the memory row and the
    ``Model.memory_part``."""
    cols, rows = np.ones(len(m.cost), dtype=bool), np.ones(len(m.row_lb), dtype=bool)
    if m.relaxed_from is not None:
        cols[m.relaxed_from[0]:], rows[m.relaxed_from[1]:] = False, False
    if not memory and m.memory_part is not None:
        part = m.memory_part
        cols[part.cols.start:part.cols.stop], rows[part.rows.start:part.rows.stop] = False, False
        if m.memory_row is not None:
            rows[m.memory_row] = False
    return cols, rows


def _equilibrate_rows(lp: highspy.HighsLp) -> np.ndarray:
    """Divide each row of ``lp`` (coefficients and bounds) by its largest coefficient; returns
    the factors. The interior point converges in fewer iterations on the scaled rows: the max
    rows' coefficients are kernel times in microseconds (up to 1e6), the transport rows' are 1
    (llama3-8b, 2 layers over 8x8: 55 -> 45 iterations, 9.4-9.6 -> 7.5-7.7 s). The point is the
    same; a scaled row's dual is the row's divided by its factor."""
    values = np.asarray(lp.a_matrix_.value_, dtype=np.float64)
    rows = np.repeat(np.arange(lp.num_row_), np.diff(np.asarray(lp.a_matrix_.start_)))
    largest = np.zeros(lp.num_row_)
    np.maximum.at(largest, rows, np.abs(values))
    scale = 1.0 / np.where(largest > 0.0, largest, 1.0)
    lp.a_matrix_.value_ = values * scale[rows]
    lp.row_lower_ = np.asarray(lp.row_lower_) * scale  # infinities stay infinite
    lp.row_upper_ = np.asarray(lp.row_upper_) * scale
    return scale


# An interior point's statuses with a point: optimal, or stopped a little off the dual's tolerance.
_SOLVED = (highspy.HighsModelStatus.kOptimal, highspy.HighsModelStatus.kUnknown)


class LpRun:
    """``_lp_bound`` of a model, optionally solved in a background thread: HiGHS leaves Python's
    GIL while it runs, so the planner goes on (pricing the hand plans) on another core. With
    ``search_gap`` the thread goes on to steps 2-3 of ``solve_by_lp_bound`` (``search``): on
    llama3-70b over 8x8 the LP ends 8 s before the hand plans, and the neighbourhood MIP's 7 s
    ran after them (stop 55: the whole plan 44.6 -> 39.8 s, the same plan). The model must not
    change until ``result``. HiGHS is set up here, in the caller's thread (its
    banner is silenced on the process's stdout, which no other thread should see closed).
    There is no cancelling it: HiGHS's user interrupt polls a Python callback, which takes the
    GIL from the planner's thread (on llama3-8b over 8x8 the LP took 14.7 s instead of 10.8 s
    beside the hand plans); its time limit ends it. Nor is the thread a daemon: a process that
    exits (a user error, exit 2) waits for it, as HiGHS still running when Python shuts down
    aborts the process ("terminate called without an active exception", exit 134)."""

    def __init__(self, m: Model, unit: float, time_limit_s: float, tolerance: float | None = None,
                 *, background: bool = True, memory: bool = False, search_gap: float | None = None) -> None:
        self.m, self.unit, self.tolerance = m, unit, tolerance
        self.deadline = time.perf_counter() + time_limit_s
        # ``search_gap``: once the LP is solved, the thread goes on to steps 2-3 of
        # ``solve_by_lp_bound`` for that gap (``_Search``), its MIP's HiGHS made here (above);
        # what it found, with the bound, under the memory row's bound it found them at.
        self._found: tuple[float | None, _LpBound, _Search | None] | None = None
        self._search_h = _highs(time_limit_s) if background and search_gap is not None else None
        self._search_gap = search_gap
        # Without the memory row first (``MemoryPart``); ``result`` solves the whole LP where
        # that LP's point breaks it.
        self.memory = memory or m.memory_part is None
        self.cols, self.rows = _kept(m, self.memory)
        self.lp = _relaxation(m, unit, self.cols, self.rows)
        self.row_scale = _equilibrate_rows(self.lp)
        self.h = _highs(time_limit_s)
        self.h.setOptionValue("solver", "ipm")
        self.h.setOptionValue("run_crossover", "off")
        if tolerance is not None:
            self.h.setOptionValue("ipm_optimality_tolerance", tolerance)
        self.h.passModel(self.lp)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run) if background else None
        if self._thread is not None:
            self._thread.start()
        else:
            self._run()

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            self.h.run()
            log.debug("interior-point LP: %s in %.2f s", self.h.getModelStatus(), time.perf_counter() - t0)
            if self._search_h is not None:
                lp = self._bound(whole=False)
                if lp is not None:
                    self._found = (self._memory_ub(), lp, _search(
                        self.m, self.unit, lp, None, self._search_gap,
                        max(0.0, self.deadline - time.perf_counter()), self._search_h))
        except BaseException as e:  # handed to the caller by result()
            self._error = e

    def result(self) -> _LpBound | None:
        """Waits for the LP; its bound, or None where it did not finish in time."""
        # What does not depend on the LP, made while it runs (``solve_by_lp_bound`` reads them).
        _bound_ub(self.m)
        _integer_groups(self.m)
        _completion(self.m)
        _flow_moves(self.m)
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error
        found = self._found_now()
        return found[1] if found is not None else self._bound()

    def search(self) -> _Search | None:
        """Steps 2-3 as the thread took them after the LP (once: None after the first call, and
        where the model's memory budget has changed since, ``IlpModel.set_budget``)."""
        found = self._found_now()
        if found is None or found[2] is None:
            return None
        self._found = (found[0], found[1], None)
        return found[2]

    def _found_now(self) -> tuple[float | None, _LpBound, _Search | None] | None:
        """What the thread found, where the memory row's bound is still the one it was found at."""
        found = self._found
        return found if found is not None and found[0] == self._memory_ub() else None

    def _memory_ub(self) -> float | None:
        return None if self.m.memory_row is None else self.m.row_ub[self.m.memory_row]

    def _bound(self, whole: bool = True) -> _LpBound | None:
        """The bound (``result``); ``whole=False``: None where it needs the whole LP solved
        first (``_solve_whole``: its HiGHS is made in the caller's thread, which must be the
        main one)."""
        if not self.memory and not self._keeps_memory():
            if not whole:
                return None
            self._solve_whole()
        h, m = self.h, self.m
        solution = h.getSolution()
        # Without crossover, the interior point may stop "unknown", its point a little off the
        # dual's tolerance (llama3-8b, 32 layers: after 40 iterations, where it was then solved
        # again at HiGHS's tolerance, 13.5 s and then 15.9 s). The bound below holds for any
        # duals, so such a point serves as well; only no point at all does not.
        if not (h.getModelStatus() in _SOLVED and solution.value_valid and solution.dual_valid):
            return None
        # The duals of the rows as ``m`` writes them (each scaled row's dual, times its scale),
        # and the point, over the whole model (0 on the part the relaxation left out).
        y = np.zeros(len(m.row_lb))
        y[self.rows] = np.asarray(solution.row_dual, dtype=np.float64) * self.row_scale
        primal = self._point()
        lo, hi = np.array(m.row_lb, dtype=np.float64), np.array(m.row_ub, dtype=np.float64)
        y[(y > 0.0) & ~np.isfinite(lo)] = 0.0
        y[(y < 0.0) & ~np.isfinite(hi)] = 0.0
        a = m.arrays()
        row_of, index, value, lb = a.entry_rows, a.index, a.value, a.lb
        cost = a.cost / self.unit
        reduced = cost - np.bincount(index, weights=value * y[row_of], minlength=len(cost))
        ub = _bound_ub(m)
        rows_part = np.where(y > 0.0, y * np.where(np.isfinite(lo), lo, 0.0),
                             y * np.where(np.isfinite(hi), hi, 0.0))
        cols_part = np.where(reduced >= 0.0, reduced * lb, reduced * ub)
        if not np.all(np.isfinite(cols_part)):
            return None
        bound = float(rows_part.sum() + cols_part.sum())
        any_budget = bound
        if m.memory_row is not None and y[m.memory_row] != 0.0:
            # L(y) with the memory row's multiplier at 0 is as valid a bound, and its budget appears
            # nowhere in it: a larger budget cannot make any plan cheaper than this.
            at = m.memory_row
            free = reduced.copy()
            np.add.at(free, index[row_of == at], value[row_of == at] * y[at])
            free_cols = np.where(free >= 0.0, free * lb, free * ub)
            any_budget = float(rows_part.sum() - rows_part[at] + free_cols.sum())
            if any_budget > bound:
                # A budget above the one these duals were found for (``IlpModel.set_budget``):
                # the multiplier at 0 bounds better, and reduced-cost fixing takes its costs.
                bound, reduced = any_budget, free
        return _LpBound(bound, primal, reduced, any_budget)

    def _point(self) -> np.ndarray:
        """The LP's point over the whole model: 0 on what the relaxation left out, but the
        memory part, which is set as the relaxation has it (``MemoryPart``)."""
        m = self.m
        primal = np.zeros(len(m.cost))
        primal[self.cols] = np.asarray(self.h.getSolution().col_value)
        if not self.memory:
            if m.memory_part.fill is not None:
                m.memory_part.fill(primal)
            part = m.memory_part.cols
            for t, rows in m.t_rows.items():  # in the order they were added: after what they read
                if t in part:
                    primal[t] = max(0.0, *(sum(c * primal[e] for e, c in terms.items()) for terms in rows))
        return primal

    def _keeps_memory(self) -> bool:
        """Whether the LP without the memory row has a point that keeps to it and to the memory
        part's rows: then it is the whole LP's optimum too (the optimum of a relaxation, and
        feasible); a later ``result`` checks it again (``IlpModel.set_budget``: a lower budget)."""
        m, part = self.m, self.m.memory_part
        status = self.h.getModelStatus()
        point = self._point() if status in _SOLVED and self.h.getSolution().value_valid else None
        if point is None:
            return False
        # The part's rows, the memory row, and any other row that reads a part column not 0 at
        # the point (the LP saw that row without it).
        a = m.arrays()
        read = (a.index >= part.cols.start) & (a.index < part.cols.stop) & (point[a.index] != 0.0)
        rows = sorted({*part.rows, *a.entry_rows[read].tolist(),
                       *([m.memory_row] if m.memory_row is not None else [])})
        return not violated_rows(m, point, rows)

    def _solve_whole(self) -> None:
        """Solve the whole LP, and take its point and duals from now on (where the LP without the
        memory row breaks it, or has no point: its time limit)."""
        m = self.m
        log.debug("the LP without the memory row broke it: the whole LP")
        self.memory = True
        whole = LpRun(m, self.unit, max(0.0, self.deadline - time.perf_counter()), self.tolerance,
                      background=False, memory=True)
        self.h, self.lp, self.row_scale = whole.h, whole.lp, whole.row_scale
        self.cols, self.rows = whole.cols, whole.rows


def _mip(m: Model, unit: float, time_limit_s: float, start: np.ndarray | None, upper: np.ndarray,
         h: highspy.Highs | None = None, rel_gap: float = MIP_REL_GAP,
         loose_from: float | None = None) -> Solved:
    """HiGHS's MIP on ``m`` with column upper bounds ``upper`` (0 fixes a column out), in ``h``
    where given (made in another thread: ``LpRun``); ``loose_from``: ``_run_mip``'s."""
    lp = _highs_lp(m, unit)
    lp.col_upper_ = upper
    if h is None:
        h = _highs(time_limit_s, rel_gap)
    else:
        h.setOptionValue("time_limit", float(time_limit_s))
        h.setOptionValue("mip_rel_gap", rel_gap)
    h.passModel(lp)
    return _run_mip(h, start, len(m.cost), loose_from)


def _within(point: np.ndarray | None, cost: np.ndarray, bound: float, rel_gap: float) -> bool:
    """Whether ``point`` costs within ``rel_gap`` of ``bound``, for a gap looser than the
    solver's own (at that, only the MIP proves the optimum)."""
    if point is None or rel_gap <= MIP_REL_GAP:
        return False
    upper = float(cost @ point)
    return upper - bound <= rel_gap * upper


@dataclass
class _Search:
    """Steps 2-3 of ``solve_by_lp_bound``: the rounded LP point, how many rows it breaks, the
    neighbourhood MIP's result and how many columns it could use."""

    rounded: np.ndarray
    broken: int
    rins: Solved
    columns: int


def _search(m: Model, unit: float, lp: _LpBound, start: np.ndarray | None, rel_gap: float, left_s: float,
            h: highspy.Highs | None = None) -> _Search:
    """Round the LP point and search its neighbourhood (in ``h`` if given) for ``RINS_SHARE`` of
    ``left_s``, ``POLISH_S`` at most where the cheaper of ``start`` and the rounded point is within
    ``rel_gap`` of the bound already, and ``LOOSE_MIP_S`` at most for any other loose gap (as the
    last MIP: llama3-405b over 16x8 at --gap 0.01, its neighbourhood ran 47 s of a 180-s limit to
    the stall guard, its plan 2.8% over the bound, each of the budget fit's solves again).

    The neighbourhood is searched even there: the objective's error beside the step schedule is
    larger than such a gap, so a cheaper plan next to the rounded one is worth the second it takes.
    On llama3-8b, 2 layers over 8x8 at --gap 0.01, the rounded point was 0.09% over the bound and
    ran 54.1 ms a step by the schedule; the neighbourhood's optimum (0.4 s, 12 of 452 nodes placed
    otherwise) is the model's optimum, 48.1 ms. The rounded point may break the memory row: HiGHS
    then looks for a point itself."""
    cost = m.arrays().cost / unit
    rounded, rins_ub = round_lp(m, lp.primal)
    broken = violated_rows(m, rounded)
    best = [p for p in (start, None if broken else rounded) if p is not None]
    polish = any(_within(p, cost, lp.bound, rel_gap) for p in best)
    limit_s = RINS_SHARE * left_s
    if polish:
        limit_s = min(limit_s, POLISH_S)
    elif rel_gap >= LOOSE_GAP:
        limit_s = min(limit_s, LOOSE_MIP_S)
    rins = _mip(m, unit, limit_s, None if broken else rounded, rins_ub, h)
    return _Search(rounded, broken, rins, int((rins_ub > 0.0).sum()))


def start_lp_bound(m: Model, unit: float, time_limit_s: float, rel_gap: float = MIP_REL_GAP, *,
                   background: bool = True) -> LpRun:
    """``solve_by_lp_bound``'s first step, started now (in a background thread: its ``ahead``)."""
    return LpRun(m, unit, LP_BOUND_SHARE * time_limit_s, loose_ipm_tolerance(rel_gap), background=background,
                 search_gap=rel_gap)


def solve_by_lp_bound(m: Model, unit: float, time_limit_s: float, start: np.ndarray | None,
                      rel_gap: float = MIP_REL_GAP, ahead: LpRun | None = None) -> Solved:
    """Solve ``m`` exactly in four steps, for models whose LP is slow by simplex (the schedule
    objective's max rows) but whose LP optimum is nearly integral:

    1. the LP relaxation by interior point (``start_lp_bound``; to ``loose_ipm_tolerance`` where
       ``rel_gap`` is at least LOOSE_GAP, solved again at HiGHS's own if that one fails): a
       lower bound LB, the LP point;
    2. rounding: each one-hot group to its largest LP value, each group of activation
       checkpointing counts to whole counts of the same total (``round_group``), completed
       (``complete``: the edges, the spread columns, the move and block variables);
    3. a neighbourhood MIP (RINS): the groups the LP decides (>= RINS_FIX) fixed, the rest
       free, from the rounded point where it is one; the cheaper of its plan and ``start`` is
       the incumbent UB;
    4. reduced-cost fixing: a binary, edge or arc column with rc_j > UB - LB is 0 in every
       plan cheaper than UB (every point costs >= LB + rc_j when it is 1; an edge variable is 0
       or 1 at integral x, and so is an arc at some cheapest point: an edge's flow costs the
       sum of its arcs' times in one load of one block, so a path of one unit is among its
       cheapest), so it is fixed out, and HiGHS's MIP solves the rest from UB (for LOOSE_MIP_S
       at most where ``rel_gap`` is at least LOOSE_GAP, and not at all where it leaves more than
       LOOSE_MIP_MAX_LEFT of the columns).

    Steps 2-3 are ``ahead``'s where its thread took them (``LpRun.search``). The optimum is the
    whole model's; the bound is the larger of LB and the last MIP's. It stops
    early where the incumbent is within ``rel_gap`` of LB after step 3 (which then runs for
    POLISH_S at most), or HiGHS of its bound. If the LP does not finish within LP_BOUND_SHARE of
    the time, the whole MIP gets the rest. The rounded point and the neighbourhood's plan, where
    they are not the solution, are its ``alternatives``. ``ahead``: step 1 already started on
    ``m`` (``start_lp_bound``), with its own time limit."""
    deadline = time.perf_counter() + time_limit_s
    ub = m.arrays().ub.copy()
    if ahead is None:
        ahead = start_lp_bound(m, unit, time_limit_s, rel_gap, background=False)
    elif ahead.m is not m:
        raise ValueError("the LP started ahead is another model's")
    else:  # a whole LP it solves now (``LpRun._solve_whole``) is this solve's first step
        ahead.deadline = max(ahead.deadline, time.perf_counter() + LP_BOUND_SHARE * time_limit_s)
    lp = ahead.result()
    if lp is None and ahead.tolerance is not None:  # the loose LP ended without an optimal status
        lp = _lp_bound(m, unit, LP_BOUND_SHARE * max(0.0, deadline - time.perf_counter()))
    if lp is None:
        return _mip(m, unit, max(0.0, deadline - time.perf_counter()), start, ub, rel_gap=rel_gap)
    cost, integer = m.arrays().cost / unit, m.arrays().integer
    searched = ahead.search()
    if searched is None:
        searched = _search(m, unit, lp, start, rel_gap, max(0.0, deadline - time.perf_counter()))
    rounded, broken, rins = searched.rounded, searched.broken, searched.rins
    incumbent = start
    if not broken and (incumbent is None or float(cost @ rounded) < float(cost @ incumbent)):
        incumbent = rounded
    log.debug("LP bound %.6g after %.2f s; rounded %.6g (%d rows broken); start %.6g", lp.bound,
              time.perf_counter() - (deadline - time_limit_s), float(cost @ rounded), broken,
              float(cost @ start) if start is not None else math.inf)
    # The model's own plans this solve finds (not the start, a hand plan's).
    found = [] if broken else [rounded]
    if rins.solution is not None:
        found.append(complete(m, np.where(integer, np.round(rins.solution), rins.solution)))
        if incumbent is None or rins.objective < float(cost @ incumbent):
            incumbent = found[-1]
    log.debug("neighbourhood MIP: %s %.6g", rins.status, rins.objective)
    upper = float(cost @ incumbent) if incumbent is not None else math.inf

    def stand(columns: int) -> Solved:  # the incumbent, with no (more) MIP
        return Solved("feasible", upper, lp.bound, incumbent, columns=columns, bound_any_budget=lp.any_budget,
                      alternatives=_others(found, incumbent, integer))

    if _within(incumbent, cost, lp.bound, rel_gap):  # close enough
        return stand(searched.columns)
    fixable = integer.copy()
    fixable[list(m.ends)] = True
    for flow in m.flows:
        fixable[flow.arcs] = True
    fixed = fixable & (lp.reduced > upper - lp.bound + DUAL_FEASIBILITY_TOL) & (np.asarray(m.lb) == 0.0)
    if incumbent is not None:
        fixed &= incumbent <= 0.5  # the incumbent stays a point
    ub[fixed] = 0.0
    restrict_flows(m, ub)
    columns = int((ub > 0.0).sum())
    left = max(0.0, deadline - time.perf_counter())
    loose = rel_gap >= LOOSE_GAP
    if loose and incumbent is not None and columns > LOOSE_MIP_MAX_LEFT * len(ub):
        log.debug("no MIP after the neighbourhood: %d of %d columns left", columns, len(ub))
        return stand(columns)
    done = _mip(m, unit, min(left, LOOSE_MIP_S) if loose else left, incumbent, ub, rel_gap=rel_gap,
                loose_from=lp.bound if loose else None)
    done.bound = max(done.bound, lp.bound)
    done.columns = columns
    if done.solution is None and incumbent is not None:  # out of time: the incumbent stands
        done = Solved("feasible", upper, lp.bound, incumbent, columns=done.columns)
    done.bound_any_budget = lp.any_budget
    if done.solution is not None:
        done.alternatives = _others(found, done.solution, integer)
    return done


def _others(points: list[np.ndarray], solution: np.ndarray, integer: np.ndarray) -> list[np.ndarray]:
    """The ``points`` that place something otherwise than ``solution`` and than the ones before
    them (their integer columns differ), in order."""
    seen = [np.round(solution[integer])]
    out = []
    for p in points:
        key = np.round(p[integer])
        if not any(np.array_equal(key, k) for k in seen):
            seen.append(key)
            out.append(p)
    return out
