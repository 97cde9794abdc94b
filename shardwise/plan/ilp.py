r"""The placement ILP, solved exactly with HiGHS.

Variables
  x[r,s] in {0,1}   representative node r runs strategy s            (one-hot: sum_s x[r,s] = 1)
  e[k,p,q] in [0,1] edge k pays the redistribution p -> q            (continuous; exact, see below)

Let y[u,p] = sum_{s: out(s)=p} x[u,s] (producer u yields placement p) and
    z[k,q] = sum_{s: in_j(s)=q} x[v,s] (edge k = (u -> v, argument j) needs placement q).

Edge rows (a transportation problem per edge; its LP relaxation is tight for one edge):
  sum_p e[k,p,q] = z[k,q]  for every q the consumer may need
  sum_q e[k,p,q] = y[u,p]  for every p the producer may yield
At integral x exactly one y and one z are 1, so the cheapest feasible e is 1 on the single pair
(p, q) actually used and 0 elsewhere: the LP part is exact, no product variables needed. Pairs
with infinite cost have no e, so the rows forbid them.

Flow edges (under the schedule objective): an edge that is not a prefetched parameter's (whose
moves that objective splits) is instead a flow of one unit over the hops its moves take
(``_add_network``). A move is a shortest path of one-mesh-dim redistributes
(``cost/reshard.reshard_path``) and the moves of one edge share most hops, so an arc per hop
replaces a column per (p, q): over 8x8, 246 arcs for the 445 moves between the 25 placements of
a 3-d activation; on llama3-8b, 2 layers, 72k columns instead of 86k and the interior-point LP
of the schedule objective 7.7 -> 6.2 s. Where the hops would price some move below its time (a
shortcut through another move's path), the edge keeps its transport rows, and so do the other
edges of its producer's group (below).

Objective (seconds per step)
  sum_r copies(r) sum_s t_compute(r,s) x[r,s] + sum_G copies(G) sum_q t[G,q]
A value moved to a placement serves every consumer that reads it there (the lowering moves it
once), so moves are paid per producer: producer copies with the same outgoing edges form a group
G, and t[G,q] >= sum_p c(p,q) e[k,p,q] for each of its edges k. At integral x each edge uses one
pair, so t[G,q] is the cost of moving the value to q when some edge needs q, and 0 otherwise
(written as the first edge's terms plus a variable d >= each other edge's less the first's:
``_pay_once``). (A variable per (p, q) with a row per edge, g[G,p,q] >= e[k,p,q], is as exact
with a tighter relaxation, but on llama3-8b over 8x8 it takes 60k rows instead of 16k and its LP
is ~1.5x slower, for the same optimum.) With one edge, e carries the cost. copies() counts the
graph nodes a clustered representative stands for. A group of flow edges pays each hop once
instead: t[G,h] >= c(h) f[k,h] for each edge k whose flow f may take hop h (one hop: the
placement it moves from and the one it moves to). Where the edges move to one placement that is
t[G,q]; where their moves to two placements share a hop (p -> (R, S(1)) and p -> (R, S(1)) ->
(R, R)), the hop is paid once, and so it runs: the lowering, the step schedule and the estimate
move an activation from its copy cheapest to move, the value as made or a placement an earlier
move reached or passed through (``cost/reshard.start_of_move``). Two cases stay a relaxation
(its bound holds for the pairs' exact pay-once, and a plan may be priced below its moves): the
readers' moves of two phases (the lowering keeps a forward copy for a backward move only where
a backward reader reads that placement, as the memory row counts), and flows that leave a
move's own path to share hops with another. On llama3-8b, 2 layers over 8x8, the 44k transport
pairs of such groups became 23k arcs: 72k -> 59k columns (but 14k -> 29k rows), the
interior-point LP 6.2 -> 4.5 s, the same bound (53,807 us) and plan.

Sinks: a parameter's gradient is an edge into the parameter's own placement (that edge is the
gradient synchronisation: all_reduce for DDP, reduce_scatter for FSDP); the loss is an edge into
Replicate.

Memory per device, <= budget. Training:
  sum_params copies * sum_s x * local_numel(s) * (param + grad + optimizer-state bytes)
  + sum_{forward nodes read by backward} copies * sum_s x * local_bytes(out(s))
  + the moved copies of those nodes kept for the backward (``_saved_moves``)
The original of a node whose backward readers all read a moved copy is counted though the
step frees it (an over-count of at most its bytes: on llama-tiny over 2x2 with fsdp_tp_sp and
full checkpointing, the row holds 1.20x the schedule's saved activations, 1.03x with none).
Inference: the parameters' local bytes (a replicated 70B model does not fit an 80 GB device).

Solving (``solver.py``): most columns are edge variables e of dear moves. Each edge marks all but
its free moves and its CORE_PER_LINE cheapest moves out of each p and into each q as optional;
HiGHS solves the LP without them, prices them back in by reduced cost until none could lower the
objective (the full LP's optimum), and returns an integral LP optimum as the ILP's; otherwise it
runs the MIP over the columns whose reduced cost leaves them able to beat the start point. The
optimum is the whole model's (``pricing=False`` solves the whole model at once). The schedule
objective's model (``objective.py``) is solved from its interior-point LP bound instead
(``solver.solve_by_lp_bound``), that LP first without the memory row and the columns and rows
only it reads (``solver.MemoryPart``), the whole LP only where that LP's point breaks the row:
on llama3-8b, 2 layers over 8x8, 4.4 -> 3.1-3.5 s, the same bound and plan.

Activation checkpointing (``checkpointing.py``, training): per cluster of identical layers, how
many run none / selective / full, with the recomputation in the objective and the saved bytes
in the memory row in place of the layers' activations above.

``build`` makes the model and ``solve_built`` solves it from start points, so that the planner
can start its LP relaxation (``IlpModel.start_lp``) before the hand plans that give the starts
are priced.

Start point: a hand plan's choices (one strategy per deciding representative) fix x; each e is
then 1 on the one pair its ends choose and each t the largest of its rows, a complete point that
is checked against every row before HiGHS gets it as its first incumbent (``_start_vector``).
"""

