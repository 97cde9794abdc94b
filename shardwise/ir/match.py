"""Shared graph-matching helpers: every pass matches through these, never through private copies.

Conventions: helpers take and return ``fx.Node``; a matcher that fails returns ``None`` (never
raises); shapes are compared as static integer tuples (a symbolic dim never matches).
"""

from __future__ import annotations

import operator
from collections.abc import Container, Iterable

import torch
from torch import fx

from shardwise.ir.meta import fake_value, shape

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def is_op(node: object, *targets: object) -> bool:
    """``node`` is a call_function of one of ``targets`` (OpOverload or OpOverloadPacket)."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return False
    t = node.target
    packet = getattr(t, "overloadpacket", None)
    return any(t is x or (packet is not None and packet is x) for x in targets)


def is_getitem(node: object, index: int | None = None) -> bool:
    return (isinstance(node, fx.Node) and node.op == "call_function" and node.target is operator.getitem
            and (index is None or node.args[1] == index))


def single_user(node: fx.Node) -> fx.Node | None:
    """The only user of ``node``, or None when it has zero or several."""
    return next(iter(node.users)) if len(node.users) == 1 else None


def users_of(node: fx.Node, *targets: object) -> list[fx.Node]:
    return [u for u in node.users if is_op(u, *targets)]


def arg_node(node: fx.Node, i: int = 0) -> fx.Node | None:
    a = node.args[i] if i < len(node.args) else None
    return a if isinstance(a, fx.Node) else None


def is_graph_output(node: fx.Node) -> bool:
    return any(u.op == "output" for u in node.users)


def is_flatten(view: fx.Node) -> tuple[int, ...] | None:
    """``view`` is a canonical flatten ``[*b, K] -> [prod(b), K]``; returns ``b`` (rank(b) >= 1).

    Accepts ``view``, ``_unsafe_view`` and ``reshape``; both shapes must be static.
    """
    if not is_op(view, *RESHAPE_OPS):
        return None
    src = arg_node(view)
    if src is None:
        return None
    ins, outs = shape(src), shape(view)
    if ins is None or outs is None or len(ins) < 3 or len(outs) != 2:
        return None
    batch = ins[:-1]
    prod = 1
    for d in batch:
        prod *= d
    if outs != (prod, ins[-1]):
        return None
    return batch


def is_unflatten(view: fx.Node, batch: tuple[int, ...]) -> bool:
    """``view`` turns ``[prod(batch), N]`` back into ``[*batch, N]``."""
    if not is_op(view, *RESHAPE_OPS):
        return False
    src = arg_node(view)
    ins, outs = (shape(src) if src is not None else None), shape(view)
    if ins is None or outs is None or len(ins) != 2:
        return False
    prod = 1
    for d in batch:
        prod *= d
    return ins[0] == prod and outs == (*batch, ins[1])


def is_transpose_2d(node: fx.Node) -> bool:
    """``t(x)``, ``transpose(x, 0, 1)`` or ``permute(x, [1, 0])`` of a 2-D tensor."""
    src = arg_node(node)
    if src is None or shape(src) is None or len(shape(src)) != 2:
        return False
    if is_op(node, aten.t.default):
        return True
    if is_op(node, aten.transpose.int):
        return sorted(d % 2 for d in node.args[1:3]) == [0, 1]
    if is_op(node, aten.permute.default):
        return list(node.args[1]) == [1, 0]
    return False


def topo_index(graph: fx.Graph) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(graph.nodes)}


def depends_on(node: fx.Node, ancestor: fx.Node, stop_before: int | None = None,
               order: dict[fx.Node, int] | None = None) -> bool:
    """``node`` is ``ancestor`` or reads it, transitively. ``order`` lets the search prune nodes
    that come before ``ancestor`` in the graph (they cannot depend on it)."""
    seen: set[fx.Node] = set()
    stack = [node]
    lo = order[ancestor] if order is not None else None
    while stack:
        n = stack.pop()
        if n is ancestor:
            return True
        if n in seen or (lo is not None and order.get(n, lo + 1) < lo):
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return False


def input_closure(nodes: Iterable[fx.Node], within: Container[fx.Node]) -> set[fx.Node]:
    """The nodes of ``within`` that ``nodes`` read, directly or through other nodes of ``within``."""
    out: set[fx.Node] = set()
    stack = [p for n in nodes for p in n.all_input_nodes if p in within]
    while stack:
        p = stack.pop()
        if p in out:
            continue
        out.add(p)
        stack.extend(q for q in p.all_input_nodes if q in within)
    return out


def erase_if_dead(nodes: Iterable[fx.Node]) -> None:
    """Erase each node that no longer has users (in the given order)."""
    for n in nodes:
        if not n.users and n.op == "call_function":
            n.graph.erase_node(n)


def move_readers_after(node: fx.Node) -> None:
    """Move every node that reads ``node``, directly or through others, and stands before it in
    the graph to just after it, in their order (a rewrite that made ``node`` a new input of
    earlier nodes). Their other inputs stood before them, so they still do. Nodes compare by
    their place in the graph (fx keeps the order keys), so no walk of the whole graph per call."""
    early: set[fx.Node] = set()
    stack = [u for u in node.users if u < node]
    while stack:
        u = stack.pop()
        if u not in early:
            early.add(u)
            stack.extend(v for v in u.users if v < node)
    at = node
    for u in sorted(early):
        at.append(u)
        at = u


def cast_dtype(node: object) -> torch.dtype | None:
    """The target dtype of a pure dtype cast (``_to_copy`` with no other effect), else None."""
    if not is_op(node, aten._to_copy.default):
        return None
    extra = set(node.kwargs) - {"dtype", "layout", "device"}
    v, src = fake_value(node), fake_value(arg_node(node))
    if extra or v is None or src is None or v.device != src.device:
        return None
    return node.kwargs.get("dtype")


def through_casts(node: fx.Node | None) -> fx.Node | None:
    """``node`` before any pure dtype casts (``cast_dtype``) that lead to it."""
    while node is not None and cast_dtype(node) is not None:
        node = arg_node(node)
    return node


def mul_other(mul: fx.Node, one: fx.Node) -> fx.Node | None:
    """The other operand of ``mul(one, other)`` / ``mul(other, one)``."""
    if not is_op(mul, aten.mul.Tensor) or len(mul.args) != 2:
        return None
    a, b = mul.args
    if a is one and isinstance(b, fx.Node):
        return b
    if b is one and isinstance(a, fx.Node):
        return a
    return None


# ---------------------------------------------------------------------------------------------
# Collectives: torch.ops._c10d_functional ops and their wait_tensor.
# ---------------------------------------------------------------------------------------------

import enum  # noqa: E402
from dataclasses import dataclass  # noqa: E402


class CollectiveKind(enum.Enum):
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    BROADCAST = "broadcast"


# c10d functional op -> kind, and the positional index of its group-size argument (None: derive
# from the group name).
C10D_KINDS: dict[object, CollectiveKind] = {
    c10d.all_reduce.default: CollectiveKind.ALL_REDUCE,
    c10d.all_reduce_.default: CollectiveKind.ALL_REDUCE,  # in place (``inplace_all_reduce``)
    c10d.all_gather_into_tensor.default: CollectiveKind.ALL_GATHER,
    c10d.all_gather_into_tensor_out.default: CollectiveKind.ALL_GATHER,  # into a buffer (``all_gather_out``)
    c10d.reduce_scatter_tensor.default: CollectiveKind.REDUCE_SCATTER,
    c10d.all_to_all_single.default: CollectiveKind.ALL_TO_ALL,
    c10d.broadcast.default: CollectiveKind.BROADCAST,
}


@dataclass(frozen=True)
class Collective:
    """One c10d functional collective: its op node, the ``wait_tensor`` that yields its value, and
    the group it runs over."""

    kind: CollectiveKind
    op: fx.Node
    wait: fx.Node | None
    input: fx.Node
    group_name: str
    group_size: int | None
    reduce_op: str | None = None

    @property
    def value(self) -> fx.Node:
        """The node whose value is the collective's result (the wait when there is one)."""
        return self.wait if self.wait is not None else self.op


