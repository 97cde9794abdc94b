"""Lower a plan to the program one rank runs: a graph on local shapes with real collectives.

Sketch (one node of the canonical graph, the plan says ``inputs=(S(0), R)``, ``output=(P,)``)::

    before (global, on fake tensors)          after (per rank, local shapes)
      y = mm(x, w)                              x1 = wait_tensor(all_gather_into_tensor(x, 2, "g"))
                                                ...  (whatever turns x's placement into S(0))
                                                y = mm(x1, w)

How: an ``fx.Interpreter`` runs the canonical graph on DTensors placed as the plan says. Before
each node every tensor argument is redistributed to the placement the plan chose for it; the op
then runs on DTensors (DTensor converts shape arguments of view ops to local shapes), or, for ops
DTensor has no sharding rule for (our own ``shardwise::`` ops, CPU flash attention), on the local
tensors, the result wrapped in the plan's output placement. When the op's result comes out in
another placement than the plan's, it is redistributed too (and recorded in ``unplanned``: a plan
and DTensor that disagree are a bug the consistency check reports). The whole interpretation is
traced with ``make_fx`` on local fake tensors, so the result is a plain ATen graph holding
``torch.ops._c10d_functional`` collectives and their ``wait_tensor``.

One graph for every rank: a few redistributions read the rank's mesh coordinate (``Replicate ->
Shard`` keeps one chunk; a vocab-sharded lookup masks by its offset). They are traced with
DTensor's ``compile_on_one_rank`` switched on, so the coordinate is computed at run time by
``device_mesh._runtime_compute_coordinate_on_dim`` from the process's rank instead of being baked
in; ``S(i) -> S(j)`` is one ``all_to_all_single`` (``shard_dim_all_to_all``). Collectives name
the process groups of the mesh lowered on (a fake group); the runtime renames them to the real
ones (``rename_groups``, by mesh dim). Moves DTensor refuses are done locally: ``R -> P`` keeps
``1/n`` of a sum on each rank, and DTensor's masked partial is resolved to a plain pending sum
as soon as the lookup is made (its mask would be consumed by the first of several readers).

Every graph output is delivered where the plan's sinks say (``output_sinks``): the loss
replicated, each gradient in its parameter's placement. The planner prices exactly these moves,
one per (value, placement) however many consumers read it there, which the lowering reproduces
one for one, so the collectives in ``gm`` (``SPMDProgram.collectives``) must equal
``Plan.collectives``; ``node_collectives`` attributes them to canonical-graph nodes when they do
not. An activation's move starts from the copy of it cheapest to move
(``cost/reshard.start_of_move``): the value as made, or a placement an earlier move for a reader
of the same phase reached or passed through (``(S(0), S(1)) -> (R, R)`` after ``-> (R, S(1))``
is one gather over tp of that copy), as the planner prices it.

Conditions: the plan was made for this graph (fingerprint); every ``Shard`` divides its dim
evenly (the planner only proposes such shards); a node without a plan entry is left to DTensor.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import operator
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from unittest import mock

import torch
import torch.distributed as dist
from torch import fx
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed import config as dist_config
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, placement_types
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.utils._pytree import tree_flatten, tree_unflatten

from shardwise.cost.reshard import leaves_copies, reshard_path, start_of_move
from shardwise.cost.topology import MeshTopology
from shardwise.errors import UserError
from shardwise.ir.trace import Phase, Traced
from shardwise.mesh import Mesh, destroy_world
from shardwise.plan.placement import Placements, placements_str
from shardwise.plan.plan import CollectiveCount, Plan, graph_fingerprint, tensor_args
from shardwise.stdio import quiet_logger

log = logging.getLogger(__name__)

# Views whose result depends on their input's strides (``_Lowerer._laid_out_as``).
_STRIDED_VIEWS = frozenset({torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default})
# ``SPMDProgram.node_collectives`` key of the collectives that deliver the graph's outputs.
OUTPUT_KEY = "<output>"
# How DTensor's own traced programs fetch a mesh dim's group (PyTorch 2.13; older versions, as a
# GPU image may hold, have no such op and never trace one).
_MESH_GET_GROUP = (torch.ops._dtensor.mesh_get_process_group.default
                   if hasattr(torch.ops._dtensor, "mesh_get_process_group") else None)
# The schema argument by which c10d collectives and shardwise's fused ops name their group.
GROUP_NAME_ARG = "group_name"
# DTensor warns on stderr of every move it runs as one collective per mesh dim where a flattened
# mesh would merge them; the planner prices them so (``cost/reshard.py``), and the lowering traces
# each such move once per program: the warning says nothing the plan does not.
REDISTRIBUTE_LOG = logging.getLogger("torch.distributed.tensor._redistribute")


# ---------------------------------------------------------------------------------------------
# Layouts: where a global tensor's pieces live, and how to cut and reassemble them.
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """A global tensor of ``shape``/``dtype`` held in ``placements`` over a mesh of ``mesh_shape``."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    placements: Placements
    mesh_shape: tuple[int, ...]

    def local_shape(self) -> tuple[int, ...]:
        dims = list(self.shape)
        for p, m in zip(self.placements, self.mesh_shape, strict=True):
            if isinstance(p, Shard):
                dims[p.dim % len(dims)] //= m
        return tuple(dims)

    def index(self, coord: tuple[int, ...]) -> tuple[slice, ...]:
        """Where the piece of the rank at mesh coordinate ``coord`` lies in the global tensor.

        Mesh dims cut in order, each one the chunk left by the previous (DTensor's nesting).
        """
        lo, size = [0] * len(self.shape), list(self.shape)
        for p, m, c in zip(self.placements, self.mesh_shape, coord, strict=True):
            if isinstance(p, Shard):
                d = p.dim % len(size)
                size[d] //= m
                lo[d] += c * size[d]
        return tuple(slice(a, a + n) for a, n in zip(lo, size, strict=True))

    def shard(self, full: torch.Tensor, coord: tuple[int, ...]) -> torch.Tensor:
        """The piece of ``full`` that the rank at ``coord`` holds (a copy); a ``Partial`` sum
        keeps the value on coordinate 0 of its mesh dim and zeros elsewhere."""
        t = full[self.index(coord)]
        if any(isinstance(p, Partial) and c != 0 for p, c in zip(self.placements, coord, strict=True)):
            t = torch.zeros_like(t)
        return t.contiguous().clone()

    def to_dtensor(self, local: torch.Tensor, device_mesh: DeviceMesh) -> DTensor:
        """``local`` (this rank's piece) as the DTensor of this layout on ``device_mesh``."""
        return DTensor.from_local(local, device_mesh, self.placements, run_check=False, shape=self.shape,
                                  stride=_contiguous_stride(self.shape))

    def dtensor_spec(self, device_mesh: DeviceMesh, dtype: torch.dtype) -> DTensorSpec:
        """DTensor's description of this layout: with it, ``DTensor(local, spec, requires_grad=False)``
        wraps a local piece without ``from_local``'s autograd node (for values autograd hands out
        itself, such as gradients)."""
        meta = TensorMeta(torch.Size(self.shape), _contiguous_stride(self.shape), dtype)
        return DTensorSpec(device_mesh, tuple(self.placements), tensor_meta=meta)

    def assemble(self, pieces: dict[tuple[int, ...], torch.Tensor]) -> torch.Tensor:
        """The global tensor from every coordinate's piece (inverse of ``shard``)."""
        return _assemble(self.placements, self.mesh_shape, pieces, ())