from __future__ import annotations

import logging
import math
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import fx
from torch.distributed.tensor import Replicate

from shardwise.ir.flops import is_view
from shardwise.ir.match import is_transpose_2d
from shardwise.ir.regions import alias_root
from shardwise.ir.trace import Phase, Traced
from shardwise.passes.remat import ACPolicy
from shardwise.plan.cluster import Clustering
from shardwise.plan.costs import MoveNetwork, PlannerCosts, local_bytes
from shardwise.plan.placement import Placements, view_base_placements
from shardwise.plan.plan import tensor_args
from shardwise.plan.solver import (
    MIP_REL_GAP,
    Flow,
    LpRun,
    MemoryPart,
    Model,
    add_terms,
    complete,
    solve_model,
    start_lp_bound,
    violated_rows,
)
from shardwise.plan.strategies import NodeStrategies, Strategy, intern

if TYPE_CHECKING:
    from shardwise.plan.checkpointing import CheckpointingModel
    from shardwise.plan.objective import ScheduleObjective
    from shardwise.plan.plan import ACChoice

log = logging.getLogger(__name__)
GRAD_SINK = -1  # argument index of a gradient -> parameter-placement edge
LOSS_SINK = -2  # argument index of the loss -> Replicate edge
# The solver sees costs in microseconds: in seconds, a kernel's launch floor (~1e-6) and the
# differences between strategies (~1e-9) fall under HiGHS's absolute tolerances (~1e-7).
OBJECTIVE_UNIT_S = 1e-6
# ... and the memory row in GiB (in bytes its coefficients reach 1e11, far from the others').
MEMORY_UNIT_BYTES = 2**30
# Moves per source and per destination of an edge that the first LP keeps (``_core_pairs``);
# the rest are priced in. On llama3-8b over 8x8, 6 keeps about half of the transport columns,
# and the optimum needs few of the others: its restricted LP already has the full LP's value.
CORE_PER_LINE = 6


# Optimizer state per parameter element, in bytes: Adam/AdamW keep two fp32 moments, SGD with
# momentum one fp32 buffer, plain SGD none.
OPTIMIZER_STATE_BYTES = {"adam": 8, "adamw": 8, "sgd-momentum": 4, "sgd": 0}


@dataclass(frozen=True)
class MemoryModel:
    """Bytes a parameter element costs beyond itself and its gradient (Adam: two fp32 moments)."""

    optimizer_state_bytes: int = OPTIMIZER_STATE_BYTES["adam"]
    include_activations: bool = True
    # Count the moved copies of activations kept for the backward too (``_saved_moves``).
    moved_copies: bool = True
    # Nodes whose saved bytes another model counts (``checkpointing.py``: the decoder layers').
    exclude: frozenset[str] = frozenset()

    def bytes_per_byte(self, traced: Traced, node: fx.Node) -> float:
        """Device bytes per byte of ``node``'s value held for the step: a parameter with its
        gradient and optimizer state (training), an activation the backward reads, else 0."""
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            return 0.0
        if node.op == "placeholder" and node.name in traced.params.values():
            return 2.0 + self.optimizer_state_bytes / val.element_size() if traced.train else 1.0
        saved = (traced.train and self.include_activations and node.op == "call_function"
                 and node.name not in self.exclude
                 and not is_view(node) and traced.phase(node) is Phase.FORWARD
                 and any(traced.phase(u) is Phase.BACKWARD for u in node.users))
        return 1.0 if saved else 0.0


@dataclass(frozen=True)
class IlpPoint:
    """A plan of the ILP: a strategy index per representative, its activation checkpointing,
    its objective (seconds) and its memory row (bytes; None without a budget)."""

    choice: dict[fx.Node, int]
    ac: ACChoice | None
    objective_s: float
    memory_bytes: float | None


@dataclass
class IlpResult:
    status: str  # "optimal" | "feasible" | "infeasible" | "unsolved" (time limit, no plan found yet)
    objective_s: float
    mip_gap: float
    choice: dict[fx.Node, int]  # representative -> strategy index
    n_vars: int
    n_rows: int
    build_s: float
    solve_s: float
    min_memory_bytes: int | None = None
    bound_s: float = 0.0  # the solver's lower bound on the optimum (seconds)
    start_s: float | None = None  # the objective at the start point handed to the solver, if any
    # How the model was solved (``solver.solve_model``): pricing rounds, columns priced in,
    # columns the last solve could use, optional columns in all.
    stats: dict[str, int] = field(default_factory=dict)
    ac: ACChoice | None = None  # the activation checkpointing chosen (with a checkpointing model)
    memory_bytes: float | None = None  # the memory row at the solution (with a budget)
    # Which start point the solver was given: 0 for ``start``, i for ``more_starts[i - 1]``;
    # None where none was a point of the model.
    start_index: int | None = None
    # A lower bound on the optimum (seconds) that holds whatever the memory budget (0 where the
    # solver gave none): no larger budget can give a plan cheaper than it.
    bound_any_budget_s: float = 0.0
    # Other plans of the model the solve found (``solver.Solved.alternatives``), dearer by the
    # objective than ``choice`` or as dear, for the planner to price by the step schedule.
    alternatives: list[IlpPoint] = field(default_factory=list)