def is_wait(node: object) -> bool:
    return is_op(node, c10d.wait_tensor.default)


def group_size_of(op: fx.Node) -> int | None:
    """World size of a collective's group, from its args or the registered group name."""
    kind = C10D_KINDS[op.target]
    if kind in (CollectiveKind.ALL_GATHER, CollectiveKind.REDUCE_SCATTER):
        return int(op.args[1]) if kind is CollectiveKind.ALL_GATHER else int(op.args[2])
    try:
        from torch.distributed.distributed_c10d import _resolve_process_group

        return _resolve_process_group(op.args[-1]).size()
    except Exception:  # the group is not registered in this process (a graph loaded elsewhere)
        return None


def collective(node: fx.Node) -> Collective | None:
    """Recognise a c10d functional collective from its op node or its ``wait_tensor``."""
    wait = None
    if is_wait(node):
        wait, node = node, arg_node(node)
        if node is None:
            return None
    if not isinstance(node, fx.Node) or node.op != "call_function" or node.target not in C10D_KINDS:
        return None
    if wait is None:
        wait = next((u for u in node.users if is_wait(u)), None)
    kind = C10D_KINDS[node.target]
    inp = arg_node(node)
    if inp is None:
        return None
    reduce_op = None
    if kind is CollectiveKind.ALL_REDUCE:
        reduce_op = node.args[1]
    elif kind is CollectiveKind.REDUCE_SCATTER:
        reduce_op = node.args[1]
    return Collective(kind, node, wait, inp, str(node.args[-1]), group_size_of(node), reduce_op)


