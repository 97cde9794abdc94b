"""The step schedule: a plan's training step laid out on streams, as a GPU would run it.

Input: a traced step, a plan of it (placements per node) and a mesh topology. Output: timed
events on one compute stream and one communication stream per mesh dim (process group), the
step time, the communication that is exposed (not under compute) and hidden, and the peak
memory per device over the schedule.

Compute stream. Nodes run one after another in graph order (eager PyTorch issues them in program
order), each priced by roofline on its local shapes (``plan/costs.py``); an attention kernel
at the spec's ``attention_eff`` and, causal, at half the score-matrix work its FLOP formula
counts (flash attention skips the masked blocks; ``attention_factor``). With ``compile`` the
memory-bound nodes are priced as the kernels the segmentation pass fuses them into
(``passes/segment``, boundary bytes at local shapes), the way torch.compile runs them; matmuls
and attention stay per op.

Communication streams. Every redistribution the plan implies (``cost/reshard.py``: the steps
DTensor takes) runs as collectives on the stream of its mesh dim, after its producer and behind
whatever that stream already carries. A value moves to a placement once per phase and is reused
by every reader; a consumer starts when its inputs have arrived.

- FSDP2 (parameter all_gathers): the gathers of a block (a decoder layer, or the head/tail
  outside the layers) run a block ahead, as FSDP2 prefetches them. In the backward, a block's
  pre-backward hook issues the next block's gathers before its own kernels (explicit
  prefetching), so they queue ahead of the block's own collectives. In the forward the CPU
  issues them at the next block's pre-forward, after this block's kernels and collectives
  (implicit prefetching: they overlap this block's compute because the CPU runs ahead), so they
  queue behind this block's collectives on the same process group's stream, able to start from
  this block's start. Parameters are resharded after the forward (``reshard_after_forward``),
  so the backward gathers them again.
- Gradient reduce_scatters (and all_reduces) are issued as soon as the gradient is computed and
  run under the rest of the backward; in torchtitan's mixed precision they move fp32
  (``reduce_dtype=float32``).
- Tensor-parallel collectives are exposed: their consumer waits. With ``async_tp`` an
  all_gather feeding matmuls as their left operand, or a reduce_scatter of a matmul's output, on
  the ``tp`` dim is fused with the matmul: the consumer is held back only by what the ring cannot
  hide, ``(W - 1) * max(0, hop - chunk)`` (``cost/overlap.py``'s collective-matmul price).

Activation checkpointing (``ac``: one policy, or one per decoder layer): the policy's recomputed
forward nodes (``recompute_plan``) run again at the start of their layer's backward, their
collectives included; ``recompute_s`` reports their time. With ``compile`` the memory-bound
recomputation fuses into the backward's kernels (Inductor's partitioner recomputes pointwise ops
rather than saving them), so it costs no kernel of its own, and memory-bound forward values are
not kept for the backward.

Memory: static (parameters and optimizer state, ``param_bytes`` + ``optimizer_state_bytes`` per
local element) plus every buffer alive at each point of the schedule, each a ``Lifetime`` (its
size, stream, and the items from its allocation to its last reader):

- a value lives from its producer to its last reader; views alias their base and a tuple's
  elements their tuple (flash attention's output and logsumexp);
- eager selective AC caches every output its policy saves until the block's recomputation
  (``torch.utils.checkpoint``'s selective context stores them in the forward, needed or not);
  compiled blocks save what their backward reads;
- FSDP2's gathers: the block's flat ``all_gather_output`` on the all-gather stream from the
  issue (a layer ahead) to the copy-out at the block's start, the unsharded parameters on the
  compute stream until the block reshards (its last reader); the root (everything outside the
  layers) and the last layer are not resharded after forward (FSDP2's root rule, torchtitan's
  ``reshard_after_forward`` for the last block), their forward gather lives to their backward;
- gradients: a group's unsharded gradients live until its block's backward ends; FSDP2's
  reduce-scatter input (the group's gradients in ``reduce_dtype``) and output (the stored fp32
  shards, freed by ``zero_grad(set_to_none=True)`` after the optimizer) on the reduce-scatter
  stream, the input held until the next group's reduction;
- the optimizer: foreach AdamW's ``_foreach_sqrt`` temporaries, one per parameter shard.

``peak_bytes`` is the most allocated at once, ``memory`` its breakdown (static, gradients,
gathered parameters, saved activations, transients, the largest buffers) and where it occurs.
``reserved_peak_bytes`` is what the CUDA caching allocator holds at its peak: the buffers of
three steps replayed through ``cost/allocator.py`` (per-stream pools, rounding, splitting,
expandable segments if ``expandable_segments``), the figure OOM is checked against. The figures
from the lifetimes are ``cost/memory.py``'s.

The optimizer step runs last on the compute stream, after the last gradient collective:
gradient clipping and a fused Adam read and write ``optimizer_bytes`` per local parameter element.
"""

from __future__ import annotations

import math
import operator
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch import fx

from shardwise.cost.hardware import Hardware
from shardwise.cost.memory import (
    ADAM_STATES,
    Lifetime,
    MemoryBreakdown,
    MemoryCategory,
    breakdown,
    peak_live,
    reserved_peak,
)
from shardwise.cost.overlap import overlapped_time
from shardwise.cost.reshard import leaves_copies, start_of_move
from shardwise.cost.topology import MeshTopology
from shardwise.errors import UserError
from shardwise.ir.flops import is_view
from shardwise.ir.match import CollectiveKind, matmuls_reading
from shardwise.ir.trace import Phase, Traced
from shardwise.passes.remat import ACPolicy, AnyPolicy, recompute_plan
from shardwise.plan.cluster import HEAD, TAIL, keeps_gathered, regions
from shardwise.plan.costs import PlannerCosts, local_bytes
from shardwise.plan.placement import Placements, placements_str, view_base_placements
from shardwise.plan.plan import Plan, tensor_args
from shardwise.plan.strategies import Strategy, flat_tensor_vals