@dataclass
class _Model(Model):
    # Where cost terms go: the serial sum (None), or a schedule objective's rows
    # (``plan/objective.py``), which takes each term with what it is (a node's kernel, a move).
    objective: ScheduleObjective | None = None

    def charge(self, col: int, seconds: float, tag: object, shares: Sequence[float] | None = None,
               kept: bool = False) -> None:
        """``seconds`` on column ``col``; ``shares``: a move's split (``_Paid.shares``); ``kept``:
        a move of parameters that stay gathered (``ScheduleObjective.kept``)."""
        if self.objective is None:
            self.cost[col] += seconds
        else:
            self.objective.charge(col, seconds, tag, shares, kept)

    def add_cost(self, col: int, seconds: float, _tag: object = None) -> None:
        """``seconds`` on column ``col`` in the serial sum."""
        self.cost[col] += seconds


@dataclass
class _Paid:
    """One edge's paid moves: each one's e variable, its destination q (by the interned
    placement's id; a flow edge's arcs: their hops, ``MoveNetwork.labels``), which a producer's
    edges pay once, its time in seconds and, for a prefetched parameter under the schedule
    objective, its time's split (``PlannerCosts.move_shares``)."""

    cols: list[int]
    dests: list[object]
    seconds: list[float]
    shares: list[np.ndarray] | None = None


def _supply(ns: dict[fx.Node, NodeStrategies], xs: dict[fx.Node, list[list[int]]], clus: Clustering,
            node: fx.Node, index: int = 0) -> dict[Placements, list[int]]:
    """y[u, p]: the x variables that make ``node`` (through its representative) yield p."""
    r = clus.rep[node]
    st = ns[r]
    if st.alias_of is not None:
        parent, idx = st.alias_of
        return _supply(ns, xs, clus, parent, idx)
    out: dict[Placements, list[int]] = defaultdict(list)
    for i, s in enumerate(st.strategies):
        out[s.output[index]].extend(xs[r][i])
    return out


def _strategy_vars(ns: dict[fx.Node, NodeStrategies], xs: dict[fx.Node, list[list[int]]], clus: Clustering,
                   r: fx.Node) -> list[list[int]]:
    """x[r, s] as a sum of variables: one fresh binary per strategy for a deciding node; for a
    follower, the producer's variables that yield the placement strategy s reads."""
    st = ns[r]
    if st.follows is None:
        return [[v] for v in xs[r]]
    supply = _supply(ns, xs, clus, st.follows)
    return [supply[s.inputs[0]] for s in st.strategies]


@dataclass
class IlpModel:
    """The placement ILP built (``build``), to be solved from any start points (``solve_built``)."""

    m: _Model
    xs: dict[fx.Node, list[list[int]]]  # x[r, s] of each representative, as sums of columns
    deciding: dict[fx.Node, list[int]]  # the one-hot columns of each deciding representative
    one: int  # the column fixed at 1
    schedule: ScheduleObjective | None
    checkpointing: CheckpointingModel | None
    mem_terms: dict[int, float] | None  # the memory row's coefficients (None without a budget)
    min_mem: int | None
    build_s: float
    lp_ahead: LpRun | None = None  # its LP relaxation, started by ``start_lp``

    def set_budget(self, memory_budget: float) -> None:
        """Bound the memory row by ``memory_budget`` (bytes) instead: nothing else of the model
        depends on it. Its LP relaxation, solved already (``lp_ahead``), serves the next solve
        too: the bound ``solver.LpRun`` gives is a Lagrangian one, valid for any duals, and it
        reads the row's bound when asked (one with a lower budget is at least as high)."""
        if self.m.memory_row is None:
            raise ValueError("this placement ILP has no memory row")
        self.m.row_ub[self.m.memory_row] = float(memory_budget) / MEMORY_UNIT_BYTES

    def point(self, choice: dict[fx.Node, int], ac: ACChoice | None = None) -> np.ndarray:
        """The complete point of the model at ``choice`` (deciding representative -> strategy
        index) with activation checkpointing ``ac`` (``_start_vector``)."""
        return _start_vector(self.m, self.deciding, choice, self.one, self.checkpointing, ac)

    def price(self, val: np.ndarray) -> float:
        """The objective (seconds) at the complete point ``val``: the schedule objective's
        maximum form (``ScheduleObjective.value``), else the serial cost."""
        return float(np.dot(self.m.cost, val)) if self.schedule is None else self.schedule.value(val)

    def start_lp(self, time_limit_s: float, rel_gap: float = MIP_REL_GAP) -> None:
        """Start the LP relaxation that the schedule objective's solve begins with, in a
        background thread, so that the caller's next work overlaps it (``solver.LpRun``)."""
        if self.schedule is not None:
            self.lp_ahead = start_lp_bound(self.m, OBJECTIVE_UNIT_S, time_limit_s, rel_gap)


def solve(traced: Traced, ns: dict[fx.Node, NodeStrategies], clus: Clustering, costs: PlannerCosts,
          *, memory_budget: float | None = None, memory: MemoryModel | None = None,
          time_limit_s: float = 60.0, start: dict[fx.Node, int] | None = None,
          schedule: ScheduleObjective | None = None, checkpointing: CheckpointingModel | None = None,
          start_ac: ACChoice | None = None,
          more_starts: Sequence[tuple[dict[fx.Node, int], ACChoice | None]] = (),
          pricing: bool = True, rel_gap: float = MIP_REL_GAP) -> IlpResult:
    """Build the placement ILP and solve it (``build``, then ``solve_built``)."""
    model = build(traced, ns, clus, costs, memory_budget=memory_budget, memory=memory, schedule=schedule,
                  checkpointing=checkpointing)
    return solve_built(model, time_limit_s=time_limit_s, start=start, start_ac=start_ac,
                       more_starts=more_starts, pricing=pricing, rel_gap=rel_gap)