def _assemble(placements: Placements, mesh_shape: tuple[int, ...],
              pieces: dict[tuple[int, ...], torch.Tensor], prefix: tuple[int, ...]) -> torch.Tensor:
    i = len(prefix)
    if i == len(mesh_shape):
        return pieces[prefix]
    parts = [_assemble(placements, mesh_shape, pieces, (*prefix, c)) for c in range(mesh_shape[i])]
    p = placements[i]
    if isinstance(p, Shard):
        return torch.cat(parts, dim=p.dim % parts[0].dim())
    if isinstance(p, Partial):
        return torch.stack(parts).sum(0) if p.reduce_op == "sum" else _reduce(parts, p.reduce_op)
    return parts[0]


def _reduce(parts: list[torch.Tensor], op: str) -> torch.Tensor:
    stacked = torch.stack(parts)
    if op == "avg":
        return stacked.mean(0)
    if op == "max":
        return stacked.amax(0)
    if op == "min":
        return stacked.amin(0)
    raise ValueError(f"cannot reassemble a Partial({op}) tensor")


def mesh_coordinate(rank: int, mesh_shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major coordinate of ``rank`` (the layout ``Mesh.device_mesh`` uses)."""
    coord = []
    for m in reversed(mesh_shape):
        coord.append(rank % m)
        rank //= m
    return tuple(reversed(coord))


# ---------------------------------------------------------------------------------------------
# The program.
# ---------------------------------------------------------------------------------------------


@dataclass
class SPMDProgram:
    """One rank's program: ``gm`` takes the local placeholders (parameters, then inputs, in the
    traced order) and returns the local pieces of the traced outputs (``outputs`` says how each
    reassembles; ``None`` where the traced graph returned no tensor)."""

    gm: fx.GraphModule
    traced: Traced
    plan: Plan
    rank: int
    placeholders: list[Layout]
    outputs: list[Layout | None]
    group_dims: dict[str, int] = field(default_factory=dict)  # group name -> mesh dim
    unplanned: list[str] = field(default_factory=list)
    local_ops: list[str] = field(default_factory=list)
    # Collectives the lowering emitted for each node of the canonical graph (its inputs' and its
    # output's redistributions): where to look when the totals disagree with the plan.
    node_collectives: dict[str, dict[str, CollectiveCount]] = field(default_factory=dict)
    passes: list[str] = field(default_factory=list)
    rewrites: dict[str, int] = field(default_factory=dict)
    model: object | None = None  # the ModelSpec the graph was traced from, when known (runtime)

    def output_names(self) -> list[str | None]:
        """The traced graph's node name of each output (None where it returned no tensor)."""
        return [lay.name if lay is not None else None for lay in self.outputs]

    @property
    def mesh(self) -> Mesh:
        return self.plan.mesh

    @property
    def world_size(self) -> int:
        return math.prod(self.plan.mesh_shape)

    def coordinate(self, rank: int) -> tuple[int, ...]:
        return mesh_coordinate(rank, tuple(self.plan.mesh_shape))

    def param_layouts(self) -> dict[str, Layout]:
        by_node = {lay.name: lay for lay in self.placeholders}
        return {p: by_node[n] for p, n in self.traced.params.items()}

    def local_args(self, params: dict[str, torch.Tensor], inputs: tuple[torch.Tensor, ...],
                   rank: int) -> list[torch.Tensor]:
        """Cut global parameters and inputs into the pieces ``rank`` holds, in placeholder order."""
        node_of = self.traced.param_of_placeholder()
        given = dict(zip(self.traced.inputs, inputs, strict=True))
        coord = self.coordinate(rank)
        out = []
        for lay in self.placeholders:
            full = params[node_of[lay.name]] if lay.name in node_of else given[lay.name]
            out.append(lay.shard(full, coord))
        return out

    def collectives(self) -> dict[str, CollectiveCount]:
        """Collectives in ``gm`` per kind (count, bytes by the shared convention)."""
        from shardwise.runtime.counter import count_graph

        return count_graph(self.gm)

    def apply_passes(self, names: list[str]) -> dict[str, int]:
        """Run the named graph passes on ``gm`` (in place) and remember them for other ranks."""
        from shardwise.passes import run_passes

        if not names:
            return {}
        done = run_passes(self.gm, list(names))
        self.passes = [*self.passes, *names]
        for k, v in done.items():
            self.rewrites[k] = self.rewrites.get(k, 0) + v
        return done


