"""The step schedule: a plan's training step laid out on streams, as a GPU would run it.

Input: a traced step, a plan of it (placements per node) and a mesh topology. Output: timed
events on one compute stream and one communication stream per mesh dim (process group), the
step time, the communication that is exposed (not under compute) and hidden, and the peak
memory per device over the schedule.

Compute stream. Nodes run one after another in graph order (eager PyTorch issues them in program
order), each priced by roofline on its local shapes (``plan/costs.py``); a causal attention
kernel does half the score-matrix work its FLOP formula counts (flash attention skips the
masked blocks). With ``compile`` the memory-bound nodes are priced as the kernels the
segmentation pass fuses them into (``passes/segment``, boundary bytes at local shapes), the way
torch.compile runs them; matmuls and attention stay per op.

Communication streams. Every redistribution the plan implies (``cost/reshard.py``: the steps
DTensor takes) runs as collectives on the stream of its mesh dim, after its producer and behind
whatever that stream already carries. A value moves to a placement once per phase and is reused
by every reader; a consumer starts when its inputs have arrived.

- FSDP2 (parameter all_gathers): the gathers of a block (a decoder layer, or the head/tail
  outside the layers) are issued when the block before it starts: one layer of prefetch, as
  FSDP2's implicit prefetching does. Parameters are resharded after the forward
  (``reshard_after_forward``), so the backward gathers them again.
- Gradient reduce_scatters (and all_reduces) are issued as soon as the gradient is computed and
  run under the rest of the backward; in torchtitan's mixed precision they move fp32
  (``reduce_dtype=float32``).
- Tensor-parallel collectives are exposed: their consumer waits. With ``async_tp`` an
  all_gather feeding matmuls, or a reduce_scatter of a matmul's output, on the ``tp`` dim is
  fused with the matmul: the consumer is held back only by what the ring cannot hide,
  ``(W - 1) * max(0, hop - chunk)`` (``cost/overlap.py``'s collective-matmul price).

Activation checkpointing (``ac``): the policy's recomputed forward nodes (``recompute_plan``)
run again at the start of their layer's backward, their collectives included; ``recompute_s``
reports their time. With ``compile`` the memory-bound recomputation fuses into the backward's
kernels (Inductor's partitioner recomputes pointwise ops rather than saving them), so it costs no
kernel of its own, and memory-bound forward values are not kept for the backward.

Memory: static (parameters and optimizer state, ``param_bytes`` + ``optimizer_state_bytes`` per
local element) plus every value alive at each point of the schedule: a value lives from its
producer to its last reader (views alias their base), so the peak holds the saved activations
of the layers whose backward has not run, the gathered parameters in flight and the largest
transients; a parameter's stored gradient (``grad_bytes`` per local element) lives from its
reduction to the optimizer step (``zero_grad(set_to_none=True)`` frees it every step).

The optimizer step runs last on the compute stream, after the last gradient collective: a
fused Adam reads and writes ``OPTIMIZER_BYTES_PER_ELEMENT`` per local parameter element.
"""

from __future__ import annotations

import math
import operator
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch import fx
from torch.distributed.tensor import Shard

from shardwise.cost.overlap import overlapped_time
from shardwise.cost.topology import MeshTopology
from shardwise.errors import UserError
from shardwise.ir.flops import is_view
from shardwise.ir.match import CollectiveKind
from shardwise.ir.trace import Phase, Traced
from shardwise.passes.remat import ACPolicy, recompute_plan
from shardwise.plan.cluster import HEAD, TAIL, regions
from shardwise.plan.costs import PlannerCosts, local_bytes
from shardwise.plan.placement import Placements, placements_str
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
FP32_BYTES = 4

_ATTENTION_FWD = frozenset({aten._scaled_dot_product_flash_attention_for_cpu.default,
                            aten._scaled_dot_product_flash_attention.default,
                            aten._scaled_dot_product_efficient_attention.default,
                            aten._scaled_dot_product_cudnn_attention.default})