def build(traced: Traced, ns: dict[fx.Node, NodeStrategies], clus: Clustering, costs: PlannerCosts,
          *, memory_budget: float | None = None, memory: MemoryModel | None = None,
          schedule: ScheduleObjective | None = None,
          checkpointing: CheckpointingModel | None = None) -> IlpModel:
    """The placement ILP of the representatives' strategies ``ns``. ``schedule``: the schedule
    objective (``plan/objective.py``) in place of the serial sum. ``checkpointing``: activation
    checkpointing decided per cluster of layers (``plan/checkpointing.py``)."""
    t0 = time.perf_counter()
    memory = memory or MemoryModel()
    m = _Model(objective=schedule)
    copies = clus.copies()
    reps = [r for r in clus.representatives if r in ns]
    xs: dict[fx.Node, list[list[int]]] = {}
    deciding: dict[fx.Node, list[int]] = {}
    for r in reps:
        st = ns[r]
        if st.alias_of is not None:
            continue
        n = copies[r]
        if st.follows is None:
            deciding[r] = [m.var(0.0) for _ in st.strategies]
            for v, s in zip(deciding[r], st.strategies, strict=True):
                m.charge(v, n * costs.compute_time(r, s), r)
            m.row(1.0, 1.0, {v: 1.0 for v in deciding[r]})
            xs[r] = [[v] for v in deciding[r]]
        else:
            xs[r] = _strategy_vars(ns, xs, clus, r)
            for s, vs in zip(st.strategies, xs[r], strict=True):
                c = n * costs.compute_time(r, s)
                for v in vs:
                    m.charge(v, c, r)

    # Edges, keyed on representatives. A value is moved to a placement once however many
    # consumers read it there, so the cost of a move sits on the producer: copies of a producer
    # with the same outgoing edges form a group, and the group pays once per copy for each
    # (p, q) any of its edges uses.
    example: dict[tuple[fx.Node, fx.Node, int], fx.Node] = {}
    out_keys: dict[fx.Node, list[tuple[fx.Node, fx.Node, int]]] = defaultdict(list)

    def edge(u: fx.Node, k: tuple[fx.Node, fx.Node, int]) -> None:
        example[k] = u
        if k not in out_keys[u]:
            out_keys[u].append(k)

    for v in traced.gm.graph.nodes:
        if v.op != "call_function":
            continue
        st_v = ns[clus.rep[v]]
        if st_v.alias_of is not None or st_v.follows is not None:
            continue
        for j, u in enumerate(tensor_args(v)):
            edge(u, (clus.rep[u], clus.rep[v], j))
    for pname, gname in traced.grads.items():
        g, ph = traced.node(gname), traced.node(traced.params[pname])
        edge(g, (clus.rep[g], clus.rep[ph], GRAD_SINK))
    if traced.loss is not None:
        loss = traced.node(traced.loss)
        edge(loss, (clus.rep[loss], clus.rep[loss], LOSS_SINK))

    one = m.var(0.0, lb=1.0, integer=False)  # the constant 1
    moves: dict[tuple[fx.Node, fx.Node, int], _Paid] = {}
    pending: dict[tuple[fx.Node, fx.Node, int], tuple] = {}  # edges made once their groups are known
    demands: dict[tuple[fx.Node, fx.Node, int], dict[Placements, list[int]]] = {}
    for (u, v, j), producer in example.items():
        supply = _supply(ns, xs, clus, u)
        if j == LOSS_SINK:
            demand = {intern((Replicate(),) * len(costs.mesh_shape)): [one]}
        elif j == GRAD_SINK:
            demand = _supply(ns, xs, clus, v)
        else:
            demand = defaultdict(list)
            for i, s in enumerate(ns[v].strategies):
                demand[s.inputs[j]].extend(xs[v][i])
        if len(supply) == 1 and list(supply) == list(demand):
            continue  # one placement on both ends: nothing to decide, nothing to pay
        val = producer.meta["val"]
        demands[(u, v, j)] = demand
        if schedule is not None and (schedule.prefetched(u, j) or schedule.pipelined_reduction(u, j)):
            srcs, dsts = list(supply), list(demand)  # split by ``shares``: transport
            moves[(u, v, j)] = _add_edge(m, supply, demand, costs.move_times(srcs, dsts, val),
                                         costs.move_shares(srcs, dsts, val, j < 0 or schedule.pipelined(v)))
        else:
            pending[(u, v, j)] = (supply, demand, val)
    if schedule is not None:
        _join_parameter_views(traced, out_keys, moves, demands)
    # Each group's edges in their consumers' graph order: the first is the reader the move runs
    # for (the schedule objective charges it to that reader's block), and the model is built
    # the same way on every run (a set's order follows the nodes' hashes).
    position = {n: i for i, n in enumerate(traced.gm.graph.nodes)}
    # Under the schedule objective, the copies of a parameter that stay gathered pay apart.
    groups: dict[tuple[fx.Node, tuple, bool], int] = defaultdict(int)
    for u, keys in out_keys.items():
        paid = sorted((k for k in keys if k in demands), key=lambda k: (position[k[1]], k[2]))
        groups[(clus.rep[u], tuple(paid), schedule is not None and schedule.kept(u))] += 1
    parts = [(part, n, kept) for (_, keys, kept), n in groups.items()
             for part in ([list(keys)] if schedule is None else schedule.split(list(keys), kept))]
    # An edge is a flow over its moves' hops, and a producer whose edges share moves pays each
    # hop once (``_charge_moves``), unless one of its shared edges has no exact network
    # (``PlannerCosts.move_network``) or is a parameter's (transport pairs, paid per
    # destination): then all of them keep transport pairs. Under the schedule objective only,
    # whose LP is solved by interior point: HiGHS's MIP of the serial model was slower with
    # flows (llama-tiny, 2 layers over 2 devices, a tight budget: 11.4 -> 16.3 s).
    nets = ({k: costs.move_network(list(supply), list(demand), val)
             for k, (supply, demand, val) in pending.items()} if schedule is not None else {})
    for part, _, _ in parts:
        if len(part) > 1 and not all(nets.get(k) is not None for k in part):
            nets.update(dict.fromkeys((k for k in part if k in pending), None))
    for k, (supply, demand, val) in pending.items():
        net = nets.get(k)
        moves[k] = (_add_network(m, supply, demand, net) if net is not None
                    else _add_edge(m, supply, demand, costs.move_times(list(supply), list(demand), val)))
    for part, n, kept in parts:
        _charge_moves(m, [moves[k] for k in part], n, part, kept)

    def supply_of(n: fx.Node) -> dict[Placements, list[int]]:
        return _supply(ns, xs, clus, n)

    ck_mem: dict[int, float] = {}
    part_from = (len(m.cost), len(m.row_lb))  # what only the memory row needs starts here
    if checkpointing is not None:
        memory = replace(memory, exclude=checkpointing.excluded())
        ck_mem = checkpointing.build(m, ns, xs, supply_of,
                                     schedule.charge_recompute if schedule is not None else m.add_cost)
        # A rounded point's spread columns follow from its counts and its x: the counts as
        # whole numbers, then filled as a start point's are.
        m.fill = lambda val: checkpointing.complete(val, checkpointing.choice(val))
    mem_terms, min_mem = None, None
    if memory_budget is not None:
        mem_terms, min_mem = _memory_terms(traced, ns, xs, clus, costs, memory)
        if traced.train and memory.include_activations and memory.moved_copies:
            add_terms(ck_mem, _saved_moves(traced, clus, costs, m, demands, supply_of, one, checkpointing))
        add_terms(mem_terms, ck_mem)
    if checkpointing is None or checkpointing.fixed in (None, ACPolicy.NONE):
        # The interior-point LP starts without it (``solver.MemoryPart``); a fixed policy that
        # recomputes is a cost, not a choice the memory row alone asks for.
        fill = None if checkpointing is None else partial(checkpointing.complete, ac=None)
        m.memory_part = MemoryPart(range(part_from[0], len(m.cost)), range(part_from[1], len(m.row_lb)), fill)
    if memory_budget is not None:
        m.memory_row = len(m.row_lb)
        m.row(-math.inf, float(memory_budget) / MEMORY_UNIT_BYTES,
              {v: b / MEMORY_UNIT_BYTES for v, b in mem_terms.items()})
    if schedule is not None:
        schedule.charge_optimizer(ns, xs, one)
        schedule.finish(m, OBJECTIVE_UNIT_S)

    build_s = time.perf_counter() - t0
    return IlpModel(m, xs, deciding, one, schedule, checkpointing, mem_terms, min_mem, build_s)