def all_collectives(graph: fx.Graph) -> list[Collective]:
    return [c for n in graph.nodes if (c := collective(n)) is not None and c.op is n]


# ---------------------------------------------------------------------------------------------
# Collective values: an all_gather / reduce_scatter along any dim, in every form it takes.
#
# c10d only gathers and scatters along dim 0. Along dim d the graph holds a reassembly:
#   all_gather on d:     y = wait(all_gather(x)); cat([chunk_0(y), ..., chunk_{W-1}(y)], dim=d)
#   reduce_scatter on d: wait(reduce_scatter(cat([chunk_0(m, d), ..., chunk_{W-1}(m, d)], dim=0)))
# where chunk_r is rank r's slice, written as slice/narrow, or split/split_with_sizes/chunk +
# getitem (the form torch.distributed._functional_collectives emits). A reassembly counts only when
# its pieces tile the dim exactly into W equal chunks in rank order; anything else is a different
# value (e.g. the seed's two narrows at W=4 each span two ranks, so the cat is not a per-rank one).
# ---------------------------------------------------------------------------------------------

# slice.Tensor's default end (and what `x[a:]` records): "to the end of the dim".
_SLICE_TO_END = 2**63 - 1
_SPLIT_OPS = (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default)


@dataclass(frozen=True)
class Piece:
    """A contiguous range ``[start, start + length)`` of ``source`` along ``dim``; ``nodes`` are
    the nodes that cut it (a slice, or a split and its getitems)."""

    source: fx.Node
    dim: int
    start: int
    length: int
    nodes: tuple[fx.Node, ...]


def _norm_dim(dim: int, rank: int) -> int | None:
    return dim % rank if -rank <= dim < rank else None


def _split_ranges(sizes: list[int]) -> list[tuple[int, int]]:
    out, start = [], 0
    for s in sizes:
        out.append((start, s))
        start += s
    return out