_ATTENTION_BWD = frozenset({aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
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

    ac: ACPolicy = ACPolicy.NONE
    compile: bool = False
    async_tp: bool = False
    param_bytes: int | None = None
    grad_bytes: int | None = None
    optimizer_state_bytes: int = 8
    reduce_fp32: bool = False


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
    return node.target in (_ATTENTION_FWD | _ATTENTION_BWD) and bool(_schema_arg(node, "is_causal", False))


def _base(node: fx.Node) -> fx.Node:
    """The value a view chain aliases."""
    while node.op == "call_function" and is_view(node) and node.all_input_nodes:
        node = node.all_input_nodes[0]
    return node


@dataclass(frozen=True)
class _Item:
    node: fx.Node
    recompute: bool
    region: int
    phase: Phase


class _Scheduler:
    def __init__(self, traced: Traced, plan: Plan, topo: MeshTopology, opts: StepOptions) -> None:
        self.traced, self.plan, self.topo, self.opts = traced, plan, topo, opts
        self.hw = topo.hw
        self.mesh_shape = tuple(plan.mesh_shape)
        self.names = tuple(plan.mesh_names)
        self.costs = PlannerCosts(self.mesh_shape, self.hw)
        self.region = regions(traced) or {n: HEAD for n in traced.gm.graph.nodes}
        self.param_nodes = {traced.node(ph) for ph in traced.params.values()}
        self.grad_of = {traced.node(g): traced.node(traced.params[p]) for p, g in traced.grads.items()}
        self.tp = self.names.index(TP) if TP in self.names else None
        remat = recompute_plan(traced.gm, opts.ac) if traced.train else None
        self.recompute: set[fx.Node] = set(remat.recompute) if remat else set()
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

    # ---- pricing -------------------------------------------------------------------------
    def _spec(self, node: fx.Node):
        return self.plan.nodes.get(node.name)

    def _price_segments(self) -> None:
        """Memory-bound kernels as torch.compile fuses them: boundary bytes at local shapes."""
        from shardwise.passes.segment import SegClass, segment

        seg = segment(self.traced.gm)
        order = {n: i for i, n in enumerate(self.traced.gm.graph.nodes)}
        for s in seg.segments:
            if s.cls not in (SegClass.POINTWISE, SegClass.REDUCTION):
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
        the backward reads is recomputed (at no kernel of its own)."""
        fwd_fused = [n for n in self.traced.gm.graph.nodes if n in self.fused_free
                     and self.traced.phase(n) is Phase.FORWARD and 0 <= self.region.get(n, HEAD) < TAIL]
        self.recompute.update(fwd_fused)

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
        if is_causal_attention(node):
            t *= CAUSAL_WORK_FRACTION
        return t

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
                a = _base(a)
                ra = self.region.get(a, HEAD)
                if a in self.recompute and by_region.get(ra):
                    out += [_Item(m, True, ra, Phase.BACKWARD) for m in by_region.pop(ra)]
            out.append(_Item(n, False, self.region.get(n, TAIL), Phase.BACKWARD))
        for r, rest in by_region.items():  # a layer whose backward has no node of its own
            out += [_Item(m, True, r, Phase.BACKWARD) for m in rest]
        return out

    def _instance(self, u: fx.Node, reader: _Item) -> tuple:
        """Which copy of value ``u`` a reader reads: the recomputed one in the backward."""
        u = _base(u)
        rc = u in self.recompute and (reader.recompute or reader.phase is Phase.BACKWARD)
        return (u, rc)

    def _is_param(self, u: fx.Node) -> bool:
        return _base(u) in self.param_nodes

    def _move_key(self, u: fx.Node, dst: Placements, reader: _Item) -> tuple:
        if self._is_param(u):
            # FSDP2 reshards after forward: the backward gathers the parameter again. Views of
            # one parameter (its transposes) share one gather: the same bytes arrive.
            base = _base(u)
            return (base, False, dst if u is base else self._param_view_dst(u, dst), reader.phase)
        inst = self._instance(u, reader)
        return (u, inst[1], dst, None)

    def _param_view_dst(self, u: fx.Node, dst: Placements) -> Placements:
        """The placement of the parameter itself that a view of it read in ``dst`` amounts to:
        a 2-D transpose swaps the sharded dims."""
        if u.target in (aten.t.default, aten.transpose.int) and is_view(u):
            return tuple(Shard(1 - p.dim) if isinstance(p, Shard) and p.dim in (0, 1) else p for p in dst)
        return dst

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
        """Time of the matmuls that read ``u`` (directly or through views): what an all_gather
        of ``u`` fuses with."""
        total, stack = 0.0, list(u.users)
        while stack:
            v = stack.pop()
            if is_view(v):
                stack.extend(v.users)
            elif v.target in _MATMULS and self.traced.phase(v) is item.phase:
                total += self._node_time(v, item.recompute)
        return total

    def _arrival(self, u: fx.Node, dst: Placements, item: _Item, i: int, t_c: float, gate: float = 0.0,
                 matmul_reader: bool = False) -> float:
        """When value ``u`` is available in ``dst`` to ``item``; schedules its move if needed."""
        spec_u = self._spec(u)
        key = self._move_key(u, dst, item)
        inst = (_base(u), key[1])
        src = spec_u.output[0] if spec_u is not None else dst
        if src == dst or u.op == "placeholder" and not isinstance(u.meta.get("val"), torch.Tensor):
            self.last_read[inst] = i
            return self.ready.get(inst, 0.0)
        if key in self.moved:
            self.last_read[key] = i
            return self.moved[key]
        steps = self._collective_steps(u, src, dst)
        produced = max(self.ready.get(inst, 0.0), gate)
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
        else:
            arrive = self._run_steps(u.name, steps, produced, item)
        self.moved[key] = arrive
        self.issue_index[key] = i
        self.born[key] = i
        self.last_read[key] = i
        self.last_read[inst] = max(self.last_read.get(inst, i), i)
        return arrive

    # ---- the walk ------------------------------------------------------------------------
    def run(self) -> StepSchedule:
        items = self.items()
        self.n_items = len(items)
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
            for j, u in enumerate(tensor_args(it.node)):
                if self._is_param(u) and j < len(spec.inputs) and spec.inputs[j] is not None:
                    param_reads[(it.phase, it.region)].append((u, spec.inputs[j], it, k))
        started: set[tuple[Phase, int]] = set()
        t_c = 0.0
        compute_s = recompute_s = 0.0
        for i, it in enumerate(items):
            b = (it.phase, it.region)
            kernel = not is_view(it.node) and it.node.target is not operator.getitem
            if b not in started and b in blocks and kernel:
                started.add(b)
                for blk in (b, next_block.get(b)):
                    for u, dst, reader, k in param_reads.get(blk, []) if blk else []:
                        self._arrival(u, dst, reader, k, t_c, gate=t_c)
            n = it.node
            spec = self._spec(n)
            dur = self._node_time(n, it.recompute)
            start = t_c
            if spec is not None:
                for j, u in enumerate(tensor_args(n)):
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
        static = self._static_bytes()
        peak = static + self._peak_live(len(items))
        return StepSchedule(
            events=sorted(self.events, key=lambda e: (e.stream, e.start)), step_s=step,
            compute_s=compute_s, recompute_s=recompute_s, optimizer_s=opt_s,
            comm_s=sum(e - s for s, e in comm), exposed_comm_s=exposed_time(comm, compute),
            static_bytes=static, peak_bytes=peak,
            recomputed=[n.name for n in self.traced.gm.graph.nodes if n in self.recompute])

    def _reduce_gradient(self, g: fx.Node, it: _Item, i: int, ready: float) -> None:
        param = self.grad_of[g]
        src, dst = self._spec(g).output[0], self._spec(param).output[0]
        # The stored gradient exists from here to the optimizer step (zero_grad(set_to_none)
        # frees it every step, as torchtitan does).
        self.born[("grad", param)] = i
        self.last_read[("grad", param)] = self.n_items
        if src == dst:
            return
        itemsize = g.meta["val"].element_size()
        scale = FP32_BYTES / itemsize if self.opts.reduce_fp32 else 1.0
        self._run_steps(g.name, self._collective_steps(g, src, dst, scale), ready, it)
        self.last_read[(g, False)] = i

    # ---- memory --------------------------------------------------------------------------
    def _param_elements(self) -> int:
        total = 0
        for ph in self.param_nodes:
            v = ph.meta["val"]
            total += local_bytes(v, self._spec(ph).output[0], self.mesh_shape) // v.element_size()
        return total

    def _static_bytes(self) -> int:
        total = 0.0
        for ph in self.param_nodes:
            v = ph.meta["val"]
            elems = local_bytes(v, self._spec(ph).output[0], self.mesh_shape) // v.element_size()
            per = self.opts.param_bytes or v.element_size()
            if self.traced.train:
                per += self.opts.optimizer_state_bytes
            total += elems * per
        return int(total)

    def _optimizer_time(self) -> float:
        return self.hw.memory_time(self._param_elements() * OPTIMIZER_BYTES_PER_ELEMENT) + self.hw.launch_s

    def _peak_live(self, n_items: int) -> int:
        delta = [0] * (n_items + 2)
        for key, born in self.born.items():
            size = self._key_bytes(key)
            if size == 0:
                continue
            last = self.last_read.get(key, born)
            if len(key) == 2 and isinstance(key[0], fx.Node) and key[0] in self.grad_of:
                last = born  # the gradient leaves as its reduced shard (static memory)
            delta[born] += size
            delta[last + 1] -= size
        live = peak = 0
        for d in delta:
            live += d
            peak = max(peak, live)
        return peak

    def _key_bytes(self, key: tuple) -> int:
        if key[0] == "grad":  # a parameter's stored gradient
            ph = key[1]
            v = ph.meta["val"]
            elems = local_bytes(v, self._spec(ph).output[0], self.mesh_shape) // v.element_size()
            return elems * (self.opts.grad_bytes or v.element_size())
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
                  opts: StepOptions | None = None) -> StepSchedule:
    """Lay ``plan``'s step out on streams (see the module docstring)."""
    return _Scheduler(traced, plan, topo, opts or StepOptions()).run()