def solve_built(model: IlpModel, *, time_limit_s: float = 60.0, start: dict[fx.Node, int] | None = None,
                start_ac: ACChoice | None = None,
                more_starts: Sequence[tuple[dict[fx.Node, int], ACChoice | None]] = (),
                pricing: bool = True, rel_gap: float = MIP_REL_GAP) -> IlpResult:
    """Solve a built placement ILP. ``start`` (deciding representative -> strategy index, e.g. a
    hand plan's choices) is handed to HiGHS as its first incumbent: the solver completes the
    continuous edge variables and, if the point is feasible, never returns anything worse, so
    a time limit costs only optimality. ``start_ac``: the start point's activation
    checkpointing. ``more_starts``: other (choice, activation checkpointing) points; the cheapest
    of them and ``start`` that breaks no row is the solver's start (``IlpResult.start_index``).
    ``pricing=False``: HiGHS gets the whole model at once (``solver.py``). ``rel_gap``: the
    solver may stop at a plan within this relative gap of its bound (the default: the
    optimum)."""
    m, schedule = model.m, model.schedule
    mem_terms, min_mem, build_s = model.mem_terms, model.min_mem, model.build_s
    t1 = time.perf_counter()
    start_val, start_s, start_index = None, None, None
    candidates = [(start, start_ac)] if start is not None else []
    candidates += list(more_starts)
    broken = []
    for i, (choice, ac) in enumerate(candidates):
        val = model.point(choice, ac)
        bad = violated_rows(m, val)
        if bad:
            broken.append(bad)
            continue
        price = model.price(val)
        if start_s is None or price < start_s:
            start_val, start_s, start_index = val, price, i
    if start_val is None and broken:
        log.warning("the start point breaks %d rows of the placement ILP; solving without it", broken[0])
    if schedule is None:
        got = solve_model(m, OBJECTIVE_UNIT_S, time_limit_s, start_val, pricing=pricing, rel_gap=rel_gap)
    else:
        got = schedule.solve(m, OBJECTIVE_UNIT_S, time_limit_s, start_val, pricing=pricing, rel_gap=rel_gap,
                             ahead=model.lp_ahead if pricing else None)
    solve_s = time.perf_counter() - t1
    nv, nr = len(m.cost), len(m.row_lb)
    stats = {"pricing_rounds": got.pricing_rounds, "priced_in": got.priced_in, "columns_solved": got.columns,
             "optional": int(sum(m.optional)), "integral_lp": int(got.integral_lp)}
    if got.solution is None:
        return IlpResult(got.status, math.inf, math.inf, {}, nv, nr, build_s, solve_s, min_mem,
                         bound_s=_bound_s(got.bound), start_s=start_s, stats=stats, start_index=start_index,
                         bound_any_budget_s=_bound_s(got.bound_any_budget))
    objective = got.objective * OBJECTIVE_UNIT_S
    main = _point(model, got.solution, objective)
    choice, mem_at = main.choice, main.memory_bytes
    # Only the schedule objective's solve finds other points (``solver.solve_by_lp_bound``).
    others = [_point(model, sol, schedule.value(sol)) for sol in got.alternatives]
    bound = min(_bound_s(got.bound), objective)
    any_budget = min(_bound_s(got.bound_any_budget), bound)
    # The relative gap from the normalised bound (HiGHS says inf while it has no bound).
    gap = 0.0 if got.status == "optimal" or objective <= 0.0 else (objective - bound) / objective
    return IlpResult(got.status, objective, gap, choice, nv, nr, build_s, solve_s, min_mem, bound_s=bound,
                     start_s=start_s, stats=stats,
                     ac=main.ac, memory_bytes=mem_at, start_index=start_index,
                     bound_any_budget_s=bound if mem_terms is None else any_budget,
                     alternatives=sorted(others, key=lambda p: p.objective_s))