def piece_of(node: object) -> Piece | None:
    """Recognise ``node`` as a contiguous range of another tensor along one dim (step 1)."""
    if not isinstance(node, fx.Node):
        return None
    if is_op(node, aten.slice.Tensor, aten.narrow.default):
        src = arg_node(node)
        shp = shape(src) if src is not None else None
        if shp is None or not shp:
            return None
        args = list(node.args) + [None] * (5 - len(node.args))
        dim = _norm_dim(int(node.kwargs.get("dim", args[1] if args[1] is not None else 0)), len(shp))
        if dim is None:
            return None
        n = shp[dim]
        if is_op(node, aten.narrow.default):
            start, length = int(args[2]), int(args[3])
            start = start + n if start < 0 else start
        else:
            start = node.kwargs.get("start", args[2])
            end = node.kwargs.get("end", args[3])
            step = node.kwargs.get("step", args[4] if args[4] is not None else 1)
            if step != 1 or not all(isinstance(v, int | type(None)) for v in (start, end)):
                return None
            start = 0 if start is None else (start + n if start < 0 else start)
            end = n if end is None or end >= _SLICE_TO_END else (end + n if end < 0 else end)
            start, end = max(0, min(start, n)), max(0, min(end, n))
            length = end - start
        if length <= 0 or start + length > n:
            return None
        return Piece(src, dim, start, length, (node,))
    if is_getitem(node):
        split = arg_node(node)
        if split is None or not is_op(split, *_SPLIT_OPS):
            return None
        src = arg_node(split)
        shp = shape(src) if src is not None else None
        if shp is None or not shp:
            return None
        dim = _norm_dim(int(split.kwargs.get("dim", split.args[2] if len(split.args) > 2 else 0)), len(shp))
        if dim is None:
            return None
        n = shp[dim]
        if is_op(split, aten.split_with_sizes.default):
            sizes = [int(s) for s in split.args[1]]
        else:
            size = int(split.args[1])
            if is_op(split, aten.chunk.default):  # chunk(n, c) cuts pieces of ceil(n / c)
                size = -(-n // size)
            sizes = [min(size, n - s) for s in range(0, n, size)] if size > 0 else []
        ranges = _split_ranges(sizes)
        i = node.args[1]
        if sum(sizes) != n or not isinstance(i, int) or not 0 <= i < len(ranges):
            return None
        start, length = ranges[i]
        # Every getitem of the split belongs to the cut (unused ones are left by tracing).
        getitems = tuple(u for u in split.users if is_getitem(u))
        return Piece(src, dim, start, length, (split, *getitems))
    return None


def tiles_in_rank_order(pieces: list[Piece], source: fx.Node, dim: int, world: int) -> bool:
    """``pieces`` are exactly ``source`` cut along ``dim`` into ``world`` equal chunks, in rank order."""
    shp = shape(source)
    if shp is None or world < 1 or len(pieces) != world or shp[dim] % world:
        return False
    chunk = shp[dim] // world
    return all(p.source is source and p.dim == dim and p.start == r * chunk and p.length == chunk
               for r, p in enumerate(pieces))


def _cat_parts(node: fx.Node) -> tuple[list[object], int] | None:
    """``cat``'s tensor list and its normalised dim."""
    if not is_op(node, aten.cat.default):
        return None
    tensors = list(node.args[0])
    dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0)
    shp = shape(node)
    if shp is None or not shp:
        return None
    d = _norm_dim(int(dim), len(shp))
    return (tensors, d) if d is not None else None


def _unique(nodes: Iterable[fx.Node]) -> tuple[fx.Node, ...]:
    return tuple(dict.fromkeys(nodes))


@dataclass(frozen=True)
class GatherMatch:
    """``value_node`` holds ``all_gather(collective.input)`` along ``dim``; ``nodes`` are every node
    that computes it (the collective, its wait, the reassembly), ``value_node`` last."""

    dim: int
    collective: Collective
    value_node: fx.Node
    nodes: tuple[fx.Node, ...]

    @property
    def input(self) -> fx.Node:
        return self.collective.input

    @property
    def group_size(self) -> int | None:
        return self.collective.group_size


@dataclass(frozen=True)
class ScatterMatch:
    """``value_node`` holds ``reduce_scatter(input_value)`` along ``dim`` with ``reduce_op``;
    ``nodes`` are every node between (the reassembly, the collective, its wait)."""

    dim: int
    collective: Collective
    input_value: fx.Node
    value_node: fx.Node
    reduce_op: str
    nodes: tuple[fx.Node, ...]

    @property
    def group_size(self) -> int | None:
        return self.collective.group_size


