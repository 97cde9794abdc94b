"""Bucket collectives: many small all_reduce / reduce_scatter / all_gather -> a few large ones.

A training step ends with one reduction per gradient (DDP: an all_reduce; FSDP: a
reduce_scatter), and FSDP gathers every parameter shard before its use, each a collective call
with its own latency; PyTorch's DDP and FSDP2 group them into buckets for that reason. This pass
does the same to the graph. Reductions::

    before                                   after
      g1 = wait(all_reduce(a, sum, grp))       flat = cat([reshape(a, [-1]), reshape(b, [-1])])
      g2 = wait(all_reduce(b, sum, grp))       r = wait(all_reduce(flat, sum, grp))
      return (..., g1, g2)                     g1 = view(slice(r, 0, 0, |a|), a.shape)
                                               g2 = view(slice(r, 0, |a|, |a|+|b|), b.shape)

A reduce_scatter bucket lays each member out as ``(W, -1)`` (rank r's chunk is row r, since c10d
scatters along dim 0) and concatenates along dim 1, so every rank receives its chunk of every
member side by side. Parameter gathers (FSDP2's all_gather_copy_in / copy_out)::

    before                                   after (where the first member was)
      p1 = wait(all_gather(s1, W, grp))        g = wait(all_gather(cat([s1.flat, s2.flat]), W, grp))
      ...                                      p1 = reshape(view(g, [W, -1])[:, :|s1|], p1.shape)
      p2 = wait(all_gather(s2, W, grp))        p2 = reshape(view(g, [W, -1])[:, |s1|:], p2.shape)

Safety: a reduction is bucketed only when its result goes straight to the graph's outputs (or
through views read only by the output, which move to just before it): nothing else waits for it,
so running it later changes no value; its bucket runs right after the last of its members'
inputs is computed. A gather is bucketed only when it gathers a graph input (a parameter shard,
there from the start) through pure layout ops (transpose, contiguous copy), so its bucket (and
those ops) can run where the first member ran, earlier than the others needed it: every later
use still follows. Members of one bucket share kind, reduce op, group and
dtype, in graph order (which every rank shares), at most ``bucket_bytes`` each (DDP's default,
25 MiB; the first reduction bucket at most ``first_bucket_bytes``, 1 MiB, as DDP's):
consecutive gathers are the same layer's parameters, so the memory held early is one bucket, and
the first gradients reduce while later ones are still being computed (once ``sink_waits`` has
moved each bucket's wait to its reader, the step's end).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import fx

from shardwise.ir.match import (
    MARKER_OPS,
    PERMUTE_OPS,
    RESHAPE_OPS,
    Collective,
    CollectiveKind,
    all_collectives,
    insert_call_after,
    is_reshape_or_marker,
    topo_index,
)

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
# torch.nn.parallel.DistributedDataParallel's default bucket_cap_mb.
DEFAULT_BUCKET_BYTES = 25 * 2**20
# DDP's first bucket (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES): the first gradients of the
# backward reduce early, under the rest of it, instead of waiting for 25 MiB of them.
FIRST_BUCKET_BYTES = 2**20
REDUCTIONS = (CollectiveKind.ALL_REDUCE, CollectiveKind.REDUCE_SCATTER)


@dataclass
class Bucket:
    kind: CollectiveKind
    reduce_op: str
    group_name: str
    group_size: int
    members: list[Collective] = field(default_factory=list)
    nbytes: int = 0


def _val(node: fx.Node) -> torch.Tensor:
    return node.meta["val"]


def _key(c: Collective) -> tuple:
    return (c.kind, c.reduce_op, c.group_name, c.group_size, _val(c.input).dtype)


def _is_output(node: fx.Node) -> bool:
    return node.op == "output"


def _to_output(node: fx.Node) -> bool:
    """``node`` is the graph's output, or a view of the value read only by it."""
    return _is_output(node) or (is_reshape_or_marker(node) and all(_is_output(u) for u in node.users))


def _eligible(c: Collective) -> bool:
    if c.wait is None or c.group_size is None or len(c.op.users) != 1 or not c.wait.users:
        return False
    if not isinstance(c.input.meta.get("val"), torch.Tensor):
        return False
    if c.kind is CollectiveKind.ALL_GATHER:
        return _from_inputs(c.input) is not None
    return c.kind in REDUCTIONS and all(_to_output(u) for u in c.wait.users)


# Ops that lay a parameter shard out for its gather (a transposed weight gathered along dim 1 is
# transposed and copied contiguous first): pure, so they may run earlier.
_LAYOUT_OPS = RESHAPE_OPS | MARKER_OPS | PERMUTE_OPS | {aten.contiguous.default}