def _point(model: IlpModel, sol: np.ndarray, objective_s: float) -> IlpPoint:
    """The plan at the solver's (complete, integral) point ``sol``, whose objective is ``objective_s``."""
    choice = {r: int(np.argmax([sol[vs].sum() for vs in x])) for r, x in model.xs.items()}
    memory = (sum(b * float(sol[v]) for v, b in model.mem_terms.items())
              if model.mem_terms is not None else None)
    ac = model.checkpointing.choice(sol) if model.checkpointing is not None else None
    return IlpPoint(choice, ac, objective_s, memory)


def _bound_s(dual_bound: float) -> float:
    """The solver's lower bound in seconds; 0 (every cost is non-negative) before it has one."""
    return max(0.0, dual_bound * OBJECTIVE_UNIT_S) if math.isfinite(dual_bound) else 0.0


def _start_vector(m: Model, deciding: dict[fx.Node, list[int]], start: dict[fx.Node, int], one: int,
                  checkpointing: CheckpointingModel | None, start_ac: ACChoice | None) -> np.ndarray:
    """``start`` as a complete point of the model: the one-hot x of every deciding
    representative (a follower's x are its producer's), each edge variable 1 where both its ends
    are chosen, each move variable t at the largest of its rows. (Given only the x, HiGHS
    completes a point by a sub-MIP, which on llama3-8b can take the whole time limit.)"""
    val = np.zeros(len(m.cost))
    val[one] = 1.0
    for r, vs in deciding.items():
        if r in start:
            val[vs[start[r]]] = 1.0
    if checkpointing is not None:  # its counts first: the schedule's block rows read them
        checkpointing.complete(val, start_ac)
    return complete(m, val)


def _add_edge(m: _Model, supply: dict[Placements, list[int]], demand: dict[Placements, list[int]],
              times: np.ndarray, shares: np.ndarray | None = None) -> _Paid:
    """Transportation rows for one edge: e[p,q] >= 0 for every finite (p, q),
    sum_q e[p,q] = y[p] and sum_p e[p,q] = z[q]. Returns the paid moves (p != q, time > 0);
    ``_charge_moves`` puts their cost in the objective."""
    srcs, dsts = list(supply), list(demand)
    finite = np.isfinite(times)
    cols = np.full(times.shape, -1, dtype=np.int64)
    n = int(finite.sum())
    cols[finite] = m.vars(n) + np.arange(n)
    ii, jj = np.nonzero(finite)
    ends_of_src, ends_of_dst = [supply[p] for p in srcs], [demand[q] for q in dsts]
    m.ends.update(zip(cols[ii, jj].tolist(), zip([ends_of_src[i] for i in ii.tolist()],
                                                 [ends_of_dst[j] for j in jj.tolist()], strict=True),
                      strict=True))
    for col in cols[finite & ~_core_pairs(times)].tolist():
        m.optional[col] = True
    for j, q in enumerate(dsts):
        row = dict.fromkeys(demand[q], -1.0)
        row.update(dict.fromkeys(cols[finite[:, j], j].tolist(), 1.0))
        m.row(0.0, 0.0, row)
    for i, p in enumerate(srcs):
        row = dict.fromkeys(supply[p], -1.0)
        row.update(dict.fromkeys(cols[i, finite[i]].tolist(), 1.0))
        m.row(0.0, 0.0, row)
    pi, qj = np.nonzero(finite & (times > 0.0))
    return _Paid(cols[pi, qj].tolist(), [id(dsts[j]) for j in qj.tolist()], times[pi, qj].tolist(),
                 list(shares[pi, qj]) if shares is not None else None)


def _add_network(m: _Model, supply: dict[Placements, list[int]], demand: dict[Placements, list[int]],
                 net: MoveNetwork) -> _Paid:
    """Flow rows for one edge over its moves' hops (``PlannerCosts.move_network``): an arc
    variable in [0, 1] each, and per node, flow out - flow in = y[p] - z[q] for the placements
    there. At integral x one unit flows from the producer's placement to the consumer's, and
    the cheapest flow is that move's path, so the LP part is exact as the transport rows are,
    with an arc per hop instead of a column per (p, q) pair. Returns the arcs that cost time as
    the paid moves, each destined for its hop."""
    srcs, dsts = list(supply), list(demand)
    first = m.vars(len(net.arcs))
    rows: list[dict[int, float]] = [{} for _ in range(net.nodes)]
    for k, (a, b) in enumerate(net.arcs):
        rows[a][first + k] = 1.0
        rows[b][first + k] = -1.0
    for ends, nodes, sign in ((supply, net.src_node, -1.0), (demand, net.dst_node, 1.0)):
        for p, node in zip(ends, nodes, strict=True):
            for x in ends[p]:
                rows[node][x] = rows[node].get(x, 0.0) + sign
    for row in rows:
        if row:
            m.row(0.0, 0.0, row)
    m.flows.append(Flow(first, len(net.arcs), net.paths, [supply[p] for p in srcs],
                        [demand[q] for q in dsts]))
    paid = np.flatnonzero(net.seconds > 0.0)
    return _Paid((first + paid).tolist(), [net.labels[k] for k in paid.tolist()], net.seconds[paid].tolist())