def gathered_value(node: fx.Node) -> GatherMatch | None:
    """Recognise ``node`` as an all_gather along some dim: an all_gather's ``wait_tensor`` (dim 0),
    or a ``cat`` on dim d of that wait's per-rank chunks, in rank order (dim d)."""
    if is_wait(node):
        c = collective(node)
        if c is None or c.kind is not CollectiveKind.ALL_GATHER:
            return None
        return GatherMatch(0, c, node, (c.op, node))
    parts = _cat_parts(node)
    if parts is None:
        return None
    tensors, cat_dim = parts
    pieces = [piece_of(t) for t in tensors]
    if not pieces or any(p is None for p in pieces):
        return None
    src = pieces[0].source
    c = collective(src) if is_wait(src) else None
    if c is None or c.kind is not CollectiveKind.ALL_GATHER or c.wait is not src or c.group_size is None:
        return None
    if not tiles_in_rank_order(pieces, src, 0, c.group_size):
        return None
    cut = [n for p in pieces for n in p.nodes]
    return GatherMatch(cat_dim, c, node, _unique([c.op, src, *cut, node]))


def scattered_value(node: fx.Node) -> ScatterMatch | None:
    """Recognise a reduce_scatter (its op or its wait) along some dim: dim 0 of its input, or dim d
    of ``m`` when its input is a dim-0 ``cat`` of ``m``'s per-rank chunks along d, in rank order."""
    c = collective(node)
    if c is None or c.kind is not CollectiveKind.REDUCE_SCATTER or c.wait is None:
        return None
    z = c.input
    parts = _cat_parts(z)
    if parts is not None and parts[1] == 0 and c.group_size is not None:
        pieces = [piece_of(t) for t in parts[0]]
        if pieces and all(p is not None for p in pieces):
            src, dim = pieces[0].source, pieces[0].dim
            if tiles_in_rank_order(pieces, src, dim, c.group_size):
                cut = [n for p in pieces for n in p.nodes]
                return ScatterMatch(dim, c, src, c.wait, str(c.reduce_op),
                                    _unique([*cut, z, c.op, c.wait]))
    return ScatterMatch(0, c, z, c.wait, str(c.reduce_op), (c.op, c.wait))


def gathered_values(graph: fx.Graph) -> list[GatherMatch]:
    """Every all_gather value in the graph, along every dim it is reassembled to (graph order)."""
    return [m for n in graph.nodes if (is_wait(n) or is_op(n, aten.cat.default))
            and (m := gathered_value(n)) is not None]


def scattered_values(graph: fx.Graph) -> list[ScatterMatch]:
    """Every reduce_scatter in the graph, with the dim and value it scatters (graph order)."""
    return [m for c in all_collectives(graph) if (m := scattered_value(c.op)) is not None]


def only_used_within(nodes: Iterable[fx.Node], exit: fx.Node | None = None) -> bool:
    """Every node in ``nodes`` except ``exit`` has users only inside ``nodes`` (so erasing the set
    after replacing ``exit`` loses no value anyone else reads)."""
    inside = set(nodes)
    return all(u in inside for n in inside if n is not exit for u in n.users)


# ---------------------------------------------------------------------------------------------
# Value-preserving chains and the sequence dim (used by the sequence-parallel pass).
# ---------------------------------------------------------------------------------------------

# Ops that return their input's value unchanged (a copy or an alias): they may sit between a
# producer and its consumer without changing what the consumer computes.
MARKER_OPS = frozenset({aten.alias.default, aten.detach.default, aten.clone.default})
# Row-major reshapes: any chain of them equals one reshape of the chain's source to its last shape.
RESHAPE_OPS = frozenset({aten.view.default, aten._unsafe_view.default, aten.reshape.default})


# Dim reorders (a transpose is a permute of two dims).
PERMUTE_OPS = frozenset({aten.permute.default, aten.t.default, aten.transpose.int})
# Ops whose output is a view of their input: two with the same arguments are the same tensor.
VIEW_OPS = frozenset({*RESHAPE_OPS - {aten.reshape.default}, *PERMUTE_OPS, aten.expand.default,
                      aten.unsqueeze.default, aten.squeeze.dims, aten.slice.Tensor})