# ---------------------------------------------------------------------------------------------
# Lowering.
# ---------------------------------------------------------------------------------------------


def _dtensor_knows(op: object) -> bool:
    """DTensor has a sharding rule for ``op`` (it can run the op on DTensors itself)."""
    prop = DTensor._op_dispatcher.sharding_propagator
    return (op in prop.op_strategy_funcs or op in prop.op_single_dim_strategy_funcs
            or op in prop.op_to_rules or op in DTensor._op_dispatcher._custom_op_handlers)


def _planner_rules() -> dict:
    """Ops the planner gave its own rule (DTensor runs them wrong or not at all)."""
    try:
        from shardwise.plan.strategies import RULES
    except ImportError:  # planner not importable: only DTensor's rules apply
        return {}
    return RULES


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(stride))


class _Lowerer(fx.Interpreter):
    """Interprets the canonical graph on DTensors, placing every value as the plan says."""

    def __init__(self, gm: fx.GraphModule, plan: Plan, mesh: DeviceMesh, device: torch.device,
                 phases: dict[str, Phase]) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.plan = plan
        self.mesh = mesh
        self.phases = phases  # node -> phase (``Traced.phases``; forward where absent)
        self.topology = MeshTopology.from_mesh(plan.mesh)
        self.device = device
        self.rules = _planner_rules()
        self.unplanned: list[str] = []
        self.local_ops: set[str] = set()
        self.placed: dict[str, tuple[Placements, ...]] = {}
        self.node_comm: dict[str, dict[str, CollectiveCount]] = {}
        # A value moved to a placement once serves every consumer that reads it there (the
        # planner prices each (value, placement) move once).
        self.moved: dict[tuple[str, Placements], object] = {}
        # An activation's copies by placement, per phase of their readers: what its moves there
        # reached or passed through (``_redistribute``).
        self.copies: dict[tuple[str, Phase], dict[Placements, DTensor]] = defaultdict(dict)

    # -- placement helpers ------------------------------------------------------------------

    def _as_dtensor(self, v: torch.Tensor) -> DTensor:
        """A plain tensor computed the same on every rank (factory ops, constants) is replicated."""
        if isinstance(v, DTensor):
            return v
        return DTensor.from_local(v, self.mesh, [Replicate()] * self.mesh.ndim, run_check=False)

    def _place(self, v: object, want: Placements | None, copies: tuple[str, Phase] | None = None) -> object:
        if not isinstance(v, torch.Tensor):
            return v
        v = self._as_dtensor(v)
        if want is None or tuple(v.placements) == tuple(want):
            return v
        v = self._to_partial(v, tuple(want))
        if tuple(v.placements) != tuple(want):
            v = self._redistribute(v, tuple(want), copies)
        return v

    def _redistribute(self, v: DTensor, want: Placements,
                      copies: tuple[str, Phase] | None = None) -> DTensor:
        """``v`` redistributed to ``want`` through the placements the planner priced the move by
        (``cost/reshard.reshard_path``: one mesh dim at a time where that is cheaper). Given
        ``copies`` (the activation ``v`` is and its reader's phase), from its copy cheapest to
        move there (``cost/reshard.start_of_move``), keeping the placements the move passes."""
        shape, itemsize = tuple(v.shape), v.element_size()
        kept = self.copies[copies] if copies is not None else {}
        start = start_of_move(tuple(v.placements), kept, want, shape, itemsize, self.topology)
        v = kept.get(start, v)
        hops, _ = reshard_path(start, want, shape, itemsize, self.topology)
        with quiet_logger(REDISTRIBUTE_LOG):
            for hop in hops:
                v = v.redistribute(self.mesh, hop)
                if copies is not None:
                    kept.setdefault(tuple(hop), v)
        return v

    def _to_partial(self, v: DTensor, want: Placements) -> DTensor:
        """Make the mesh dims where ``want`` is ``Partial`` partial, locally (DTensor refuses a
        redistribution to Partial). From a replicated value: ``sum`` keeps ``1/n`` on each rank
        (DTensor's own ``_partition_value``), ``avg``/``max``/``min`` keep the value."""
        cur = tuple(v.placements)
        dims = [i for i, (c, w) in enumerate(zip(cur, want, strict=True))
                if isinstance(w, Partial) and c != w]
        if not dims:
            return v
        # The other dims go straight to their targets first (DTensor cannot mix two kinds of
        # Partial in one placement list, so a P(max) elsewhere must be resolved before).
        mid = tuple(Replicate() if i in dims else w for i, w in enumerate(want))
        if mid != cur:
            v = self._redistribute(v, mid)
        local = v.to_local()
        for i in dims:
            if want[i].reduce_op == "sum":
                local = local / self.mesh.size(i)
        return DTensor.from_local(local, self.mesh, want, run_check=False, shape=v.shape, stride=v.stride())

    def _conform(self, node: fx.Node, v: object, want: Placements | None) -> object:
        """Bring an op's result to the plan's output placement (noting when that costs a move)."""
        if not isinstance(v, torch.Tensor):
            return v
        d = _unmask(self._as_dtensor(v))
        if want is not None and tuple(d.placements) != tuple(want):
            if isinstance(v, DTensor):
                self.unplanned.append(
                    f"{node.name}: {placements_str(d.placements)} -> {placements_str(want)}")
                log.debug("%s came out as %s, plan says %s", node.format_node(), d.placements, want)
            d = self._redistribute(d, tuple(want))
        return d

    def _place_once(self, name: str, v: object, want: Placements | None,
                    phase: Phase | None = None) -> object:
        """``_place``, reusing the result when node ``name`` was already moved to ``want``. An
        activation read in ``phase`` moves from a copy earlier moves of it made in that phase
        (``_redistribute``; not across phases: the copy would live until the backward)."""
        if want is None:
            return self._place(v, want)
        key = (name, tuple(want))
        if key not in self.moved:
            keep = phase is not None and leaves_copies(tuple(want))
            self.moved[key] = self._place(v, want, (name, phase) if keep else None)
        return self.moved[key]

    def place_output(self, v: torch.Tensor, sink: Placements | None, name: str | None = None) -> DTensor:
        """A graph output brought to its sink placement (the plan prices this edge)."""
        from shardwise.runtime.counter import CollectiveCounter

        with CollectiveCounter() as counter:
            out = self._place_once(name, v, sink) if name is not None else self._place(v, sink)
        for k, c in counter.counts.items():
            acc = self.node_comm.setdefault(OUTPUT_KEY, {})
            acc[k] = acc.get(k, CollectiveCount()) + c
        return out

    # -- nodes ------------------------------------------------------------------------------

    def run_node(self, n: fx.Node) -> object:
        from shardwise.runtime.counter import CollectiveCounter

        with CollectiveCounter() as counter:
            out = self._run_node(n)
        if counter.counts:
            self.node_comm[n.name] = counter.counts
        return out

    def _run_node(self, n: fx.Node) -> object:
        if n.op == "placeholder":
            return super().run_node(n)
        if n.op == "get_attr":
            return self._as_dtensor(super().run_node(n))
        if n.op == "output":
            return super().run_node(n)
        spec = self.plan.nodes.get(n.name)
        want_in = list(spec.inputs) if spec is not None else []
        want_out = list(spec.output) if spec is not None else []
        flat, tree = tree_flatten((n.args, n.kwargs))
        k = 0
        vals = []
        for a in flat:
            if isinstance(a, fx.Node):
                v = self.env[a]
                if isinstance(a.meta.get("val"), torch.Tensor):
                    phase = self.phases.get(n.name, Phase.FORWARD) if a.op == "call_function" else None
                    v = self._place_once(a.name, v, want_in[k] if k < len(want_in) else None, phase)
                    k += 1
                vals.append(v)
            else:
                vals.append(a)
        args, kwargs = tree_unflatten(vals, tree)
        kwargs = dict(kwargs)
        if "device" in kwargs and kwargs["device"] is not None:
            kwargs["device"] = self.device
        if n.target in _STRIDED_VIEWS and isinstance(args[0], DTensor):
            args = (self._laid_out_as(args[0], n.args[0].meta["val"]), *args[1:])
        if n.target is operator.getitem:
            out = operator.getitem(*args)
        elif n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and (
                n.target in self.rules or not _dtensor_knows(n.target)) and tensor_args(n):
            out = self._run_local(n, args, kwargs, want_out)
        else:
            out = self.call_function(n.target, args, kwargs) if n.op == "call_function" else \
                getattr(self, n.op)(n.target, args, kwargs)
        out = self._conform_all(n, out, want_out)
        self.placed[n.name] = tuple(tuple(x.placements) for x in tree_flatten(out)[0]
                                    if isinstance(x, DTensor))
        return out

    def _laid_out_as(self, v: DTensor, like: torch.Tensor) -> DTensor:
        """``v`` with its local piece laid out in memory as the traced value ``like`` is. A view
        reads its input's strides, and a move's collective returns its output contiguous: an
        attention output traced as ``(b, s, h, d)`` in memory, gathered over its heads, comes
        back laid out ``(b, h, s, d)``, which its transpose cannot view as ``(b, s, h * d)``."""
        local = v.to_local()
        laid = _same_layout(local, like)
        if laid is local:
            return v
        return DTensor.from_local(laid, self.mesh, v.placements, run_check=False, shape=like.shape,
                                  stride=like.stride())

    def _conform_all(self, n: fx.Node, out: object, want_out: list[Placements]) -> object:
        if isinstance(out, (tuple, list)):
            res = [self._conform(n, x, want_out[i] if i < len(want_out) else None) for i, x in enumerate(out)]
            return type(out)(res) if isinstance(out, tuple) else res
        return self._conform(n, out, want_out[0] if want_out else None)

    def _run_local(self, n: fx.Node, args: tuple, kwargs: dict, want_out: list[Placements]) -> object:
        """Run an op DTensor has no rule for on the local pieces; the plan says how they are placed."""
        self.local_ops.add(str(n.target))
        flat, tree = tree_flatten((args, kwargs))
        placed = [x for x in flat if isinstance(x, DTensor)]
        if not want_out:
            want_out = self._unplanned_local_output(n, [tuple(x.placements) for x in placed])
            if want_out is None:  # no plan and no rule for these inputs: run it replicated
                rep = tuple([Replicate()] * self.mesh.ndim)
                flat = [self._place(x, rep) if isinstance(x, DTensor) else x for x in flat]
                want_out = [rep] * max(1, len(tree_flatten(n.meta.get("val"))[0]))
        local = [x.to_local() if isinstance(x, DTensor) else x for x in flat]
        largs, lkwargs = tree_unflatten(local, tree)
        res = _call_local(n, largs, lkwargs)
        vals = n.meta.get("val")

        def wrap(i: int, t: object, gv: object) -> object:
            if not isinstance(t, torch.Tensor):
                return t
            if not isinstance(gv, torch.Tensor):
                return DTensor.from_local(t, self.mesh, want_out[i], run_check=False)
            # The global value's strides: DTensor checks views against them, so the local piece
            # must be laid out the same way (a kernel may lay out differently shaped inputs anew).
            t = _same_layout(t, gv)
            return DTensor.from_local(t, self.mesh, want_out[i], run_check=False, shape=gv.shape,
                                      stride=gv.stride())

        if isinstance(res, (tuple, list)):
            gvs = list(vals) if isinstance(vals, (tuple, list)) else [None] * len(res)
            return type(res)(wrap(i, t, g) for i, (t, g) in enumerate(zip(res, gvs, strict=True)))
        return wrap(0, res, vals)


    def _unplanned_local_output(self, n: fx.Node, have: list[Placements]) -> list[Placements] | None:
        """A node the plan leaves open: the planner's rule strategy that reads its inputs as they
        are (None when there is none)."""
        rule = self.rules.get(n.target)
        if rule is not None:
            choices = [[ps] for ps in have]
            for s in rule(n, choices, self.mesh):
                if list(s.inputs) == have:
                    return list(s.output)
        return None