def _join_parameter_views(traced: Traced, out_keys: dict[fx.Node, list[tuple[fx.Node, fx.Node, int]]],
                          moves: dict[tuple[fx.Node, fx.Node, int], _Paid],
                          demands: dict[tuple[fx.Node, fx.Node, int], dict[Placements, list[int]]]) -> None:
    """A 2-D parameter's transposes (its forward reads ``t(w)``, its backward ``t(t(w))``) move
    the same bytes, so their edges join the parameter's own, each destination mapped to the
    placement of the parameter it amounts to: the group then pays one gather for every view read
    in one placement, as FSDP2 gathers a parameter once however it is read (the step schedule's
    ``_move_key``). Under the schedule objective only, which charges a parameter's groups by phase
    (``ScheduleObjective.split``)."""
    params = {traced.node(p) for p in traced.params.values()}
    mapped: set[tuple[fx.Node, fx.Node, int]] = set()  # keys are the representatives': one per copy
    for u in list(out_keys):
        base = u
        while is_transpose_2d(base):
            base = base.args[0]
        if base is u or base not in params:
            continue
        for k in out_keys.pop(u):
            if k in moves and k not in mapped:
                mapped.add(k)
                placed = {id(q): q for q in demands[k]}
                moves[k] = replace(moves[k], dests=[id(intern(view_base_placements(u, placed[d])))
                                                    for d in moves[k].dests])
            out_keys[base].append(k)


def _core_pairs(times: np.ndarray) -> np.ndarray:
    """The (p, q) pairs of an edge the first LP keeps: every free move, and the CORE_PER_LINE
    cheapest moves out of each source and into each destination. The rest are optional:
    priced back in where their reduced cost says they could lower the objective."""
    keep = times <= 0.0
    k = min(CORE_PER_LINE, times.shape[1])
    rows = np.argsort(times, axis=1, kind="stable")[:, :k]
    keep[np.arange(times.shape[0])[:, None], rows] = True
    k = min(CORE_PER_LINE, times.shape[0])
    cols = np.argsort(times, axis=0, kind="stable")[:k, :]
    keep[cols, np.arange(times.shape[1])[None, :]] = True
    return keep


def _charge_moves(m: _Model, edges: list[_Paid], copies: int, keys: list, kept: bool = False) -> None:
    """One producer's moves, each placement it is moved to paid once however many of its edges
    (``keys``) need it there: with one edge the cost sits on e; with several, on t[q] (see
    module doc). Where the schedule objective charges parts of a move apart (``_Paid.shares``),
    one t[q] per part: at integral x the edges move from one p, so the parts' largest rows add
    up to that move's time."""
    if not edges:
        return
    share_of = {e: sh for paid in edges if paid.shares is not None
                for e, sh in zip(paid.cols, paid.shares, strict=True)}
    if len(edges) == 1:
        for e, c in zip(edges[0].cols, edges[0].seconds, strict=True):
            m.charge(e, copies * c, keys, share_of.get(e), kept)
        return
    by_q: dict[int, dict[int, dict[int, float]]] = defaultdict(dict)  # q -> edge -> {e: seconds}
    for k, paid in enumerate(edges):
        for q, e, c in zip(paid.dests, paid.cols, paid.seconds, strict=True):
            by_q[q].setdefault(k, {})[e] = c
    for per_edge in by_q.values():
        if len(per_edge) == 1:  # one edge needs q: it pays
            k, terms = next(iter(per_edge.items()))
            for e, c in terms.items():
                m.charge(e, copies * c, [keys[k]], share_of.get(e), kept)
            continue
        tagged = [keys[k] for k in per_edge]
        if not share_of:
            _pay_once(m, copies, tagged, list(per_edge.values()), None, kept)
            continue
        for part, alone in enumerate(np.eye(len(next(iter(share_of.values()))))):
            rows = [{e: c * share_of[e][part] for e, c in terms.items() if share_of[e][part] > 0.0}
                    for terms in per_edge.values()]
            if any(rows):
                _pay_once(m, copies, tagged, rows, alone, kept)


def _pay_once(m: _Model, copies: int, keys: list, rows: list[dict[int, float]],
              shares: np.ndarray | None, kept: bool = False) -> None:
    """The largest of ``rows`` (each a sum of seconds) in the objective once: the first row's
    terms themselves, and a variable d >= each other row less the first (microseconds, so that
    the rows' coefficients are not down at HiGHS's tolerances), so that first + d is the largest.
    The same LP as a variable t >= each row, with one row fewer per group (llama3-8b, 2 layers
    over 8x8: 29,008 -> 21,116 rows, the interior-point LP 4.5 -> 3.9 s)."""
    rows = [terms for terms in rows if terms]
    if not rows:
        return
    first = rows[0]
    for e, c in first.items():
        m.charge(e, copies * c, keys, shares, kept)
    if len(rows) == 1:
        return
    d = m.var(0.0, ub=math.inf, integer=False)
    m.charge(d, copies * OBJECTIVE_UNIT_S, keys, shares, kept)
    diffs = []
    for terms in rows[1:]:
        row = {e: c / OBJECTIVE_UNIT_S for e, c in terms.items()}
        for e, c in first.items():
            row[e] = row.get(e, 0.0) - c / OBJECTIVE_UNIT_S
        diffs.append(row)
    m.at_least(d, diffs)