# Factories that read only their input's shape, dtype and device, never its values.
LIKE_OPS = frozenset({aten.ones_like.default, aten.zeros_like.default, aten.empty_like.default,
                      aten.full_like.default})


class Reduction(enum.IntEnum):
    """A loss's ``reduction`` argument as ATen takes it (torch.nn._reduction)."""

    NONE = 0
    MEAN = 1
    SUM = 2


def reported_loss(c: Collective, reduce_ops: tuple[str, ...] = ("sum", "avg")) -> bool:
    """``c`` is a functional all_reduce (by one of ``reduce_ops``) of a 0-dim value whose result
    only the graph's output reads: a loss reduced for the user, which nothing in the step waits for."""
    val = fake_value(c.input)
    return (c.op.target is c10d.all_reduce.default and c.reduce_op in reduce_ops and c.wait is not None
            and val is not None and val.dim() == 0 and all(u.op == "output" for u in c.wait.users))


def mean_cross_entropy(loss: object) -> fx.Node | None:
    """The ``nll_loss_forward`` whose output 0 ``loss`` is, where it takes the mean without class
    weights (its output 1, ``total_weight``, is then the number of tokens it counted); else None."""
    fwd = loss.args[0] if is_getitem(loss, 0) else None
    if is_op(fwd, aten.nll_loss_forward.default) and fwd.args[2] is None and fwd.args[3] == Reduction.MEAN:
        return fwd
    return None


# In-place ops that change only autograd's flag, never data (a program runs without autograd).
AUTOGRAD_ONLY_INPLACE_OPS = frozenset({aten.detach_.default})


def schema_arg(node: fx.Node, name: str, default: object = None) -> object:
    """The value of the schema argument ``name`` of an OpOverload call (its default if absent)."""
    if name in node.kwargs:
        return node.kwargs[name]
    for i, a in enumerate(node.target._schema.arguments):
        if a.name == name:
            return node.args[i] if i < len(node.args) else (a.default_value if a.has_default_value()
                                                               else default)
    return default


# The fused attention kernels' dropout probability (their schemas name it so).
DROPOUT_ARG = "dropout_p"


def draws_random(node: object) -> bool:
    """``node`` draws from the random generator: a seeded random op, an attention kernel only
    with a dropout probability (it is tagged random for its dropout)."""
    t = getattr(node, "target", None)
    if not isinstance(t, torch._ops.OpOverload) or torch.Tag.nondeterministic_seeded not in t.tags:
        return False
    return schema_arg(node, DROPOUT_ARG) not in (0, 0.0)


def writes_in_place(node: fx.Node) -> bool:
    """``node`` writes one of its inputs' data (its schema marks an input mutable)."""
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    return schema is not None and schema.is_mutable and node.target not in AUTOGRAD_ONLY_INPLACE_OPS


def is_reshape_or_marker(node: object) -> bool:
    """``node`` is a row-major reshape or a value-preserving marker (its value is its input's)."""
    return is_op(node, *RESHAPE_OPS, *MARKER_OPS)


def source_through_reshapes(node: fx.Node, *, single_user: bool = True) -> tuple[fx.Node, list[fx.Node]]:
    """Walk up from ``node`` through reshapes and markers: ``(source, chain)``.

    ``chain`` lists the walked nodes from ``node`` upward (the value of ``node`` is
    ``reshape(source, shape(node))``). With ``single_user`` the walk stops at a node that has
    other users too, so every node in the chain exists only to feed ``node``.
    """
    chain: list[fx.Node] = []
    cur = node
    while is_reshape_or_marker(cur) and (not single_user or len(cur.users) <= 1 or cur is node):
        src = arg_node(cur)
        if src is None:
            break
        chain.append(cur)
        cur = src
    return cur, chain


def seq_dim(full_shape: tuple[int, ...] | None) -> int | None:
    """The sequence (token) dim of an activation: 1 of ``[B, S, H]``, 0 of ``[S, H]`` / ``[B*S, H]``."""
    if full_shape is None:
        return None
    return {3: 1, 2: 0}.get(len(full_shape))