aten = torch.ops.aten

COMPUTE_STREAM = "compute"
TP = "tp"
# Flash attention with a causal mask computes only the blocks on and below the diagonal: about
# half of the score matrix that the FLOP formula (torch.utils.flop_counter) counts.
CAUSAL_WORK_FRACTION = 0.5
# Fused Adam(W) per parameter element, fp32 master weights: reads param, grad, exp_avg,
# exp_avg_sq (4 x 4 B) and writes param, exp_avg, exp_avg_sq (3 x 4 B).
OPTIMIZER_BYTES_PER_ELEMENT = 28
# Gradient clipping before it (torchtitan's and ``train``'s ``clip_grad_norm_``): the norm reads
# each gradient element, the scaling reads and writes it. On a lent H100, 1.49 B fp32 gradients:
# 2.2 + 4.4 ms, about 2.7 TB/s (``benchmarks/device_step.py``).
CLIP_GRAD_PASSES = 3
FP32_BYTES = 4

# Attention kernels, forward and backward.
_ATTENTION = frozenset({aten._scaled_dot_product_flash_attention_for_cpu.default,
                        aten._scaled_dot_product_flash_attention.default,
                        aten._scaled_dot_product_efficient_attention.default,
                        aten._scaled_dot_product_cudnn_attention.default,
                        aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
                        aten._scaled_dot_product_flash_attention_backward.default,
                        aten._scaled_dot_product_efficient_attention_backward.default,
                        aten._scaled_dot_product_cudnn_attention_backward.default})
_MATMULS = frozenset({aten.mm.default, aten.einsum.default, aten.bmm.default, aten.addmm.default})


class EventKind:
    COMPUTE = "compute"
    RECOMPUTE = "recompute"
    OPTIMIZER = "optimizer"
    COLLECTIVE = "collective"


@dataclass(frozen=True)
class StepOptions:
    """How the step runs. ``param_bytes``/``grad_bytes``: bytes per local parameter element of
    the stored parameter and gradient; None keeps the traced dtype's (torchtitan's mixed
    precision stores fp32 master weights and fp32 gradients: 4 and 4). ``reduce_fp32``: gradient
    reductions move fp32 (FSDP2's ``reduce_dtype=float32``)."""

    ac: AnyPolicy = ACPolicy.NONE  # one policy, or one per decoder layer (``LayerPolicies``)
    compile: bool = False
    async_tp: bool = False
    param_bytes: int | None = None
    grad_bytes: int | None = None
    optimizer_state_bytes: int = 8
    reduce_fp32: bool = False
    expandable_segments: bool = False


def optimizer_bytes(opts: StepOptions, itemsize: int) -> int:
    """Bytes through memory per local parameter element in the step's tail, for a parameter of
    ``itemsize`` bytes: its gradient clipped, then the fused Adam update."""
    return CLIP_GRAD_PASSES * (opts.grad_bytes or itemsize) + OPTIMIZER_BYTES_PER_ELEMENT


# FSDP2 allocates on its own streams (``FSDPCommContext``): all_gather outputs on the all-gather
# copy-in stream, reduce-scatter inputs and outputs on the reduce-scatter stream; the caching
# allocator keeps a pool per stream, named here after the mesh dim's stream.
ALL_GATHER_POOL = "all_gather"
REDUCE_SCATTER_POOL = "reduce_scatter"


@dataclass(frozen=True)
class Event:
    name: str
    stream: str
    start: float
    end: float
    kind: str
    region: int  # decoder layer index, HEAD or TAIL
    phase: str

    @property
    def dur(self) -> float:
        return self.end - self.start


@dataclass
class StepSchedule:
    events: list[Event]
    step_s: float
    compute_s: float
    recompute_s: float
    optimizer_s: float
    comm_s: float
    exposed_comm_s: float
    static_bytes: int
    peak_bytes: int
    reserved_peak_bytes: int = 0
    reserved_by_stream: dict[str, int] = field(default_factory=dict)  # at the end of the replay
    memory: MemoryBreakdown | None = None
    lifetimes: list[Lifetime] = field(default_factory=list, repr=False)
    recomputed: list[str] = field(default_factory=list)

    @property
    def hidden_comm_s(self) -> float:
        return self.comm_s - self.exposed_comm_s

    def stream_events(self, stream: str) -> list[Event]:
        return [e for e in self.events if e.stream == stream]


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by a set of intervals."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def exposed_time(comm: list[tuple[float, float]], compute: list[tuple[float, float]]) -> float:
    """Length of the time some collective runs while no compute kernel does."""
    return union_length(comm + compute) - union_length(compute)


def stream_name(mesh_names: tuple[str, ...], dim: int) -> str:
    return f"comm:{mesh_names[dim] if dim < len(mesh_names) else dim}"


def _schema_arg(node: fx.Node, name: str, default: object) -> object:
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return default
    for i, a in enumerate(schema.arguments):
        if a.name == name:
            if name in node.kwargs:
                return node.kwargs[name]
            return node.args[i] if i < len(node.args) else default
    return default


def is_causal_attention(node: fx.Node) -> bool:
    return node.target in _ATTENTION and bool(_schema_arg(node, "is_causal", False))


def attention_factor(node: fx.Node, hw: Hardware) -> float:
    """What a node's roofline time is multiplied by: an attention kernel runs at the spec's
    ``attention_eff`` (flash attention reaches less of the peak than a GEMM) and, causal, does
    ``CAUSAL_WORK_FRACTION`` of the work its FLOP formula counts; any other node 1."""
    if node.target not in _ATTENTION:
        return 1.0
    query = node.args[0].meta["val"]
    return hw.attention_slowdown(query.dtype) * (CAUSAL_WORK_FRACTION if is_causal_attention(node) else 1.0)


