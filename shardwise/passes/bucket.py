"""Bucket the step's final reductions: many small all_reduce / reduce_scatter -> a few large ones.

A training step ends with one reduction per gradient (DDP: an all_reduce; FSDP: a
reduce_scatter), each a collective call with its own latency; PyTorch's DDP and FSDP2 group them
into buckets for that reason. This pass does the same to the graph::

    before                                   after
      g1 = wait(all_reduce(a, sum, grp))       flat = cat([reshape(a, [-1]), reshape(b, [-1])])
      g2 = wait(all_reduce(b, sum, grp))       r = wait(all_reduce(flat, sum, grp))
      return (..., g1, g2)                     g1 = view(slice(r, 0, 0, |a|), a.shape)
                                               g2 = view(slice(r, 0, |a|, |a|+|b|), b.shape)

A reduce_scatter bucket lays each member out as ``(W, -1)`` (rank r's chunk is row r, since c10d
scatters along dim 0) and concatenates along dim 1, so every rank receives its chunk of every
member side by side.

Safety: only collectives whose result goes straight to the graph's outputs (or through views
read only by the output, which move to just before it) are bucketed (nothing else waits for
them, so running them later changes no value), members of one bucket share kind,
reduce op, group and dtype, and a bucket runs right after the last of its members' inputs is
computed, in graph order, which every rank shares. Buckets hold at most ``bucket_bytes``
(DDP's default, 25 MiB) and follow graph order, so the first gradients reduce while later ones
are still being computed where the runtime overlaps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import fx

from shardwise.ir.match import (
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
BUCKETED_KINDS = (CollectiveKind.ALL_REDUCE, CollectiveKind.REDUCE_SCATTER)


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
    if c.kind not in BUCKETED_KINDS or c.wait is None or c.group_size is None:
        return False
    if not isinstance(c.input.meta.get("val"), torch.Tensor) or not c.wait.users:
        return False
    return all(_to_output(u) for u in c.wait.users) and len(c.op.users) == 1


def find_buckets(gm: fx.GraphModule, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[Bucket]:
    """Groups of two or more eligible collectives, in graph order, each within ``bucket_bytes``."""
    open_: dict[tuple, Bucket] = {}
    done: list[Bucket] = []
    for c in all_collectives(gm.graph):
        if not _eligible(c):
            continue
        v = _val(c.input)
        size = v.numel() * v.element_size()
        key = _key(c)
        b = open_.get(key)
        if b is not None and b.nbytes + size > bucket_bytes:
            done.append(open_.pop(key))
            b = None
        if b is None:
            b = open_[key] = Bucket(c.kind, str(c.reduce_op), c.group_name, int(c.group_size))
        b.members.append(c)
        b.nbytes += size
    done.extend(open_.values())
    return [b for b in done if len(b.members) > 1]


def _rewrite(gm: fx.GraphModule, b: Bucket, order: dict[fx.Node, int]) -> None:
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
    offset = 0
    for c in b.members:
        want = tuple(_val(c.wait).shape)
        n = math.prod(want)
        at = insert_call_after(at, aten.slice.Tensor, (flat, 0, offset, offset + n), meta_from=c.wait)
        at = insert_call_after(at, aten.view.default, (at, list(want)), meta_from=c.wait)
        offset += n
        output = next(iter(gm.graph.find_nodes(op="output")))
        for u in list(c.wait.users):
            if not _is_output(u):
                output.prepend(u)  # a view read only by the output: computed once its value is
        c.wait.replace_all_uses_with(at)
        gm.graph.erase_node(c.wait)
        gm.graph.erase_node(c.op)


def apply(gm: fx.GraphModule, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> int:
    """Bucket the output reductions of ``gm`` in place; the number of collectives merged away."""
    buckets = find_buckets(gm, bucket_bytes)
    order = topo_index(gm.graph)
    for b in buckets:
        _rewrite(gm, b, order)
    gm.graph.lint()
    gm.recompile()
    return sum(len(b.members) - 1 for b in buckets)