def token_layout(full_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape with leading size-1 dims dropped (keeping two): ``[1, S, H]`` and ``[S, H]``
    split their tokens over ranks the same way along their sequence dims, ``[B, S, H]`` with
    ``B > 1`` and ``[B*S, H]`` do not."""
    dims = tuple(full_shape)
    while len(dims) > 2 and dims[0] == 1:
        dims = dims[1:]
    return dims


def seq_local_shape(full_shape: tuple[int, ...], parts: int) -> tuple[int, ...] | None:
    """Shape of one rank's slice when ``full_shape`` is split ``parts`` ways along its sequence
    dim; None when it has no sequence dim or the split is not even."""
    d = seq_dim(full_shape)
    if d is None or parts < 1 or full_shape[d] % parts:
        return None
    return (*full_shape[:d], full_shape[d] // parts, *full_shape[d + 1:])


def infer_fake_val(node: fx.Node) -> None:
    """Set ``node.meta['val']`` by running its target on its inputs' fake values."""
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._pytree import tree_map

    vals = [n.meta.get("val") for n in node.all_input_nodes]
    try:
        mode = detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    except AssertionError:  # values from several fake modes (make_fx in real mode makes one each)
        mode = None
    if mode is None:
        mode = FakeTensorMode(allow_non_fake_inputs=True)

    def fake(a):
        if isinstance(a, fx.Node):
            a = a.meta.get("val")
        if isinstance(a, torch.Tensor) and getattr(a, "fake_mode", None) is not mode:
            with mode:
                a = torch.empty_strided(tuple(a.shape), tuple(a.stride()), dtype=a.dtype, device=a.device)
        return a

    args, kwargs = tree_map(fake, (node.args, node.kwargs), is_leaf=lambda a: isinstance(a, fx.Node))
    with mode:
        node.meta["val"] = node.target(*args, **kwargs)


def insert_call_after(prev: fx.Node, target: object, args: tuple, kwargs: dict | None = None,
                      *, meta_from: fx.Node | None = None) -> fx.Node:
    """A new ``call_function`` right after ``prev``, with its fake value computed and the kept meta
    keys (``seq_nr``, stack, module stack) of ``meta_from``. Chain calls on the returned node to
    build a sequence in order."""
    from shardwise.ir.meta import KEPT_KEYS, VAL

    with prev.graph.inserting_after(prev):
        node = prev.graph.call_function(target, tuple(args), kwargs or {})
    if meta_from is not None:
        node.meta.update({k: meta_from.meta[k] for k in KEPT_KEYS if k != VAL and k in meta_from.meta})
    infer_fake_val(node)
    return node


def _two_operands(equation: str) -> tuple[str, str, str] | None:
    """``"a,b->out"`` without ellipses as ``(a, b, out)``, else None."""
    eq = equation.replace(" ", "")
    if "->" not in eq or "." in eq:
        return None
    lhs, out = eq.split("->")
    ops = lhs.split(",")
    return (ops[0], ops[1], out) if len(ops) == 2 else None


def einsum_is_weight_grad(equation: str) -> bool:
    """``"bsn,bsk->nk"``: both operands share their leading (batch) dims, which are summed out,
    leaving their last dims side by side: a linear layer's weight gradient, one ``mm`` of the
    two flattened to 2-D (``a.flatten(0, -2).t() @ b.flatten(0, -2)``)."""
    parsed = _two_operands(equation)
    if parsed is None:
        return False
    a, b, out = parsed
    return (len(a) == len(b) >= 2 and a[:-1] == b[:-1] and len(set(a + b[-1])) == len(a) + 1
            and out == a[-1] + b[-1])


def einsum_is_matmul(equation: str) -> bool | None:
    """``"...k,kn->...n"`` -> False, ``"...k,nk->...n"`` -> True (b transposed), else None."""
    parsed = _two_operands(equation)
    if parsed is None:
        return None
    a, b, out = parsed
    if len(b) != 2 or not a or len(set(a + out)) != len(a) + 1 or len(set(b)) != 2:
        return None
    k = a[-1]
    n = b[1] if b[0] == k else b[0] if b[1] == k else None
    if n is None or n in a or out != a[:-1] + n:
        return None
    return b[1] == k


# ---------------------------------------------------------------------------------------------
# Matmul forms (the collective-matmul pass fuses these; the step schedule prices the fusion)
# ---------------------------------------------------------------------------------------------

class MatmulForm(enum.Enum):
    MM = "mm"  # aten.mm(a, b), 2-D a
    EINSUM = "einsum"  # aten.einsum("...k,kn->...n" or "...k,nk->...n", [a, b])
    FLATTEN_MM = "flatten_mm"  # mm(view(a, [prod(batch), K]), b) [-> view(., [*batch, N])]


@dataclass(frozen=True)
class Matmul:
    """``out`` holds ``a @ b`` (after ``b.t()`` when ``transpose_b``), computed by ``nodes``.

    ``out`` is ``[*batch, N]`` except for a flatten -> mm without unflatten, where it is the 2-D mm.
    """

    form: MatmulForm
    a: fx.Node
    b: fx.Node
    out: fx.Node
    nodes: tuple[fx.Node, ...]
    transpose_b: bool = False


def _mm_2d(node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    if not is_op(node, aten.mm.default):
        return None
    a, b = arg_node(node, 0), arg_node(node, 1)
    return (a, b) if a is not None and b is not None else None


def matmul_at(node: fx.Node) -> Matmul | None:
    """The matmul whose output is ``node``: an mm, a matmul einsum, or flatten -> mm -> unflatten."""
    if is_op(node, aten.einsum.default):
        tensors = list(node.args[1])
        tb = einsum_is_matmul(node.args[0])
        if tb is None or len(tensors) != 2 or not all(isinstance(t, fx.Node) for t in tensors):
            return None
        return Matmul(MatmulForm.EINSUM, tensors[0], tensors[1], node, (node,), tb)
    mm = arg_node(node) if is_op(node, *RESHAPE_OPS) else None
    if mm is not None and _mm_2d(mm) is not None and single_user(mm) is node:
        flat = _mm_2d(mm)[0]
        batch = is_flatten(flat)
        if batch is not None and is_unflatten(node, batch):
            return Matmul(MatmulForm.FLATTEN_MM, arg_node(flat), _mm_2d(mm)[1], node, (node, mm, flat))
    pair = _mm_2d(node)
    if pair is None:
        return None
    return Matmul(MatmulForm.MM, pair[0], pair[1], node, (node,))


def matmuls_reading(value: fx.Node) -> list[Matmul]:
    """Every matmul that reads ``value`` as its left operand, directly or through a flatten."""
    found = []
    for u in value.users:
        if is_identity_view(u):  # a reshape to the same shape (lowering leaves these): see through
            found.extend(matmuls_reading(u))
            continue
        if is_op(u, aten.mm.default, aten.einsum.default):
            m = matmul_at(u)
            if m is not None and m.a is value:
                found.append(m)
        elif is_flatten(u) is not None:
            for mm in u.users:
                pair = _mm_2d(mm)
                if pair is None or pair[0] is not u:
                    continue
                after = single_user(mm)
                m = matmul_at(after) if after is not None else None
                if m is not None and m.form is MatmulForm.FLATTEN_MM and m.nodes[1] is mm:
                    found.append(m)
                else:  # a flatten -> mm whose 2-D output is read as is
                    found.append(Matmul(MatmulForm.FLATTEN_MM, value, pair[1], mm, (mm, u)))
    return [m for m in found if b_is_matrix(m)]


def is_identity_view(node: fx.Node) -> bool:
    """A reshape whose output has its input's shape: the same value."""
    src = arg_node(node) if is_op(node, *RESHAPE_OPS) else None
    return src is not None and shape(src) is not None and shape(src) == shape(node)


def b_is_matrix(m: Matmul) -> bool:
    """``m``'s right operand is a 2-D matrix (a weight), as the fused kernels take it."""
    s = shape(m.b)
    return s is not None and len(s) == 2