def _call_local(n: fx.Node, args: tuple, kwargs: dict) -> object:
    """Run ``n``'s op on local tensors. A matmul-shaped einsum runs as ``torch.matmul``, which
    traces to flatten -> mm -> unflatten (what the collective-matmul pass fuses), and a weight
    gradient as one ``mm`` of its operands flattened to 2-D; traced as ``aten.einsum`` either
    would decompose into an unsqueeze/permute/bmm chain nobody matches, several ops longer."""
    from shardwise.ir.match import einsum_is_matmul, einsum_is_weight_grad

    if n.target is torch.ops.aten.einsum.default and not kwargs:
        transposed = einsum_is_matmul(args[0])
        a, b = args[1]
        if transposed is not None:
            return torch.matmul(a, b.t() if transposed else b)
        if einsum_is_weight_grad(args[0]):
            return torch.mm(a.flatten(0, -2).t(), b.flatten(0, -2))
    return n.target(*args, **kwargs)


def _unmask(d: DTensor) -> DTensor:
    """Turn DTensor's masked partial (a vocab-sharded lookup: rows this rank does not own are
    garbage until masked) into a plain pending sum right away, so every consumer may read it
    (DTensor's mask is consumed by the first reduction and would be gone for the second)."""
    from torch.distributed.tensor.placement_types import _MaskPartial

    masked = [p for p in d.placements if isinstance(p, _MaskPartial)]
    if not masked:
        return d
    local = d.to_local()
    for p in masked:
        mask = p.mask_buffer.data
        if mask is None:  # a mask shared with an earlier mesh dim: already applied and released
            continue
        keep = ~(mask if local.dim() == mask.dim() else mask.unsqueeze(-1))
        local = local * keep.to(local.dtype)
        p.mask_buffer.release_mask()
    placements = tuple(Partial(p.reduce_op) if isinstance(p, _MaskPartial) else p for p in d.placements)
    return DTensor.from_local(local, d.device_mesh, placements, run_check=False, shape=d.shape,
                              stride=d.stride())