def _base(node: fx.Node) -> fx.Node:
    """The allocation a value lives in: the base of a view chain, the tuple result an element
    (``getitem``) belongs to (attention's output and logsumexp live as long as either is read)."""
    while (node.op == "call_function" and node.all_input_nodes
           and (is_view(node) or node.target is operator.getitem)):
        node = node.all_input_nodes[0]
    return node


@dataclass(frozen=True)
class _Item:
    node: fx.Node
    recompute: bool
    region: int
    phase: Phase


class _Scheduler:
    def __init__(self, traced: Traced, plan: Plan, topo: MeshTopology, opts: StepOptions,
                 costs: PlannerCosts | None = None) -> None:
        self.traced, self.plan, self.topo, self.opts = traced, plan, topo, opts
        self.hw = topo.hw
        self.mesh_shape = tuple(plan.mesh_shape)
        self.names = tuple(plan.mesh_names)
        self.costs = costs if costs is not None else PlannerCosts(self.mesh_shape, self.hw)
        if self.costs.mesh_shape != self.mesh_shape or self.costs.hw != self.hw:
            raise ValueError(f"costs for mesh {self.costs.mesh_shape} on {self.costs.hw.name} cannot price "
                             f"a plan for mesh {self.mesh_shape} on {self.hw.name}")
        self.region = regions(traced) or {n: HEAD for n in traced.gm.graph.nodes}
        # a dict, not a set: graph order, so the allocator replay allocates them in a fixed order
        self.param_nodes = dict.fromkeys(traced.node(ph) for ph in traced.params.values())
        self._bases: dict[fx.Node, fx.Node] = {}  # ``_base`` of each node asked (~130k asks on 70B)
        self._args: dict[fx.Node, list[fx.Node]] = {}  # ``tensor_args`` of each node (~200k asks on 70B)
        self.grad_of = {traced.node(g): traced.node(traced.params[p]) for p, g in traced.grads.items()}
        self.tp = self.names.index(TP) if TP in self.names else None
        layers = [r for r in self.region.values() if 0 <= r < TAIL]
        self.last_layer = max(layers) if layers else None
        remat = recompute_plan(traced.gm, opts.ac) if traced.train else None
        self.recompute: set[fx.Node] = set(remat.recompute) if remat else set()
        # Eager per-op SAC caches every output its policy saves, needed by the backward or not,
        # until the block's recomputation pops it (torch.utils.checkpoint's selective
        # checkpoint context stores MUST_SAVE outputs in the forward). Compiled blocks save what
        # the partitioner's backward reads, nothing more.
        self.sac_cached: set[fx.Node] = (set(remat.selective_kept) if remat and not opts.compile
                                         else set())
        self.fused_free: set[fx.Node] = set()
        self.on_chip: set[fx.Node] = set()
        self.segment_time: dict[fx.Node, float] = {}
        if opts.compile:
            self._price_segments()
            if traced.train:
                self._compiled_recompute()
        self.events: list[Event] = []
        self.stream_free: dict[str, float] = defaultdict(float)
        self.ready: dict[tuple, float] = {}      # value instance -> when it exists
        self.moved: dict[tuple, float] = {}      # (instance, dst) -> when it has arrived
        self.issue_index: dict[tuple, int] = {}  # moved key -> item index it was issued at
        self.last_read: dict[tuple, int] = {}    # instance or moved key -> last item reading it
        self.born: dict[tuple, int] = {}
        self.first_read: dict[tuple, int] = {}   # moved key -> first item reading it
        self.move_stream: dict[tuple, str] = {}  # moved key -> stream of its (first) collective
        # Placements an activation's move passed through, as a moved key with the phase it was read
        # in -> (when, item index, stream of the hop's collective): a later move of that phase may
        # start there (``_nearest_copy``).
        self.passed: dict[tuple, tuple[float, int, str | None]] = {}
        # (activation, recomputed, phase read in) -> its copies' moved keys by placement
        self.copies: dict[tuple, dict[Placements, tuple]] = defaultdict(dict)
        self.handed_off: set[fx.Node] = set()     # gradients that are their stored gradient
        self.reduced: list[tuple[fx.Node, fx.Node, int, str]] = []  # (grad, param, region, stream)
        self.extra: list[Lifetime] = []            # buffers no graph value stands for
        self.kept_gathered: dict[tuple, int] = {}  # gathered once for forward and backward -> group

    # ---- pricing -------------------------------------------------------------------------

    def _base_of(self, node: fx.Node) -> fx.Node:
        hit = self._bases.get(node)
        if hit is None:
            hit = self._bases[node] = _base(node)
        return hit

    def _spec(self, node: fx.Node):
        return self.plan.nodes.get(node.name)

    def _price_segments(self) -> None:
        """Memory-bound kernels as torch.compile fuses them: boundary bytes at local shapes."""
        from shardwise.passes.segment import SegClass, segment

        seg = self.traced.analysis("segment", segment)  # the graph's alone: once for all its plans
        order = {n: i for i, n in enumerate(self.traced.gm.graph.nodes)}
        for s in seg.segments:
            if s.cls not in (SegClass.POINTWISE, SegClass.REDUCTION):
                continue
            # torchtitan compiles each TransformerBlock (``apply_compile``: torch.compile per
            # block, fullgraph): the embedding, final norm, output and loss run eagerly.
            if not all(0 <= self.region.get(n, HEAD) < TAIL for n in s.nodes):
                continue
            nbytes = sum(self._value_bytes(v) for v in (*s.inputs, *s.outputs))
            # A segment spanning both phases is two kernels (forward and backward graphs).
            phases = {self.traced.phase(n) for n in s.nodes}
            last = max(s.nodes, key=order.__getitem__)
            self.fused_free.update(s.nodes)
            # A fused kernel keeps its intermediates on chip: only its outputs take memory.
            self.on_chip.update(n for n in s.nodes if n not in s.outputs)
            self.segment_time[last] = self.hw.memory_time(nbytes) + self.hw.launch_s * len(phases)

    def _compiled_recompute(self) -> None:
        """Inductor's min-cut partitioner recomputes memory-bound forward values in the backward
        kernels that read them instead of saving them: inside the layers, a fused forward value
        the backward reads is recomputed (at no kernel of its own). Not a block's output: it is
        the next compiled block's input, which that block's graph saves."""
        fwd_fused = [n for n in self.traced.gm.graph.nodes if n in self.fused_free
                     and self.traced.phase(n) is Phase.FORWARD and 0 <= self.region.get(n, HEAD) < TAIL
                     and not self._leaves_block(n)]
        self.recompute.update(fwd_fused)

    def _leaves_block(self, node: fx.Node) -> bool:
        """A forward value another block's forward reads (directly or through views)."""
        r = self.region.get(node, HEAD)
        stack = list(node.users)
        while stack:
            u = stack.pop()
            if self.traced.phase(u) is not Phase.FORWARD:
                continue
            if is_view(u) or u.target is operator.getitem:
                stack.extend(u.users)
            elif self.region.get(u, HEAD) != r:
                return True
        return False

    def _value_bytes(self, node: fx.Node) -> int:
        spec = self._spec(node)
        vals = flat_tensor_vals(node)
        if spec is None or not vals:
            return 0
        return sum(local_bytes(v, p, self.mesh_shape) for v, p in zip(vals, spec.output, strict=False))

    def _node_time(self, node: fx.Node, recompute: bool) -> float:
        if node.op != "call_function":
            return 0.0
        if self.opts.compile and node in self.fused_free:
            if recompute:
                return 0.0  # fused into the backward kernels that read it
            return self.segment_time.get(node, 0.0)
        spec = self._spec(node)
        if spec is None:
            return 0.0
        t = self.costs.compute_time(node, Strategy(spec.output, spec.inputs))
        return t * attention_factor(node, self.hw)

    # ---- items ---------------------------------------------------------------------------
    def items(self) -> list[_Item]:
        nodes = [n for n in self.traced.gm.graph.nodes if n.op == "call_function"]
        fwd = [n for n in nodes if self.traced.phase(n) is Phase.FORWARD]
        bwd = [n for n in nodes if self.traced.phase(n) is Phase.BACKWARD]
        by_region: dict[int, list[fx.Node]] = defaultdict(list)
        for n in fwd:
            if n in self.recompute:
                by_region[self.region.get(n, HEAD)].append(n)
        out = [_Item(n, False, self.region.get(n, HEAD), Phase.FORWARD) for n in fwd]
        for n in bwd:
            # A layer's forward is recomputed when its backward first reads a value it
            # recomputes (torch.utils.checkpoint unpacks the first saved tensor).
            for a in ([] if is_view(n) else n.all_input_nodes):  # a view (detach) computes nothing
                a = self._base_of(a)
                ra = self.region.get(a, HEAD)
                if a in self.recompute and by_region.get(ra):
                    out += [_Item(m, True, ra, Phase.BACKWARD) for m in by_region.pop(ra)]
            out.append(_Item(n, False, self.region.get(n, TAIL), Phase.BACKWARD))
        for r, rest in by_region.items():  # a layer whose backward has no node of its own
            out += [_Item(m, True, r, Phase.BACKWARD) for m in rest]
        return out

    def _instance(self, u: fx.Node, reader: _Item) -> tuple:
        """Which copy of value ``u`` a reader reads: the recomputed one in the backward."""
        u = self._base_of(u)
        rc = u in self.recompute and (reader.recompute or reader.phase is Phase.BACKWARD)
        return (u, rc)

    def _is_param(self, u: fx.Node) -> bool:
        return self._base_of(u) in self.param_nodes

    def _move_key(self, u: fx.Node, dst: Placements, reader: _Item) -> tuple:
        if self._is_param(u):
            # FSDP2 reshards after forward: the backward gathers the parameter again. Views of
            # one parameter (its transposes) share one gather: the same bytes arrive. Not so
            # for the root module's parameters (FSDP2's lazy init sets the root's
            # post_forward_mesh_info to None: "the parameters would be freed and all-gathered
            # immediately") nor for the last block (torchtitan passes reshard_after_forward=False
            # for it, "since FSDP would prefetch it immediately"): their forward gather stays.
            base = self._base_of(u)
            kept = keeps_gathered(reader.region, self.last_layer)
            key = (base, False, view_base_placements(u, dst),
                   Phase.FORWARD if kept else reader.phase)
            if kept:
                self.kept_gathered[key] = self._group(reader.region)
            return key
        inst = self._instance(u, reader)
        return (u, inst[1], dst, None)

    # ---- collectives ---------------------------------------------------------------------
    def _collective_steps(self, u: fx.Node, src: Placements, dst: Placements, scale: float = 1.0):
        rc = self.costs.reshard(src, dst, u.meta["val"])
        if rc.time_s == math.inf:
            raise UserError(f"the plan moves {u.name} from {placements_str(src)} to {placements_str(dst)}, "
                            "which no redistribution can do; plan again.")
        return [(c.kind, c.mesh_dim, int(c.bytes * scale)) for c in rc.collectives]

    def _run_steps(self, name: str, steps, ready: float, item: _Item) -> float:
        """Run the collectives one after another on their dims' streams; when they end."""
        t = ready
        for kind, dim, nbytes in steps:
            stream = stream_name(self.names, dim)
            dur = self.topo.collective_time(kind, nbytes, dim)
            start = max(t, self.stream_free[stream])
            self.stream_free[stream] = start + dur
            self.events.append(Event(f"{kind.value}:{name}", stream, start, start + dur,
                                     EventKind.COLLECTIVE, item.region, item.phase.value))
            t = start + dur
        return t

    def _async_tp_wait(self, steps, kind: CollectiveKind, matmul_s: float) -> float | None:
        """Seconds a fused collective-matmul adds to its matmuls' ``matmul_s``: what the ring
        cannot hide, ``(W - 1) * max(0, hop - chunk)`` (None: not fusable)."""
        if not self.opts.async_tp or self.tp is None or len(steps) != 1 or matmul_s <= 0:
            return None
        step_kind, dim, nbytes = steps[0]
        if dim != self.tp or step_kind is not kind:
            return None
        w = self.mesh_shape[dim]
        comm = self.topo.collective_time(kind, nbytes, dim)
        return overlapped_time(matmul_s / w, comm, w) - matmul_s

    def _matmul_readers_s(self, u: fx.Node, item: _Item) -> float:
        """Time of the matmuls an all_gather of ``u`` fuses with: those of ``item``'s phase that
        read ``u`` as their left operand (``ir.match.matmuls_reading``, the pattern
        PyTorch's micro-pipeline pass fuses too), whose rows the ring's chunks split; in a
        recomputation, the recomputed ones. A weight gradient, which sums over the gathered dim,
        reads the gathered copy after the ring."""
        return sum(self._node_time(node, item.recompute) for m in matmuls_reading(u) for node in m.nodes
                   if node.target in _MATMULS and (node in self.recompute if item.recompute
                                                   else self.traced.phase(node) is item.phase))

    def _arrival(self, u: fx.Node, dst: Placements, item: _Item, i: int, t_c: float, gate: float = 0.0,
                 matmul_reader: bool = False, issued_at: int | None = None) -> float:
        """When value ``u`` is available in ``dst`` to ``item`` (item index ``i``); schedules its
        move if needed, issued at item ``issued_at`` (default ``i``; earlier when prefetched:
        its buffer is allocated when the collective is issued)."""
        spec_u = self._spec(u)
        key = self._move_key(u, dst, item)
        inst = (self._base_of(u), key[1])
        src = spec_u.output[0] if spec_u is not None else dst
        if src == dst or u.op == "placeholder" and not isinstance(u.meta.get("val"), torch.Tensor):
            self.last_read[inst] = i
            return self.ready.get(inst, 0.0)
        copies = self._copies(u, item)
        if key not in self.moved and copies is not None and copies.get(dst) in self.passed:
            # a move of this phase passed through dst: that copy is the one read there
            self._keep(copies[dst], i, into=key)
            copies[dst] = key
        if key in self.moved:
            self.last_read[key] = i
            self.first_read[key] = min(self.first_read.get(key, i), i)
            return self.moved[key]
        copy = self._nearest_copy(u, src, dst, copies, i)
        if copy is not None:  # the move starts from a copy an earlier move made
            src, copy_key = copy
            produced = max(self.moved[copy_key], gate)
        else:
            produced = max(self.ready.get(inst, 0.0), gate)
        steps = self._collective_steps(u, src, dst)
        stream = stream_name(self.names, steps[0][1]) if steps else None
        gather_hold = (self._async_tp_wait(steps, CollectiveKind.ALL_GATHER, self._matmul_readers_s(u, item))
                       if matmul_reader else None)
        scatter_hold = (self._async_tp_wait(steps, CollectiveKind.REDUCE_SCATTER, self._node_time(u, inst[1]))
                        if u.target in _MATMULS else None)
        if gather_hold is not None:
            # all_gather + matmul fused: the ring starts with the matmuls, which wait only for
            # what it cannot hide.
            start = max(produced, self.stream_free[stream], t_c)
            self._run_steps(u.name, steps, start, item)
            arrive = start + gather_hold
        elif scatter_hold is not None:
            # matmul + reduce_scatter fused: the ring runs under the matmul that produces it and
            # ends what it cannot hide after it.
            comm = self.topo.collective_time(steps[0][0], steps[0][2], steps[0][1])
            arrive = max(produced + scatter_hold, self.stream_free[stream] + comm)
            self._run_steps(u.name, steps, arrive - comm, item)
        elif copies is not None and leaves_copies(dst):
            arrive = self._run_path(u, src, dst, produced, item, i, copies)
        else:
            arrive = self._run_steps(u.name, steps, produced, item)
        self.moved[key] = arrive
        if copies is not None and leaves_copies(dst):
            copies.setdefault(dst, key)
        self.first_read[key] = i
        if stream is not None:
            self.move_stream[key] = stream
        self.issue_index[key] = i
        self.born[key] = i if issued_at is None else min(i, issued_at)
        self.last_read[key] = i
        if copy is None:
            self.last_read[inst] = max(self.last_read.get(inst, i), i)
        return arrive

    def _copies(self, u: fx.Node, item: _Item) -> dict[Placements, tuple] | None:
        """The copies of activation ``u`` (its moved keys by placement) that moves of it read in
        ``item``'s phase made or passed through; None for a value that is not an activation.
        Per phase, as the lowering keeps them (a forward copy a backward move started from would
        live until the backward)."""
        if u.op != "call_function":
            return None
        return self.copies[(u, self._instance(u, item)[1], item.phase)]

    def _keep(self, k: tuple, i: int, into: tuple | None = None) -> None:
        """A placement a move passed through (``passed`` key ``k``) becomes a kept copy, read by
        item ``i``, under the moved key ``into`` (default ``k``)."""
        into = into or k
        self.moved[into], self.born[into], stream = self.passed.pop(k)
        self.first_read[into] = i
        if stream is not None:
            self.move_stream[into] = stream

    def _nearest_copy(self, u: fx.Node, src: Placements, dst: Placements,
                      copies: dict[Placements, tuple] | None, i: int) -> tuple[Placements, tuple] | None:
        """The copy of activation ``u`` a move to ``dst`` starts from (``reshard.start_of_move``)
        where it is not ``u`` as made: its placement and moved key. That copy now lives until
        item ``i`` reads it."""
        if not copies:
            return None
        val = u.meta["val"]
        start = start_of_move(src, copies, dst, tuple(val.shape), val.element_size(), self.costs.topology)
        if start == src:
            return None
        k = copies[start]
        if k in self.passed:
            self._keep(k, i)
        self.last_read[k] = i
        return start, k

    def _run_path(self, u: fx.Node, src: Placements, dst: Placements, ready: float, item: _Item,
                  i: int, copies: dict[Placements, tuple]) -> float:
        """Run a move of ``u`` hop by hop (``_run_steps``), noting in ``copies`` each placement it
        passes through, for later moves (``_nearest_copy``); when it ends."""
        hops = self.costs.reshard_hops(src, dst, u.meta["val"])
        t = ready
        for a, b in zip((src, *hops[:-1]), hops, strict=True):
            steps = self._collective_steps(u, a, b)
            t = self._run_steps(u.name, steps, t, item)
            if b is not hops[-1] and b not in copies:
                # keyed by phase: a move of the other phase does not start from it
                k = (*self._move_key(u, b, item)[:3], item.phase)
                self.passed[k] = (t, i, stream_name(self.names, steps[0][1]) if steps else None)
                copies[b] = k
        return t

    def _tensor_args(self, node: fx.Node) -> list[fx.Node]:
        hit = self._args.get(node)
        if hit is None:
            hit = self._args[node] = tensor_args(node)
        return hit

    def _issue_gathers(self, reads: list[tuple[fx.Node, Placements, _Item, int]], gate: float,
                       issued_at: int) -> None:
        """A block's parameter gathers, issued at time ``gate`` (item ``issued_at``), each on its
        stream behind what that stream already carries."""
        for u, dst, reader, k in reads:
            self._arrival(u, dst, reader, k, gate, gate=gate, issued_at=issued_at)

    # ---- the walk ------------------------------------------------------------------------
    def run(self) -> StepSchedule:
        items = self.items()
        self.n_items = len(items)
        self.first_backward = next((i for i, it in enumerate(items) if it.phase is Phase.BACKWARD),
                                   len(items))
        blocks: list[tuple[Phase, int]] = []
        for it in items:
            b = (it.phase, it.region)
            # A block starts at its first kernel (the backward detaches saved values of every
            # layer up front; a view launches nothing).
            if b not in blocks and not is_view(it.node) and it.node.target is not operator.getitem:
                blocks.append(b)
        next_block = {b: blocks[k + 1] for k, b in enumerate(blocks[:-1])}
        # Parameter gathers of each block, to issue when the block before it starts (prefetch).
        param_reads: dict[tuple[Phase, int], list[tuple[fx.Node, Placements, _Item, int]]] = defaultdict(list)
        for k, it in enumerate(items):
            spec = self._spec(it.node)
            if spec is None:
                continue
            for j, u in enumerate(self._tensor_args(it.node)):
                if self._is_param(u) and j < len(spec.inputs) and spec.inputs[j] is not None:
                    param_reads[(it.phase, it.region)].append((u, spec.inputs[j], it, k))
        started: set[tuple[Phase, int]] = set()
        # A forward block's gathers, issued once the block before it has issued its own work:
        # (the time and item index that block started at).
        deferred: dict[tuple[Phase, int], tuple[float, int]] = {}
        t_c = 0.0
        compute_s = recompute_s = 0.0
        for i, it in enumerate(items):
            b = (it.phase, it.region)
            kernel = not is_view(it.node) and it.node.target is not operator.getitem
            if b not in started and b in blocks and kernel:
                started.add(b)
                gate, issued = deferred.pop(b, (t_c, i))
                self._issue_gathers(param_reads.get(b, []), gate, issued)
                nxt = next_block.get(b)
                if nxt is not None and b[0] is Phase.FORWARD:
                    deferred[nxt] = (t_c, i)
                elif nxt is not None:
                    self._issue_gathers(param_reads.get(nxt, []), t_c, i)
            n = it.node
            spec = self._spec(n)
            dur = self._node_time(n, it.recompute)
            start = t_c
            if spec is not None:
                for j, u in enumerate(self._tensor_args(n)):
                    dst = spec.inputs[j] if j < len(spec.inputs) and spec.inputs[j] is not None else None
                    if dst is None:
                        dst = self._spec(u).output[0] if self._spec(u) is not None else None
                    if dst is None:
                        continue
                    start = max(start, self._arrival(u, dst, it, i, t_c, matmul_reader=n.target in _MATMULS))
            end = start + dur
            inst = (n, it.recompute)
            self.ready[inst] = end
            self.born[inst] = i
            if dur > 0:
                self.events.append(Event(n.name, COMPUTE_STREAM, start, end,
                                         EventKind.RECOMPUTE if it.recompute else EventKind.COMPUTE,
                                         it.region, it.phase.value))
                if it.recompute:
                    recompute_s += dur
                else:
                    compute_s += dur
            t_c = end if dur > 0 else max(t_c, start)
            if n in self.grad_of and not it.recompute:
                self._reduce_gradient(n, it, i, end)
        last_comm = max(self.stream_free.values(), default=0.0)
        opt_start = max(t_c, last_comm)
        opt_s = self._optimizer_time() if self.traced.train else 0.0
        if opt_s > 0:
            self.events.append(Event("optimizer.step", COMPUTE_STREAM, opt_start, opt_start + opt_s,
                                     EventKind.OPTIMIZER, TAIL, Phase.BACKWARD.value))
        step = max([opt_start + opt_s] + [e.end for e in self.events])
        comm = [(e.start, e.end) for e in self.events if e.kind == EventKind.COLLECTIVE]
        compute = [(e.start, e.end) for e in self.events if e.stream == COMPUTE_STREAM]
        if self.traced.train:
            self._fsdp_reduction_buffers(items)
            self._extend_sac_cache(items)
        static = self._static_bytes()
        lifetimes = self._lifetimes()
        live_peak, at = peak_live(lifetimes, self.n_items)
        peak = static + live_peak
        params, states = self._state_buffers()
        reserved, by_stream = reserved_peak(lifetimes, params, states, self.n_items, self.hw.mem_capacity,
                                            self.opts.expandable_segments)
        it = items[min(at, len(items) - 1)]
        return StepSchedule(
            events=sorted(self.events, key=lambda e: (e.stream, e.start)), step_s=step,
            compute_s=compute_s, recompute_s=recompute_s, optimizer_s=opt_s,
            comm_s=sum(e - s for s, e in comm), exposed_comm_s=exposed_time(comm, compute),
            static_bytes=static, peak_bytes=peak, reserved_peak_bytes=reserved, reserved_by_stream=by_stream,
            memory=breakdown(lifetimes, at, static, it.node.name, it.phase.value, it.region),
            lifetimes=lifetimes,
            recomputed=[n.name for n in self.traced.gm.graph.nodes if n in self.recompute])

    def _reduce_gradient(self, g: fx.Node, it: _Item, i: int, ready: float) -> None:
        param = self.grad_of[g]
        src, dst = self._spec(g).output[0], self._spec(param).output[0]
        # The stored gradient exists from here to the optimizer step (zero_grad(set_to_none)
        # frees it every step, as torchtitan does).
        self.born[("grad", param)] = i
        self.last_read[("grad", param)] = self.n_items
        if src == dst:
            self.handed_off.add(self._base_of(g))
            return
        itemsize = g.meta["val"].element_size()
        scale = FP32_BYTES / itemsize if self.opts.reduce_fp32 else 1.0
        steps = self._collective_steps(g, src, dst, scale)
        self._run_steps(g.name, steps, ready, it)
        self.last_read[(g, False)] = i
        scatter = [dim for kind, dim, _ in steps if kind is CollectiveKind.REDUCE_SCATTER]
        if not scatter:
            # an all_reduce (replicated parameters) reduces the gradient in place: it is the
            # stored gradient
            self.handed_off.add(self._base_of(g))
            return
        self.reduced.append((g, param, it.region, stream_name(self.names, scatter[0])))

    def _fsdp_reduction_buffers(self, items: list[_Item]) -> None:
        """FSDP2's gradient reduction as it allocates (``foreach_reduce``): a group's unsharded
        gradients live until its block's backward ends (its post-backward hook reduces the whole
        group: the decoder layer, or the root for everything outside the layers); then the
        reduce-scatter input, the group's unsharded gradients copied in ``reduce_dtype`` (fp32),
        is allocated on the reduce-scatter stream and kept until the next group's reduction
        (FSDP2 holds it in ``comm_ctx.reduce_scatter_state`` until then); the reduced shard, the
        stored gradient, is allocated on that stream too."""
        block_end: dict[int, int] = {}
        for i, it in enumerate(items):
            if it.phase is Phase.BACKWARD:
                block_end[self._group(it.region)] = i
        groups: dict[int, list[tuple[fx.Node, fx.Node, str]]] = defaultdict(list)
        for g, param, region, stream in self.reduced:
            groups[self._group(region)].append((g, param, stream))
        self._keep_gathered_to_post_backward(block_end)
        order = sorted(groups, key=lambda r: block_end.get(r, self.n_items))
        for k, r in enumerate(order):
            end = block_end.get(r, self.n_items - 1)
            nxt = block_end.get(order[k + 1], self.n_items) if k + 1 < len(order) else self.n_items
            staged = sharded = 0
            for g, param, _stream in groups[r]:
                inst = (self._base_of(g), False)
                self.last_read[inst] = max(self.last_read.get(inst, end), end)
                v = g.meta["val"]
                unsharded = local_bytes(v, self._spec(g).output[0], self.mesh_shape) // v.element_size()
                staged += unsharded * (FP32_BYTES if self.opts.reduce_fp32 else v.element_size())
                # the group's stored gradients are views of one reduce-scatter output
                sharded += self._key_bytes(("grad", param))
                del self.born[("grad", param)]
            name = "root" if r == HEAD else r
            pool = f"{groups[r][0][2]}:{REDUCE_SCATTER_POOL}"
            self.extra.append(Lifetime(f"reduce_scatter_input:{name}", MemoryCategory.GRADS, staged, end, nxt,
                                       pool))
            self.extra.append(Lifetime(f"grads:{name}", MemoryCategory.GRADS, sharded, end, self.n_items,
                                       pool))

    def _keep_gathered_to_post_backward(self, block_end: dict[int, int]) -> None:
        """The parameters gathered once for forward and backward (the root's, the last
        layer's) are resharded by their group's post-backward: the root's at the very end."""
        for key, group in self.kept_gathered.items():
            if key in self.born:
                self.last_read[key] = max(self.last_read.get(key, 0), block_end.get(group, self.n_items - 1))

    def _group(self, region: int) -> int:
        """The FSDP2 parameter group of a region: its decoder layer, or HEAD for the root."""
        return region if 0 <= region < TAIL else HEAD

    def _extend_sac_cache(self, items: list[_Item]) -> None:
        """Eager SAC's cached outputs live until their block's recomputation starts."""
        first_recompute: dict[int, int] = {}
        for i, it in enumerate(items):
            if it.recompute:
                first_recompute.setdefault(it.region, i)
        for n in self.sac_cached:
            inst = (self._base_of(n), False)
            r = self.region.get(n, HEAD)
            # Only the decoder layers are checkpointed (torchtitan wraps each block).
            if inst in self.born and 0 <= r < TAIL and r in first_recompute:
                self.last_read[inst] = max(self.last_read.get(inst, self.born[inst]), first_recompute[r])

    # ---- memory --------------------------------------------------------------------------
    def _local_elements(self, ph: fx.Node) -> int:
        """The elements of parameter ``ph``'s stored shard."""
        v = ph.meta["val"]
        return local_bytes(v, self._spec(ph).output[0], self.mesh_shape) // v.element_size()

    def _static_bytes(self) -> int:
        total = 0.0
        for ph in self.param_nodes:
            v = ph.meta["val"]
            elems = self._local_elements(ph)
            per = self.opts.param_bytes or v.element_size()
            if self.traced.train:
                per += self.opts.optimizer_state_bytes
            total += elems * per
        return int(total)

    def _state_buffers(self) -> tuple[list[int], list[int]]:
        """The tensors of the static state: each parameter's stored shard, and (training) Adam's
        two moments of it, one tensor each."""
        params, states = [], []
        for ph in self.param_nodes:
            v = ph.meta["val"]
            elems = self._local_elements(ph)
            params.append(elems * (self.opts.param_bytes or v.element_size()))
            if self.traced.train and self.opts.optimizer_state_bytes:
                states += [elems * self.opts.optimizer_state_bytes // ADAM_STATES] * ADAM_STATES
        return params, states

    def _optimizer_temporaries(self) -> list[Lifetime]:
        """torchtitan's AdamW runs ``foreach`` (``foreach = not fused``, fused off by default):
        ``_foreach_sqrt(exp_avg_sqs)`` makes one temporary per parameter, the size of its
        shard, for the length of the step (the other updates are in place)."""
        if not self.traced.train:
            return []
        params, _ = self._state_buffers()
        return [Lifetime("optimizer.step:sqrt", MemoryCategory.TRANSIENT, b, self.n_items, self.n_items)
                for b in params]

    def _optimizer_time(self) -> float:
        moved = sum(self._local_elements(ph) * optimizer_bytes(self.opts, ph.meta["val"].element_size())
                    for ph in self.param_nodes)
        return self.hw.memory_time(moved) + self.hw.launch_s

    def _lifetimes(self) -> list[Lifetime]:
        """Every buffer the step allocates besides the static state: its size and the items
        (graph positions) from its allocation to its last reader."""
        out = []
        gathers: dict[tuple[int, str], list[tuple[tuple, int]]] = defaultdict(list)
        for key, born in self.born.items():
            size = self._key_bytes(key)
            if size == 0:
                continue
            if len(key) == 4 and self._is_param(key[0]) and key in self.move_stream:
                gathers[(born, self.move_stream[key])].append((key, size))
                continue
            last = self.last_read.get(key, born)
            if len(key) == 2 and key[0] in self.handed_off:
                last = born  # not reduced: the value is the stored gradient (counted as such)
            # Functional collectives (DTensor's redistributions: tensor-parallel activations)
            # allocate their output on the caller's stream, the compute one; FSDP2's own
            # buffers are placed by _fsdp_gather_buffers and _fsdp_reduction_buffers.
            out.append(Lifetime(self._key_name(key), self._category(key, born, last), size, born, last,
                                COMPUTE_STREAM))
        out += self._fsdp_gather_buffers(gathers)
        return out + [lt for lt in self.extra + self._optimizer_temporaries() if lt.size > 0]

    def _fsdp_gather_buffers(self, gathers: dict[tuple[int, str], list[tuple[tuple, int]]]) -> list[Lifetime]:
        """FSDP2's parameter all_gather as it allocates: the parameters a block gathers at once
        go into one flat ``all_gather_output`` on the all-gather stream, from the issue to the
        copy-out when the block starts (``foreach_all_gather_copy_out`` in its pre-forward or
        pre-backward hook), which allocates each unsharded parameter on the compute stream,
        alive until the block reshards (its last reader)."""
        out = []
        for (born, stream), keys in gathers.items():
            copy_out = max(born, min(self.first_read.get(k, born) for k, _ in keys))
            out.append(Lifetime(f"all_gather_output@{born}", MemoryCategory.GATHERED_PARAMS,
                                sum(size for _, size in keys), born, copy_out, f"{stream}:{ALL_GATHER_POOL}"))
            for k, size in keys:
                last = max(self.last_read.get(k, copy_out), copy_out)
                out.append(Lifetime(self._key_name(k), MemoryCategory.GATHERED_PARAMS, size, copy_out, last,
                                    COMPUTE_STREAM))
        return out

    def _category(self, key: tuple, born: int, last: int) -> str:
        if key[0] == "grad":
            return MemoryCategory.GRADS
        if len(key) == 4 and self._is_param(key[0]):
            return MemoryCategory.GATHERED_PARAMS
        # Saved for the backward: made before the backward starts, read after it has.
        if born < self.first_backward <= last:
            return MemoryCategory.SAVED
        return MemoryCategory.TRANSIENT

    def _key_name(self, key: tuple) -> str:
        if key[0] == "grad":
            return f"grad:{key[1].name}"
        if len(key) == 2:
            return f"{key[0].name}{' (recomputed)' if key[1] else ''}"
        return f"{key[0].name} -> {placements_str(key[2])}{f' ({key[3].value})' if key[3] else ''}"

    def _key_bytes(self, key: tuple) -> int:
        if key[0] == "grad":  # a parameter's stored gradient
            ph = key[1]
            return self._local_elements(ph) * (self.opts.grad_bytes or ph.meta["val"].element_size())
        if len(key) == 2:  # a value instance
            node = key[0]
            if node.op != "call_function" or is_view(node) or node.target is operator.getitem:
                return 0
            if node in self.on_chip:
                return 0
            return self._value_bytes(node)
        u, _rc, dst, _phase = key  # a moved value: its local size in the new placement
        v = u.meta.get("val")
        return local_bytes(v, dst, self.mesh_shape) if isinstance(v, torch.Tensor) else 0


def schedule_step(traced: Traced, plan: Plan, topo: MeshTopology,
                  opts: StepOptions | None = None, costs: PlannerCosts | None = None) -> StepSchedule:
    """Lay ``plan``'s step out on streams (see the module docstring). ``costs``: the planner's,
    whose caches already hold most of the kernels and moves asked (by default, new ones)."""
    return _Scheduler(traced, plan, topo, opts or StepOptions(), costs).run()