def _from_inputs(node: fx.Node) -> set[fx.Node] | None:
    """The layout ops between graph inputs and ``node``, or None when ``node`` is computed from
    anything else."""
    chain: set[fx.Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n.op in ("placeholder", "get_attr") or n in chain:
            continue
        if n.op != "call_function" or n.target not in _LAYOUT_OPS:
            return None
        chain.add(n)
        stack.extend(n.all_input_nodes)
    return chain


def find_buckets(gm: fx.GraphModule, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 first_bucket_bytes: int = FIRST_BUCKET_BYTES) -> list[Bucket]:
    """Groups of two or more eligible collectives, in graph order, each within ``bucket_bytes``
    (the first reduction bucket of each group within ``first_bucket_bytes``)."""
    open_: dict[tuple, Bucket] = {}
    done: list[Bucket] = []
    seen: set[tuple] = set()
    for c in all_collectives(gm.graph):
        if not _eligible(c):
            continue
        v = _val(c.input)
        size = v.numel() * v.element_size()
        key = _key(c)
        b = open_.get(key)
        first = c.kind in REDUCTIONS and key not in seen
        if b is not None and b.nbytes + size > (first_bucket_bytes if first else bucket_bytes):
            done.append(open_.pop(key))
            seen.add(key)
            b = None
        if b is None:
            b = open_[key] = Bucket(c.kind, str(c.reduce_op), c.group_name, int(c.group_size))
        b.members.append(c)
        b.nbytes += size
    done.extend(open_.values())
    return [b for b in done if len(b.members) > 1]


def _rewrite_reduction(gm: fx.GraphModule, b: Bucket, order: dict[fx.Node, int]) -> None:
    world = b.group_size
    at = max((c.input for c in b.members), key=order.__getitem__)
    flat_parts = []
    for c in b.members:
        shape = [world, -1] if b.kind is CollectiveKind.REDUCE_SCATTER else [-1]
        at = insert_call_after(at, aten.reshape.default, (c.input, shape), meta_from=c.op)
        flat_parts.append(at)
    dim = 1 if b.kind is CollectiveKind.REDUCE_SCATTER else 0
    at = insert_call_after(at, aten.cat.default, (flat_parts, dim), meta_from=b.members[-1].op)
    if b.kind is CollectiveKind.REDUCE_SCATTER:
        op = insert_call_after(at, c10d.reduce_scatter_tensor.default, (at, b.reduce_op, world, b.group_name),
                               meta_from=b.members[-1].op)
    else:
        op = insert_call_after(at, c10d.all_reduce.default, (at, b.reduce_op, b.group_name),
                               meta_from=b.members[-1].op)
    at = insert_call_after(op, c10d.wait_tensor.default, (op,), meta_from=b.members[-1].wait)
    flat = at = insert_call_after(at, aten.reshape.default, (at, [-1]), meta_from=b.members[-1].wait)
    output = next(iter(gm.graph.find_nodes(op="output")))
    offset = 0
    for c in b.members:
        want = tuple(_val(c.wait).shape)
        n = math.prod(want)
        at = insert_call_after(at, aten.slice.Tensor, (flat, 0, offset, offset + n), meta_from=c.wait)
        at = insert_call_after(at, aten.view.default, (at, list(want)), meta_from=c.wait)
        offset += n
        for u in list(c.wait.users):
            if not _is_output(u):
                output.prepend(u)  # a view read only by the output: computed once its value is
        _replace(gm, c, at)


def _rewrite_gather(gm: fx.GraphModule, b: Bucket, order: dict[fx.Node, int]) -> None:
    world = b.group_size
    first = min((c.op for c in b.members), key=order.__getitem__)
    # The shards' layout ops run before the bucket (their inputs are graph inputs); members may
    # share some (a weight transposed once, gathered in the forward and again in the backward).
    # Those already before the bucket stay (another bucket's members may read them there).
    layout = {n for c in b.members for n in _from_inputs(c.input) or [] if order[n] > order[first]}
    for n in sorted(layout, key=order.__getitem__):
        first.prepend(n)
    at = first.prev
    flat_parts = []
    for c in b.members:
        at = insert_call_after(at, aten.reshape.default, (c.input, [-1]), meta_from=first)
        flat_parts.append(at)
    at = insert_call_after(at, aten.cat.default, (flat_parts, 0), meta_from=first)
    op = insert_call_after(at, c10d.all_gather_into_tensor.default, (at, world, b.group_name),
                           meta_from=first)
    at = insert_call_after(op, c10d.wait_tensor.default, (op,), meta_from=first)
    rows = at = insert_call_after(at, aten.view.default, (at, [world, -1]), meta_from=first)
    offset = 0
    for c in b.members:
        n = _val(c.input).numel()
        at = insert_call_after(at, aten.slice.Tensor, (rows, 1, offset, offset + n), meta_from=c.wait)
        at = insert_call_after(at, aten.reshape.default, (at, list(_val(c.wait).shape)), meta_from=c.wait)
        offset += n
        _replace(gm, c, at)


def _replace(gm: fx.GraphModule, c: Collective, value: fx.Node) -> None:
    c.wait.replace_all_uses_with(value)
    gm.graph.erase_node(c.wait)
    gm.graph.erase_node(c.op)


def apply(gm: fx.GraphModule, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
          first_bucket_bytes: int = FIRST_BUCKET_BYTES) -> int:
    """Bucket the collectives of ``gm`` in place; the number of collectives merged away."""
    merged = 0
    for b in find_buckets(gm, bucket_bytes, first_bucket_bytes):
        order = topo_index(gm.graph)  # earlier buckets moved nodes
        if b.kind is CollectiveKind.ALL_GATHER:
            _rewrite_gather(gm, b, order)
        else:
            _rewrite_reduction(gm, b, order)
        merged += len(b.members) - 1
    gm.graph.lint()
    gm.recompile()
    return merged