def _layout_order(t: torch.Tensor) -> list[int]:
    """Dims from outermost to innermost in memory (stable for size-1 dims)."""
    return sorted(range(t.dim()), key=lambda d: (-t.stride(d), -d))


def _same_layout(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``t`` with its dims laid out in memory in the order ``like``'s are."""
    if t.dim() != like.dim() or t.dim() < 2:
        return t
    want, have = _layout_order(like), _layout_order(t)
    if want == have and t.is_contiguous(memory_format=torch.contiguous_format) == like.is_contiguous():
        return t
    inverse = [want.index(d) for d in range(t.dim())]
    return t.permute(want).contiguous().permute(inverse)


def _fake_mesh(mesh: Mesh, rank: int) -> DeviceMesh:
    """A DeviceMesh over a fake process group in which this process is ``rank``."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        if dist.get_backend() != "fake":
            raise RuntimeError("a real process group is active; lower on it with lower_on().")
        if dist.get_world_size() != mesh.size or dist.get_rank() != rank:
            destroy_world()
    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=mesh.size)
    return DeviceMesh("cpu", torch.arange(mesh.size).view(mesh.shape), mesh_dim_names=mesh.names)


def check_plan(traced: Traced, plan: Plan) -> None:
    """Refuse a plan made for another graph (naming the model and mesh it was made for)."""
    if plan.fingerprint != graph_fingerprint(traced.gm):
        raise UserError(f"the plan was made for another graph (model {plan.model!r}, mesh "
                        f"{'x'.join(map(str, plan.mesh_shape))}, "
                        f"{'training' if plan.train else 'inference'}); "
                        "plan this graph again.")


def lower(traced: Traced, plan: Plan, *, rank: int = 0,
          reduce_dtype: torch.dtype | None = None) -> SPMDProgram:
    """The program rank ``rank`` runs under ``plan`` (lowered on a fake process group;
    ``reduce_dtype`` as for ``lower_on``)."""
    check_plan(traced, plan)
    mesh = plan.mesh
    if not 0 <= rank < mesh.size:
        raise UserError(f"rank {rank} is outside the mesh of {mesh.size} devices.")
    return lower_on(traced, plan, _fake_mesh(mesh, rank), rank=rank, reduce_dtype=reduce_dtype)


def lower_on(traced: Traced, plan: Plan, device_mesh: DeviceMesh, *, rank: int,
             device: torch.device | str = "cpu", reduce_dtype: torch.dtype | None = None) -> SPMDProgram:
    """Lower on an existing DeviceMesh (fake or real): the collectives name its process groups.

    ``reduce_dtype``: each gradient narrower than it is cast to it before its synchronisation,
    so that the reduction sums, and the program returns, the wider values (mixed precision's
    ``reduce_dtype=float32``: a bf16 model whose fp32 master weights take fp32 gradients)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    device = torch.device(device)
    mesh_shape = tuple(plan.mesh_shape)
    layouts = _placeholder_layouts(traced, plan)
    lowerer = _Lowerer(traced.gm, plan, device_mesh, device, traced.phases)
    out_node = next(n for n in reversed(traced.gm.graph.nodes) if n.op == "output")
    out_nodes = list(out_node.args[0])
    sinks = output_sinks(traced, plan)
    grads = set(traced.grads.values())
    final: dict[int, tuple[Placements, torch.dtype]] = {}

    def step(*local: torch.Tensor) -> list[torch.Tensor | None]:
        placed = [lay.to_dtensor(t, device_mesh) for t, lay in zip(local, layouts, strict=True)]
        outs = lowerer.run(*placed)
        res = []
        for i, (v, sink) in enumerate(zip(outs, sinks, strict=True)):
            if isinstance(v, torch.Tensor):
                node = out_nodes[i]
                name = node.name if isinstance(node, fx.Node) else None
                if name in grads and _narrower(v.dtype, reduce_dtype):
                    v = _cast(lowerer._as_dtensor(v), reduce_dtype)
                v = lowerer.place_output(v, sink, name)
                final[i] = (tuple(v.placements), v.dtype)
                v = v.to_local()
            res.append(v)
        return res

    # The coordinate is read at run time (one graph serves every rank; the runtime op needs a
    # shape env for its symbolic value), and S(i) -> S(j) is one all_to_all.
    mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
    with mode, _coordinate_at_run_time(), \
            mock.patch.object(placement_types, "shard_dim_alltoall", shard_dim_all_to_all):
        fakes = [torch.empty(lay.local_shape(), dtype=lay.dtype, device=device) for lay in layouts]
        gm = make_fx(step, tracing_mode="real")(*fakes)
    _name_groups(gm, device_mesh)
    gm.graph.eliminate_dead_code()
    _drop_unused_detach(gm)
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    outputs: list[Layout | None] = []
    for i, node in enumerate(out_nodes):
        v = node.meta.get("val") if isinstance(node, fx.Node) else None
        if not isinstance(v, torch.Tensor) or i not in final:
            outputs.append(None)
            continue
        placements, dtype = final[i]
        outputs.append(Layout(node.name, tuple(v.shape), dtype, placements, mesh_shape))
    group_dims = {device_mesh.get_group(d).group_name: d for d in range(device_mesh.ndim)}
    return SPMDProgram(gm=gm, traced=traced, plan=plan, rank=rank, placeholders=layouts, outputs=outputs,
                       group_dims=group_dims, unplanned=lowerer.unplanned,
                       local_ops=sorted(lowerer.local_ops),
                       node_collectives=lowerer.node_comm)


def _narrower(dtype: torch.dtype, than: torch.dtype | None) -> bool:
    return than is not None and dtype.is_floating_point and dtype.itemsize < than.itemsize


def _cast(v: DTensor, dtype: torch.dtype) -> DTensor:
    """``v`` in ``dtype``, its placements kept: a cast of each rank's term of a pending sum is the
    cast of its terms (a float-to-float cast commutes with the sum, DTensor's own rule)."""
    return DTensor.from_local(v.to_local().to(dtype), v.device_mesh, v.placements, run_check=False,
                              shape=v.shape, stride=v.stride())


def output_sinks(traced: Traced, plan: Plan) -> list[Placements | None]:
    """The placement each graph output is delivered in (the plan's sink edges): the loss
    replicated, a gradient in its parameter's placement, anything else as its node computes it
    (``None``: as it comes)."""
    out_node = next(n for n in reversed(traced.gm.graph.nodes) if n.op == "output")
    ndim = len(plan.mesh_shape)
    param_of_grad = {g: p for p, g in traced.grads.items()}
    node_of_param = traced.params
    sinks: list[Placements | None] = []
    for r in out_node.args[0]:
        if not isinstance(r, fx.Node):
            sinks.append(None)
        elif traced.train and r.name == traced.loss:
            sinks.append(tuple([Replicate()] * ndim))
        elif r.name in param_of_grad:
            p = param_of_grad[r.name]
            ph = plan.nodes.get(node_of_param[p])
            sinks.append(tuple(plan.params[p]) if p in plan.params else (ph.output[0] if ph else None))
        else:
            spec = plan.nodes.get(r.name)
            sinks.append(tuple(spec.output[0]) if spec is not None and spec.output else None)
    return sinks


@contextlib.contextmanager
def _coordinate_at_run_time() -> Iterator[None]:
    """Make DTensor's redistributions read the rank's mesh coordinate through a runtime op.

    ``compile_on_one_rank`` does that, but globally it also routes every sharding-propagation
    cost estimate through the op (thousands of dead traced calls, minutes on a small model), so
    it is switched on only while a local tensor is actually being redistributed.
    """
    from torch.distributed.tensor import _api, _dispatch, _redistribute

    inner = _redistribute.redistribute_local_tensor

    @functools.wraps(inner)
    def redistribute_local_tensor(*args, **kwargs):
        with dist_config.patch(compile_on_one_rank=True):
            return inner(*args, **kwargs)

    # One read of the coordinate per mesh and dim for the whole program: it is the rank's, the
    # same at every read. DTensor reads it again at each redistribution, each read a runtime op
    # with a constant of its own (37 of each in llama-tiny's fsdp_tp_sp step over 2x2).
    sym_coordinate = DeviceMesh._sym_get_coordinate
    read: dict[tuple, object] = {}

    def coordinate_once(mesh: DeviceMesh, index: int):
        if not dist_config.compile_on_one_rank:  # a concrete coordinate, outside a redistribution
            return sym_coordinate(mesh, index)
        # By the ranks the mesh lays out, not by the object: DTensor hands over equal meshes
        # as different objects.
        with unset_fake_temporarily():
            key = (tuple(mesh.mesh.shape), tuple(mesh.mesh.flatten().tolist()), index)
        if key not in read:
            read[key] = sym_coordinate(mesh, index)
        return read[key]

    with contextlib.ExitStack() as stack:
        for module in (_redistribute, _dispatch, _api):
            if hasattr(module, "redistribute_local_tensor"):
                stack.enter_context(mock.patch.object(module, "redistribute_local_tensor",
                                                      redistribute_local_tensor))
        stack.enter_context(mock.patch.object(DeviceMesh, "_sym_get_coordinate", coordinate_once))
        yield


def shard_dim_all_to_all(local: torch.Tensor, gather_dim: int, shard_dim: int, mesh: DeviceMesh,
                         mesh_dim: int) -> torch.Tensor:
    """``Shard(gather_dim) -> Shard(shard_dim)`` over one mesh dim as one ``all_to_all_single``.

    Stands in for DTensor's version, which on CPU all-gathers and keeps this rank's chunk (a
    rank-specific graph, and an all_gather where the plan counts an all_to_all) and elsewhere
    calls an opaque op. Rank ``j`` is sent the ``j``-th piece along ``shard_dim``; the pieces
    received, in rank order, are concatenated along ``gather_dim``.
    """
    from torch.distributed import _functional_collectives as funcol

    world = mesh.size(mesh_dim)
    send = torch.stack(local.chunk(world, dim=shard_dim))
    got = funcol.all_to_all_single(send, None, None, group=(mesh, mesh_dim))
    if isinstance(got, funcol.AsyncCollectiveTensor):
        got = got.wait()
    return torch.cat(got.unbind(0), dim=gather_dim).contiguous()


def _name_groups(gm: fx.GraphModule, device_mesh: DeviceMesh) -> None:
    """Replace ``_dtensor.mesh_get_process_group(mesh, d)`` by the group's name (a string), the
    form every pass and ``ir.match`` read, and drop the mesh object from the graph."""
    for n in list(gm.graph.nodes):
        if n.op == "call_function" and n.target is _MESH_GET_GROUP:
            name = device_mesh.get_group(int(n.args[1])).group_name
            n.replace_all_uses_with(name)  # type: ignore[arg-type]
            gm.graph.erase_node(n)
    for n in list(gm.graph.nodes):
        if n.op == "get_attr" and not n.users:
            gm.graph.erase_node(n)
            if hasattr(gm, str(n.target)) and not isinstance(getattr(gm, str(n.target)), torch.Tensor):
                delattr(gm, str(n.target))


def _drop_unused_detach(gm: fx.GraphModule) -> None:
    """Erase ``detach_`` nodes nobody reads: DTensor leaves them on constants it lifts, they only
    touch autograd metadata, and being in-place they would survive dead-code elimination."""
    for n in list(gm.graph.nodes):
        if n.op == "call_function" and n.target is torch.ops.aten.detach_.default and not n.users:
            gm.graph.erase_node(n)


def rename_groups(gm: fx.GraphModule, names: dict[str, str]) -> int:
    """Point every op that takes a process group by name (c10d collectives, shardwise's fused
    ops: the schema argument ``group_name``) at another group (``old name -> new name``); the
    count."""
    done = 0
    for n in gm.graph.nodes:
        schema = getattr(n.target, "_schema", None) if n.op == "call_function" else None
        if schema is None:
            continue
        at = next((i for i, a in enumerate(schema.arguments) if a.name == GROUP_NAME_ARG), None)
        if at is None:
            continue
        if at < len(n.args) and str(n.args[at]) in names:
            n.args = (*n.args[:at], names[str(n.args[at])], *n.args[at + 1:])
            done += 1
        elif str(n.kwargs.get(GROUP_NAME_ARG)) in names:
            n.kwargs = {**n.kwargs, GROUP_NAME_ARG: names[str(n.kwargs[GROUP_NAME_ARG])]}
            done += 1
    gm.recompile()
    return done


def _placeholder_layouts(traced: Traced, plan: Plan) -> list[Layout]:
    node_of = traced.param_of_placeholder()
    mesh_shape = tuple(plan.mesh_shape)
    rep: Placements = tuple([Replicate()] * len(mesh_shape))
    out = []
    for n in traced.gm.graph.nodes:
        if n.op != "placeholder":
            continue
        v = n.meta["val"]
        ps: Placements | None = None
        if n.name in node_of and node_of[n.name] in plan.params:
            ps = plan.params[node_of[n.name]]
        elif n.name in plan.nodes:
            ps = plan.nodes[n.name].output[0]
        ps = tuple(ps) if ps is not None else rep
        _check_even(n.name, tuple(v.shape), ps, mesh_shape)
        out.append(Layout(n.name, tuple(v.shape), v.dtype, ps, mesh_shape))
    return out


def _check_even(name: str, shape: tuple[int, ...], ps: Placements, mesh_shape: tuple[int, ...]) -> None:
    """Every Shard of a placeholder divides its dim evenly (else ranks would hold unequal pieces)."""
    dims = list(shape)
    for p, m in zip(ps, mesh_shape, strict=True):
        if isinstance(p, Shard):
            d = p.dim % len(dims) if -len(dims) <= p.dim < len(dims) else None
            if d is None:
                raise UserError(f"{name} has {len(dims)} dims and cannot be sharded on dim {p.dim} "
                                f"(placement {placements_str(ps)}).")
            if dims[d] % m:
                raise UserError(f"{name} of shape {list(shape)} cannot be split {m} ways along dim {d} "
                                f"(placement {placements_str(ps)}); use a mesh that divides it.")
            dims[d] //= m

