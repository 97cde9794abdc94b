r"""The placement ILP's objective as the step schedule prices a plan, linearised.

The serial objective (``ilp.py``) adds every kernel and every collective. The step schedule
(``cost/schedule.py``, what ``shardwise estimate`` reports) overlaps them: compute runs on one
stream, FSDP parameter all_gathers are prefetched a block ahead, gradient reductions run under
the rest of the backward, and only collectives whose consumer waits (activation
redistributions, tensor-parallel collectives) add to the critical path. This module prices a
plan the same way, block by block.

Blocks. The schedule runs blocks in order: the forward of the head (before the first decoder
layer), of each layer, of the tail, then the backward of the tail, of each layer from the last,
of the head; a cluster of identical layers (``plan/cluster.py``) is one block whose terms count
every copy. Each cost term of the ILP goes to a block and a load:

- a kernel of node n: COMPUTE in n's block (an attention kernel, forward and backward, priced
  by ``cost/schedule.attention_factor``: the spec's attention efficiency, and causal, half its
  FLOP count; a node activation checkpointing recomputes, once more in its layer's backward);
- a parameter's move (FSDP gather): HIDDEN in the block before its readers' (prefetched one
  block ahead, as FSDP2 does), once per phase (FSDP2 reshards after the forward and gathers
  again in the backward; the serial sum pays a value's move to a placement once); the first
  block's, EXPOSED (nothing runs before it). A gather through both mesh dims is a chain: a
  later collective of it on the innermost (tensor-parallel) dim, EXPOSED in the block before
  (``PlannerCosts.move_shares``): it queues on that dim's stream when the first ends, ahead of
  the block's own tensor-parallel collectives, which its kernels wait for. (On llama3-8b, 32
  layers over 8x8, the ILP's plan gathered wo over dp then tp, HIDDEN all: 0.3688 s a step by
  the schedule, which stalled each layer's forward 2.2 ms behind the next layer's gathers,
  against 0.3214 s for the plan chosen since. A later collective on the outer dim stays
  HIDDEN: FSDP over both dims gathers over tp first, and the gathers of a block pipeline over
  the two streams, each busy with its own collectives, so a chain is HIDDEN at its larger
  stream's part, not at the sum (``move_shares``; llama-tiny, 2 layers over 2x2, fsdp:
  objective / schedule 1.218 -> 1.040, the auto plan 0.7711 -> 0.7682 ms by the schedule).
  The first block's chains are EXPOSED at the sum: its readers wait for each one whole (priced
  at the larger part, GPT-2's auto plan gathered its tied embedding over both dims there,
  23.37 -> 23.70 ms). A block's chains pipeline but for one chain's fill, its smaller part,
  which the block waits for once: unpriced, so a block whose one large chain outlasts the
  block before's compute is priced short (Bloom-560m over 2x4, its tied 250k-word head gathered
  over both dims: 205.87 -> 206.29 ms by the schedule). A variable per block at the largest fill
  of its chains (a row per chain column) priced it (205.87 ms again), but the rows made the
  solves slower (GPT-2 over 2x4 10 -> 22 s, Gemma over 2x4 19 -> 47 s and stopped at its
  limit): not kept. A gradient's reduction through both dims is priced so too (its larger
  stream's part: the schedule runs one's tp collective beside the next one's dp collective)
  where it is made in a decoder layer's backward on a 2-D (or more) mesh inside one node
  (``pipelined_reduction``). FSDP over a 2x2 mesh was priced at 1.25x its step before
  (StableLM's defaults at 256 wide, 2 layers, batch 4 x 256: 0.982 against 0.786 ms; 1.016
  since), so the hand plan beat the ILP's by the schedule; of eleven configs from transformers'
  defaults at 256 wide, 2 layers over 2x2 (``--time-limit 20``), the auto plans since run as
  fast or up to 7% faster (Phi 0.997 -> 0.925 ms), three solve in half the time (Falcon 23.7 ->
  12.0 s, MPT 30.7 -> 9.0 s, StableLM 31.8 -> 15.7 s) and the others within 20% of theirs. Not
  across nodes: on llama3-8b over 8x8 the ILP then chose plans the schedule runs slower (2
  layers 48.1 -> 56.7 ms, 32 layers 355.0 -> 417.7 ms; with the output weight's reduction priced
  so too, 2 layers 62.8 ms: its tp reduce_scatter ran in the tail's backward ahead of the tail's
  exposed tp collectives), and with a row more per block for the reductions' tp parts (they
  queue with its exposed collectives) no better. Inside one node the two streams' collectives
  cross the same NVLinks, which the schedule does not model; a real run may be nearer the sum
  there, for large messages (unmeasured: no GPU lent).)
  A parameter and its transposes are one producer
  (``ilp.py``: the backward reads a weight as t(t(w)), the forward as t(w)). Not so for the
  blocks FSDP2 keeps gathered from the forward to the backward, as the schedule does: the last
  layer and the root pay a placement once over both phases, their backward only for one the
  forward did not gather;
- a gradient reduction: HIDDEN in its gradient's block, in fp32 under torchtitan's mixed
  precision (``reduce_fp32``: the time scaled by the byte ratio); the last block's (the head's:
  the embedding's) EXPOSED, after the backward's last kernel; the tail's (the output weight's,
  made by the tail's last kernels) HIDDEN in the next block, the last layer's backward, under
  which the schedule runs it;
- any other move: EXPOSED in the block of its first reader that needs the placement (the
  reader waits for it; later readers, a backward one too, reuse the copy: ``ilp.py`` lists a
  producer's edges in graph order);
- the optimizer step (gradient clipping and fused Adam): ``cost/schedule.optimizer_bytes`` per
  local parameter element through memory, linear in the parameters' placements, plus one
  launch: serial, after the backward.

The objective is ``optimizer + sum_b T[b]`` with

    T[b] = max(compute[b] + exposed[b],      the compute stream and what it waits for,
               hidden[b] + exposed[b])       the communication stream: the exposed
                                             collectives queue behind the hidden ones.

The rows are exact: the exposed terms go in the cost, and each block has a variable w[b]
(microseconds) in the cost with w[b] >= compute[b] and w[b] >= hidden[b] + exposed[b] -
exposed[b], so that at the optimum T[b] = exposed[b] + w[b]. Its LP relaxation is tight (on
llama3-8b over 8x8 within 0.2-0.7% of the optimum; the compute-bound relaxation was 12-30% off),
but the max rows make it slow by simplex (~30 s, 10x the serial model's), so ``solve`` takes
it by interior point and finishes from there (``solver.solve_by_lp_bound``: rounding, a
neighbourhood MIP, reduced-cost fixing, the MIP over what is left). The objective reported is
the maximum form above at the chosen point (``value``, the model's cost there).

The drain (``_drain_rows``): the head's backward, the last block, issues its gradient reductions
after its kernels, behind whatever the last layer's backward still has queued; that layer makes
some gradients late (its attention's, its first norm's), so their reductions run past its
kernels. One more variable d in the cost, with a row per gradient g of the last layer's own
copy: d >= the compute stream's time to g, plus the reductions from g on, plus the head's,
less what the two blocks' T already charge. (On llama-tiny, 2 layers, over 4 ranks the ILP's
plan without it was priced at 0.986 of the schedule, which ran the head's block 17 us longer
than its kernels and reduction; with it, 0.996, and the ILP picks a plan 1.4% faster by the
schedule.)

Not modelled (the schedule's estimate of the chosen plan is reported beside the objective, and
the planner chooses by that estimate among the ILP's solution, the other plans its solve found
and the hand plans): dependency stalls inside a block (but the drain above), a queue carried
from one block to the next, one stream per mesh dim (one for all here), ``--compile``'s fused
kernels and ``--async-tp``'s fused collectives (priced eager and exposed), and the collectives
recomputation repeats. What they amount to, block by block (``benchmarks/objective_terms.py
--blocks``; llama3-8b, 2 layers, 8x8, b16 x 8192, fsdp_tp_sp: objective 155.6 ms, schedule
148.3 ms):

- the schedule starts a block at its first parameter's arrival, the objective once all its
  prefetched gathers have arrived (the head's block: 30.1 ms against 23.3 ms);
- collectives on different mesh dims run at once on their streams, the objective adds them (the
  tail's backward: an all_to_all over dp and an all_gather over tp of the logits' gradient,
  10.9 and 10.6 ms side by side: 33.1 ms against about 23 ms); the same made FSDP over both
  dims of a 2x2 mesh 23% dearer by the objective before its gathers were priced per stream;
- a queue carried over: the backward's gather of the output weight (21.8 ms, queued behind the
  forward's) delays the backward's first kernel by 23 ms after the forward's last; the
  objective charges it in the forward tail's block, where it is about as long.

The tail's reductions went to the tail's own block until the auto plan of that case
(objective 48.2 ms, schedule 53.7 ms) showed where most of its 5.5 ms went: the output
weight's gradient is made by the tail's last kernel, so its reduce_scatter (5.5 ms on dp) runs
under the last layer's backward, where that layer's gathers and an exposed all_reduce queue
behind it. Charged there, the optimum's objective is 54.01 ms against the schedule's 53.96
(1.001; 2 layers), 351.5 against 361.7 (0.972; 32 layers: 0.956 before). (Charging every
reduction to the kernels after its gradient, the rest of its block and then the next, brought
that plan to 0.95 but DDP on a 1-D mesh from 1.02 to 1.07: not done.)

The figures above predate two fixes. The schedule's last layer gathered its tensor-parallel
weights over dp again for the backward (it undid one of the two transposes the backward reads
them through); the objective charged the root's output weight twice (its t(w) and t(t(w))
were two producers) and the last layer's backward nothing (a plan reading another placement
there had those gathers free: on llama3-70b, 8 layers, the ILP's plan did, 2 x 9.8 ms). Since
then, by ``benchmarks/objective_terms.py``: 2 layers, the auto plan 54.01 against 52.62 ms
(1.026), fsdp_tp 138.2 against 126.7 (1.091), fsdp_tp_sp 138.7 against 125.3 (1.107);
llama3-70b 8 layers over 8x8 at seq 4096, the auto plan 209.8 against 225.3 ms (0.931; the
plan before, 247.1 by the schedule), fsdp_tp 0.975, fsdp_tp_sp 0.995.

Since moves go one mesh dim at a time where that is cheaper (``cost/reshard.reshard_path``: a
gradient partial over both dims is reduce-scattered over tp first), the two dims' collectives
overlap more in the schedule, which the one stream here does not see: 2 layers, the auto plan
53.68 against 48.11 ms (1.116), fsdp_tp 1.013, fsdp_tp_sp 1.020; Qwen2-7B, 4 layers over 8x8
at seq 4096, the auto plan 336.0 against 359.6 ms (0.935; it was 338.6 against 447.8, 0.756,
while its tp collectives waited behind whole dp all_reduces). With a gather's later collective
on the inner dim exposed (above): 2 layers, the auto plan 53.68 against 47.92 ms (1.120),
fsdp_tp 1.054, fsdp_tp_sp 1.041; 32 layers, 350.9 against 321.4 ms (1.092). One stream per
mesh dim instead (rows w[b] >= a dim's hidden and exposed terms less all exposed ones) was
tried again and not kept: it prices too little, the schedule's stalls behind chains unseen
(2 layers: 47.33 against a 51.05 ms plan; 32 layers: 262.3 against a 350.5 ms plan). Nor
one stream per mesh dim for the hidden terms alone (w[b] >= each dim's hidden terms, the
exposed ones behind the busiest; stop 42, ``benchmarks/objective_terms.py``, 2 layers): the
auto plan's objective came within 1% of its schedule (51.24 against 51.69 ms), but the plan
itself got 8% slower (47.84 -> 51.69 ms), and the hand plans' free choices too (fsdp_tp 55.83
-> 61.60 ms, fsdp_tp_sp 55.02 -> 60.47 ms).

Since the tensor-parallel hand plans gather a column-parallel weight's tp shard over dp
(``baselines._fsdp_of_tp_shard``), both errors show on llama3-70b, 8 layers over 8x8 at seq 4096
(``benchmarks/objective_terms.py``): fsdp_tp 219.6 against 193.8 ms (1.133), fsdp_tp_sp 1.064,
and the auto plan 196.9 against 230.7 ms (0.853), so the ILP prefers a plan 19% slower than
fsdp_tp (the planner then returns fsdp_tp, the cheaper by the schedule). fsdp_tp's layers are
priced too high: their exposed collectives are on tp and its gathers on dp, two streams side by
side (forward 6.31 against 5.60 ms a layer: the schedule's max(compute + exposed, dp gathers)).
The auto plan's are priced too low: it moves activations over dp (an all_gather and an
all_to_all, 4.4 ms a layer, exposed), which queue behind the next layer's prefetched dp gathers
(2.2 ms), and the compute waits for them (10.78 against 8.73 ms a layer). A row per stream
and a stall row for a stream carrying both kinds would price both; the stall depends on
whether a block's exposed moves use that stream, a product of choices, which is why it is not
here yet. 8B, 2 layers: fsdp_tp 0.946, fsdp_tp_sp 1.037, auto 1.120. In the forward that stall
was the schedule's, not FSDP2's: FSDP2 prefetches the forward implicitly (the CPU issues the next
layer's gathers at its pre-forward, after this layer's collectives), and the schedule now queues
them so (``cost/schedule.py``); the auto plan's forward layers 87.8 -> 76.9 ms in all against an
objective of 69.8, its step 230.1 -> 220.7 ms (0.892), the hand plans' unchanged. The backward
prefetches explicitly, ahead of the layer's own collectives, and the stall stays there.

Exact where a plan has one stream's worth of communication: on one device the objective is
the schedule's step (tests/plan/test_objective.py); on 1-D meshes the auto plan is within 1%
of it and DDP within 3%; on 2x2 every hand plan within 10% (``ENVELOPE`` there).
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from torch import fx

from shardwise.cost.schedule import (
    FP32_BYTES,
    StepOptions,
    attention_factor,
    optimizer_bytes,
)
from shardwise.ir.flops import is_view
from shardwise.ir.trace import Phase, Traced
from shardwise.passes.remat import ACPolicy, recompute_plan
from shardwise.plan.cluster import HEAD, TAIL, Clustering, keeps_gathered, regions
from shardwise.plan.costs import PlannerCosts, local_bytes
from shardwise.plan.solver import MIP_REL_GAP, LpRun, Solved, complete, solve_by_lp_bound, solve_model
from shardwise.plan.strategies import NodeStrategies

# The ILP's edge argument indices of the sinks (``ilp.GRAD_SINK``, ``ilp.LOSS_SINK``; not
# imported: ilp.py imports nothing of this module and this module nothing of it).
GRAD_SINK = -1
LOSS_SINK = -2

log = logging.getLogger(__name__)
# Recomputation also costs this fraction of its time outside the max rows. The rows price it free
# in a backward block whose communication outlasts its compute, so the ILP checkpointed layers
# for nothing (llama3-8b, 32 layers over 8x8, memory to spare: none x 16, selective x 14, full x 2,
# 0.4082 s a step by the schedule against 0.3688 s without, which ``planner._lighten_ac`` then
# had to find). A tie-break, not a price: the step schedule prices the plan.
RECOMPUTE_TIE = 0.05

Block = tuple[Phase, int]  # (phase, region): a layer index, HEAD or TAIL
EdgeKey = tuple[fx.Node, fx.Node, int]  # (producer, consumer, argument) on representatives


class Load:
    """What a cost term occupies in its block."""

    COMPUTE = "compute"  # the compute stream
    EXPOSED = "exposed"  # a collective the compute stream waits for
    HIDDEN = "hidden"  # a collective under compute (prefetched gathers, gradient reductions)


@dataclass(frozen=True)
class _Terms:
    """A sum of seconds per column, as arrays."""

    cols: np.ndarray
    seconds: np.ndarray

    @staticmethod
    def of(*sums: dict[int, float]) -> _Terms:
        merged: dict[int, float] = defaultdict(float)
        for terms in sums:
            for c, t in terms.items():
                merged[c] += t
        return _Terms(np.fromiter(merged, dtype=np.int64, count=len(merged)),
                      np.fromiter(merged.values(), dtype=np.float64, count=len(merged)))

    def at(self, val: np.ndarray) -> float:
        return float(self.seconds @ val[self.cols])


@dataclass(frozen=True)
class _ValueTerms:
    """What ``ScheduleObjective.value`` reads: the serial terms, each block's (compute +
    exposed, hidden + exposed), the drain's rows and its blocks' (compute, hidden)."""

    serial: _Terms
    blocks: list[tuple[_Terms, _Terms]]
    drain_rows: list[_Terms]
    drain_blocks: list[tuple[_Terms, _Terms]]


@dataclass
class ScheduleObjective:
    """Collects the ILP's cost terms by block and load (``charge``), then writes the rows of the
    objective above (``finish``). ``options``: how the step runs (``cost/step.torchtitan_options``)."""

    traced: Traced
    clus: Clustering
    costs: PlannerCosts
    options: StepOptions
    terms: dict[Block, dict[str, dict[int, float]]] = field(default_factory=dict)
    serial: dict[int, float] = field(default_factory=lambda: defaultdict(float))
    # The block before the last (``_drain_rows``): its own kernels and gradient reductions
    # (seconds; of a cluster's block, its copy's), each at its node's position in the graph.
    drain_compute: list[tuple[int, int, float]] = field(default_factory=list)
    drain_reductions: list[tuple[int, int, float]] = field(default_factory=list)
    _priced: _ValueTerms | None = field(default=None, init=False, repr=False)  # ``value``'s arrays

    def __post_init__(self) -> None:
        gm = self.traced.gm
        self.region = regions(self.traced) or {n: HEAD for n in gm.graph.nodes}
        self.param_nodes = {self.traced.node(ph) for ph in self.traced.params.values()}
        self._param_of: dict[fx.Node, bool] = {}  # ``_is_param``'s answers (asked ~30k times)
        layers = [r for r in self.region.values() if 0 <= r < TAIL]
        self.last_layer = max(layers) if layers else None
        train = self.traced.train and self.options.ac is not ACPolicy.NONE
        self.recompute = set(recompute_plan(gm, self.options.ac).recompute) if train else set()
        # Blocks in the order the schedule runs them (forward: head, layers, tail; backward:
        # tail, layers from the last, head); a cluster's copies are one block, its first copy's.
        self.canon: dict[Block, Block] = {}
        self.members: dict[Block, list[Block]] = {}
        for copies in self.clus.clusters:
            blocks = list(dict.fromkeys(self._block(c[0]) for c in copies))
            for b in blocks:
                self.canon[b] = blocks[0]
            self.members[blocks[0]] = blocks
        order = sorted({self._block(n) for n in gm.graph.nodes if n.op == "call_function"},
                       key=lambda b: (b[0] is Phase.BACKWARD, b[1] if b[0] is Phase.FORWARD else -b[1]))
        self.pred = dict(zip(order[1:], order[:-1], strict=True))
        self.succ = dict(zip(order[:-1], order[1:], strict=True))
        self.last = order[-1] if order else None
        self.before_last = self.pred.get(self.last)
        self.position = {n: i for i, n in enumerate(gm.graph.nodes)}
        self.n_copies = self.clus.copies()
        # Each representative's own node in the layer (forward and backward) of the block
        # before the last.
        self.in_before_last = {} if self.before_last is None else {
            self.clus.rep.get(n, n): n for n in gm.graph.nodes
            if n.op == "call_function" and self._block(n)[1] == self.before_last[1]}

    # ---- where a term goes -----------------------------------------------------------------
    def _block(self, node: fx.Node) -> Block:
        phase = self.traced.phase(node)
        return (phase, self.region.get(node, HEAD if phase is Phase.FORWARD else TAIL))

    def _add(self, block: Block, load: str, col: int, seconds: float) -> None:
        row = self.terms.setdefault(self.canon.get(block, block), {}).setdefault(load, defaultdict(float))
        row[col] += seconds

    def _copies(self, block: Block) -> list[Block]:
        """The blocks a (representative's) block stands for."""
        return self.members.get(self.canon.get(block, block), [block])

    def kept(self, u: fx.Node) -> bool:
        """Parameter ``u`` (a graph node, not a representative) stays gathered from the forward
        to the backward, as the schedule keeps it (``cluster.keeps_gathered``: the root's and
        the last layer's). Its moves are charged apart from its cluster's other copies'
        (``ilp.py`` groups producers by it): they share the representatives' edges, the last
        layer's backward too."""
        return self._is_param(u) and keeps_gathered(self.region.get(u, HEAD), self.last_layer)

    def _is_param(self, u: fx.Node) -> bool:
        hit = self._param_of.get(u)
        if hit is None:
            base = u
            while base.op == "call_function" and is_view(base) and base.all_input_nodes:
                base = base.all_input_nodes[0]
            hit = self._param_of[u] = base in self.param_nodes
        return hit

    def charge(self, col: int, seconds: float, tag: fx.Node | Sequence[EdgeKey],
               shares: Sequence[float] | None = None, kept: bool = False) -> None:
        """``seconds`` (every copy's) on column ``col``: a kernel of node ``tag``, or a move of
        the producer whose edges are ``tag``; ``shares``: the move's first collective's share
        of it and its later ones' (``PlannerCosts.move_shares``; None: all in the first);
        ``kept``: the producers are parameters that stay gathered (``kept``)."""
        if seconds == 0.0:
            return
        if isinstance(tag, fx.Node):
            seconds *= attention_factor(tag, self.costs.hw)
            block = self._block(tag)
            self._add(block, Load.COMPUTE, col, seconds)
            self._note_compute(tag, col, seconds)
            if tag in self.recompute:  # run again at the start of its layer's backward
                self._add((Phase.BACKWARD, block[1]), Load.COMPUTE, col, seconds)
                self._note_compute(tag, col, seconds, recomputed=True)
            return
        u, v, j = tag[0]
        if j == GRAD_SINK:
            # Issued as the gradient is computed, under the rest of its block's backward (the
            # block takes at least its reductions: w[b] >= hidden[b]); the last block's, after
            # the backward's last kernel (its predecessor's were charged exposed too, "the
            # head's few kernels cannot hide them"; the schedule runs them under their own
            # block's backward, as it issues them: benchmarks/objective_terms.py); the tail's,
            # made by its last kernels, under the next block.
            val = u.meta["val"]
            if self.options.reduce_fp32 and val.element_size() < FP32_BYTES:
                seconds *= FP32_BYTES / val.element_size()
            if shares is not None:  # a layer's, pipelined over the dims' streams
                seconds *= max(shares)
            block = self._block(u)
            if block == (Phase.BACKWARD, TAIL) and block in self.succ:
                block = self.succ[block]
            copies = self._copies(block)
            for c in copies:
                if c == self.last:
                    self._add(c, Load.EXPOSED, col, seconds / len(copies))
                else:
                    self._add(c, Load.HIDDEN, col, seconds / len(copies))
            own = self.in_before_last.get(u)
            if own is not None and self._block(own) == self.before_last:
                self.drain_reductions.append((self.position[own], col, seconds / self.n_copies.get(u, 1)))
        elif self.prefetched(u, j):
            # Prefetched: gathered while the block before runs (FSDP2's implicit prefetch); the
            # first block's, before anything runs. ``tag`` lists the readers that need the
            # placement: where the parameter stays gathered from the forward to the backward
            # (``split``), its first is a forward reader, or a backward one for a placement
            # only the backward reads (gathered before the backward's block, as the schedule does).
            # A move through several mesh dims is a chain: a later collective of it on the
            # innermost dim queues on that stream when the one before ends, in the middle of the
            # block before the readers', ahead of that block's own collectives, which its kernels
            # wait for (the step schedule's streams run in issue order): exposed there.
            head, queued = (1.0, 0.0) if shares is None else shares
            # The copies of the readers' block these producers stand for: a cluster's copies in
            # the last layer keep their gathers, the others do not (``kept``).
            copies = self._copies(self._block(v))
            copies = [c for c in copies if keeps_gathered(c[1], self.last_layer) == kept] or copies
            for c in copies:
                before = self.pred.get(c)
                at, load = (c, Load.EXPOSED) if before is None else (before, Load.HIDDEN)
                self._add(at, load, col, head * seconds / len(copies))
                if queued > 0.0:
                    self._add(at, Load.EXPOSED, col, queued * seconds / len(copies))
        else:
            self._add(self._block(v if j >= 0 else u), Load.EXPOSED, col, seconds)

    def prefetched(self, u: fx.Node, j: int) -> bool:
        """A move of ``u`` into argument ``j`` of its reader is issued a block ahead (a
        parameter's gather): the only moves ``charge`` splits by ``shares``."""
        return j >= 0 and self._is_param(u)

    def pipelined_reduction(self, u: fx.Node, j: int) -> bool:
        """A reduction of gradient ``u`` (``j`` is GRAD_SINK) made in a decoder layer's backward,
        on a mesh of several dims inside one node: its chain over the dims pipelines with the
        layer's other reductions over the dims' streams (``charge``)."""
        dims = self.costs.topology.dims
        return (j == GRAD_SINK and len(dims) > 1 and all(link.intra_node for link in dims)
                and 0 <= self._block(u)[1] < TAIL)

    def pipelined(self, v: fx.Node) -> bool:
        """A prefetched move for reader ``v`` is issued under the block before ``v``'s, with that
        block's other gathers, not before the first block (``PlannerCosts.move_shares``)."""
        return all(c in self.pred for c in self._copies(self._block(v)))

    def charge_recompute(self, col: int, seconds: float, node: fx.Node) -> None:
        """``seconds`` (every copy's) on column ``col`` for running forward ``node`` again at the
        start of its layer's backward (activation checkpointing decided by the ILP)."""
        if seconds == 0.0:
            return
        seconds *= attention_factor(node, self.costs.hw)
        block = (Phase.BACKWARD, self._block(node)[1])
        self._add(block, Load.COMPUTE, col, seconds)
        self._note_compute(node, col, seconds, recomputed=True)
        self.serial[col] += RECOMPUTE_TIE * seconds

    def _note_compute(self, node: fx.Node, col: int, seconds: float, recomputed: bool = False) -> None:
        """A kernel of representative ``node`` (``seconds``: every copy's): ``drain_compute``
        keeps its own copy's in the block before the last, at its position (recomputed: first,
        at the start of the forward node's layer backward)."""
        own = self.in_before_last.get(node)
        if own is not None and (recomputed or self._block(own) == self.before_last):
            at = -1 if recomputed else self.position[own]
            self.drain_compute.append((at, col, seconds / self.n_copies.get(node, 1)))

    def split(self, keys: Sequence[EdgeKey], kept: bool) -> list[list[EdgeKey]]:
        """One producer's edges (a parameter's: those of its transposes too, ``ilp.py``) into the
        groups that each pay a move to a placement once: a parameter's forward and backward
        readers apart (FSDP2 gathers it again in the backward), except where its gathers stay
        from the forward to the backward (``kept``), whose backward pays only for a placement the
        forward did not gather."""
        u = keys[0][0] if keys else None
        if u is None or not self._is_param(u) or kept:
            return [list(keys)]
        by_phase: dict[Phase, list[EdgeKey]] = defaultdict(list)
        for k in keys:
            by_phase[self.traced.phase(k[1])].append(k)
        return list(by_phase.values())

    # ---- the optimizer ---------------------------------------------------------------------
    def charge_optimizer(self, ns: dict[fx.Node, NodeStrategies], xs: dict[fx.Node, list[list[int]]],
                         one: int) -> None:
        """The optimizer step (clipping, fused Adam): its bytes per local parameter element on
        the x that place each parameter, its launch on the constant column."""
        if not self.traced.train:
            return
        hw = self.costs.hw
        for ph in self.param_nodes:
            r = self.clus.rep[ph]
            st = ns.get(r)
            if st is None or st.alias_of is not None or r not in xs:
                continue
            v = ph.meta["val"]
            for s, cols in zip(st.strategies, xs[r], strict=True):
                elems = local_bytes(v, s.output[0], self.costs.mesh_shape) // v.element_size()
                t = hw.memory_time(elems * optimizer_bytes(self.options, v.element_size()))
                for col in cols:
                    self.serial[col] += t
        self.serial[one] += hw.launch_s

    # ---- the rows ------------------------------------------------------------------------
    def finish(self, m, unit_s: float) -> None:
        """Write the objective into the model ``m`` (``ilp._Model``, seconds per unit of each
        column): the serial and exposed terms in its cost; per block, w[b] in the cost and its
        two rows, w[b] >= compute[b] and w[b] >= hidden[b] (in microseconds, like the move
        variables t, so that the rows' coefficients stay above HiGHS's tolerances); the drain
        d and its rows (``_drain_rows``). w[b] and d are move-like variables of ``m.t_rows``: a
        start point sets each to the largest of its rows."""
        self.unit_s = unit_s
        self._priced = None  # the terms are final from here
        for col, t in self.serial.items():
            m.cost[col] += t
        w_of = {}
        for b, loads in self.terms.items():
            for col, t in loads.get(Load.EXPOSED, {}).items():
                m.cost[col] += t
            w_of[b] = w = m.var(0.0, ub=math.inf, integer=False)
            m.cost[w] += unit_s
            m.at_least(w, [{c: t / unit_s for c, t in loads.get(load, {}).items() if t}
                           for load in (Load.COMPUTE, Load.HIDDEN)])
        rows, blocks = self._drain_rows()
        if not rows:
            return
        # The drain is left out of the interior-point LP (its rows took llama3-8b's 32-layer LP
        # from 39 to 52 iterations, 11.6 to 19.5 s): d >= 0 only adds to the cost, so the LP
        # without it is a relaxation and its bound holds; rounding, the neighbourhood and the
        # MIP price it.
        m.relaxed_from = (len(m.cost), len(m.row_lb))
        d = m.var(0.0, ub=math.inf, integer=False)
        m.cost[d] += unit_s
        m.at_least(d, [{**{c: t / unit_s for c, t in row.items() if t}, **{w_of[b]: -1.0 for b in blocks}}
                       for row in rows])

    def _drain_rows(self) -> tuple[list[dict[int, float]], list[Block]]:
        """The drain of the step's end: the last block (the head's backward) issues its gradient
        reductions after its kernels, and they queue on the communication stream behind the
        reductions of the block before it (the last layer's), issued as its gradients are made.
        Where that layer's last gradients come late, the step ends after its blocks' maxima
        would: for each gradient g of the block before's own copy (of a cluster's copies),

            d >= compute[P] - (its own kernels after g) + (its reductions from g on)
                 + hidden[L] - w[P] - w[L]

        (the compute stream reaches g, then the queue from g on runs, then L's collectives,
        less what T[P] + T[L] already charge; the exposed collectives are left out of both
        sides, which over-counts those of P after g). Returns the rows (seconds per column,
        the w[b] left out) and the blocks whose w[b] each row subtracts."""
        if self.before_last is None or not self.drain_reductions:
            return [], []
        p = self.canon.get(self.before_last, self.before_last)
        base = dict(self.terms.get(p, {}).get(Load.COMPUTE, {}))
        for c, t in self.terms.get(self.last, {}).get(Load.HIDDEN, {}).items():
            base[c] = base.get(c, 0.0) + t
        rows = []
        for at in sorted({pos for pos, _, _ in self.drain_reductions}):
            row = dict(base)
            for pos, c, t in self.drain_compute:
                if pos > at:
                    row[c] -= t
            for pos, c, t in self.drain_reductions:
                if pos >= at:
                    row[c] = row.get(c, 0.0) + t
            rows.append(row)
        return rows, [b for b in (p, self.last) if b in self.terms]

    def _value_terms(self) -> _ValueTerms:
        """The terms ``value`` reads, as arrays, made on its first call: ``value`` prices every
        start point and every plan the solve finds (a Python sum over the terms took 0.15 s of
        the 2-layer plan's solve)."""
        if self._priced is None:
            rows, blocks = self._drain_rows()
            loads = self.terms.values()
            self._priced = _ValueTerms(
                serial=_Terms.of(self.serial),
                # The communication stream carries the exposed collectives too, behind the others.
                blocks=[(_Terms.of(ld.get(Load.COMPUTE, {}), ld.get(Load.EXPOSED, {})),
                         _Terms.of(ld.get(Load.HIDDEN, {}), ld.get(Load.EXPOSED, {}))) for ld in loads],
                drain_rows=[_Terms.of(row) for row in rows],
                drain_blocks=[(_Terms.of(self.terms[b].get(Load.COMPUTE, {})),
                               _Terms.of(self.terms[b].get(Load.HIDDEN, {}))) for b in blocks])
        return self._priced

    def value(self, val: np.ndarray) -> float:
        """The schedule objective (seconds) at the point ``val`` of the model's columns: the
        serial terms, each block's larger of compute + exposed and hidden + exposed, and the
        drain d, the largest of its rows (``_drain_rows``) less its blocks' w[b], at least 0."""
        terms = self._value_terms()
        blocks = sum(max(c.at(val), h.at(val)) for c, h in terms.blocks)
        w = sum(max(c.at(val), h.at(val)) for c, h in terms.drain_blocks)
        drain = max([0.0, *(row.at(val) - w for row in terms.drain_rows)])
        return terms.serial.at(val) + blocks + drain

    def solve(self, m, unit_s: float, time_limit_s: float, start: np.ndarray | None,
              pricing: bool = True, rel_gap: float = MIP_REL_GAP, ahead: LpRun | None = None) -> Solved:
        """Solve the model ``m`` (``finish``ed) from its interior-point LP bound
        (``solver.solve_by_lp_bound``; ``ahead``: that LP already started) to within ``rel_gap``
        of the optimum; ``pricing=False``: HiGHS's MIP on the whole model."""
        if pricing:
            got = solve_by_lp_bound(m, unit_s, time_limit_s, start, rel_gap, ahead)
        else:
            got = solve_model(m, unit_s, time_limit_s, start, pricing=False, rel_gap=rel_gap)
        log.debug("schedule objective: %s, %d of %d columns left to the MIP", got.status, got.columns,
                  len(m.cost))
        return self._exact(m, got)

    def _exact(self, m, got: Solved) -> Solved:
        """``got`` at its plan: the continuous columns without slack (``solver.complete``), the
        objective the maximum form there, 'optimal' only where the bound proves it."""
        if got.solution is None:
            return got
        got.solution, *got.alternatives = [complete(m, np.where(m.integer, np.round(p), p))
                                           for p in (got.solution, *got.alternatives)]
        got.objective = self.value(got.solution) / self.unit_s
        got.bound = min(got.bound, got.objective)
        if got.objective - got.bound > MIP_REL_GAP * got.objective:
            got.status = "feasible"  # the solver's tolerances, not a proof
        return got