def _memory_terms(traced: Traced, ns: dict[fx.Node, NodeStrategies], xs: dict[fx.Node, list[list[int]]],
                  clus: Clustering, costs: PlannerCosts, memory: MemoryModel) -> tuple[dict[int, float], int]:
    """Memory-row coefficients, and the smallest value the row can take (the fully-sharded floor)."""
    held: dict[tuple[fx.Node, float], list[fx.Node]] = defaultdict(list)  # copies of one value
    for n in traced.gm.graph.nodes:
        per_byte = memory.bytes_per_byte(traced, n)
        if per_byte:
            held[(clus.rep[n], per_byte)].append(n)
    terms: dict[int, float] = defaultdict(float)
    floor = 0
    for (_, per_byte), nodes in held.items():
        supply = _supply(ns, xs, clus, nodes[0])
        sizes = {p: local_bytes(nodes[0].meta["val"], p, costs.mesh_shape) * per_byte * len(nodes)
                 for p in supply}
        for p, vs in supply.items():
            for v in vs:
                terms[v] += sizes[p]
        floor += min(sizes.values())
    return dict(terms), int(floor)


def _saved_moves(traced: Traced, clus: Clustering, costs: PlannerCosts, m: _Model,
                 demands: dict[tuple[fx.Node, fx.Node, int], dict[Placements, list[int]]],
                 supply: Callable[[fx.Node], dict[Placements, list[int]]], one: int,
                 checkpointing: CheckpointingModel | None) -> dict[int, float]:
    """Memory-row terms of the activations kept moved: a forward value moved to q for a forward
    reader serves a backward reader that needs it in q too (the lowering moves a value once per
    placement), so that copy lives until the backward, as the step schedule counts it (on 70B
    over 8x8, the gathered inputs of the tensor-parallel matmuls: 20 GiB the row did not hold).
    Per producer u and placement q, with F(q) / B(q) the x that make one of u's forward /
    backward readers need q and y(q) those that make u yield q:

        a >= sum F_k(q) per forward edge k,   b >= sum B_k(q) per backward edge k,
        s >= a + b - 1 - y(q)                 (0 <= a, b, s <= 1; s is 1 iff the copy is kept)

    The row only bounds them from above, so at integral x the least values are exact. A layer's
    copy is kept in the layers whose checkpointing does not recompute u: with those policies'
    counts n (``checkpointing.py``), k >= n + L s - L counts them (exact at integral s)."""
    by_producer: dict[fx.Node, list[tuple[fx.Node, dict[Placements, list[int]]]]] = defaultdict(list)
    for (u, v, j), demand in demands.items():
        if j >= 0:
            by_producer[u].append((v, demand))
    copies = clus.copies()
    terms: dict[int, float] = {}
    for u, readers in by_producer.items():
        val = u.meta.get("val")
        if (u.op != "call_function" or traced.phase(u) is not Phase.FORWARD
                or alias_root(u).op == "placeholder" or not isinstance(val, torch.Tensor)):
            continue  # parameters' moves are gathered parameters, not saved activations
        fwd = [d for v, d in readers if traced.phase(v) is Phase.FORWARD]
        bwd = [d for v, d in readers if traced.phase(v) is Phase.BACKWARD]
        kept = checkpointing.kept_moved(u) if checkpointing is not None else None
        if not fwd or not bwd or (kept is not None and not kept[0]):
            continue
        made = supply(u)
        in_bwd = {q for d in bwd for q in d}
        # In the forward readers' order (a set's order follows the placements' hashes, which
        # differ from run to run, and so did the rows', and the interior point's path with them).
        for q in dict.fromkeys(q for d in fwd for q in d if q in in_bwd):
            s = m.var(0.0, integer=False)
            terms_s: dict[int, float] = {one: -1.0}
            for side in (fwd, bwd):
                needs = [d[q] for d in side if q in d]
                if len(needs) > 1:  # several readers on this side: whether any needs q
                    a = m.var(0.0, integer=False)
                    m.at_least(a, [_sum_of(cols) for cols in needs])
                    needs = [[a]]
                add_terms(terms_s, _sum_of(needs[0]))
            add_terms(terms_s, _sum_of(made.get(q, []), -1.0))
            m.at_least(s, [terms_s])
            size = float(local_bytes(val, q, costs.mesh_shape))
            if kept is None:  # every copy keeps it
                add_terms(terms, {s: copies[u] * size})
            else:
                counts, layers = kept
                k = m.var(0.0, ub=float(layers), integer=False)
                m.at_least(k, [{**dict.fromkeys(counts, 1.0), s: float(layers), one: -float(layers)}])
                add_terms(terms, {k: size})
    return terms


def _sum_of(cols: list[int], sign: float = 1.0) -> dict[int, float]:
    terms: dict[int, float] = {}
    for c in cols:
        terms[c] = terms.get(c, 0.0) + sign
    return terms


def chosen_strategy(ns: dict[fx.Node, NodeStrategies], clus: Clustering, choice: dict[fx.Node, int],
                    node: fx.Node) -> Strategy:
    """The strategy ``node`` runs (its representative's), resolving getitem aliases."""
    r = clus.rep[node]
    st = ns[r]
    if st.alias_of is not None:
        parent, idx = st.alias_of
        ps = chosen_strategy(ns, clus, choice, parent)
        return Strategy((ps.output[idx],), ())
    return st.strategies[choice[r]]
