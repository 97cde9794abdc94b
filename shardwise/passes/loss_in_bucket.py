"""Reduce the loss with the gradients: its all_reduce joins the gradient bucket reduced last.

A data-parallel step reduces two things over the same ranks: the loss (one number, for the
user) and the gradients (which ``bucket`` has grouped into flat buffers). Each collective call
pays its own launch and its own wait: on gloo, launching an all_reduce took ~0.15 ms of CPU in
llama-tiny's ddp step, a step of ~18 ms whose DDP counterpart issues one collective. Nothing in
the step reads the reduced loss (``simplify`` has moved the backward's seed, a ``ones_like``,
onto the local loss), so it can travel in the last bucket::

    before                                    after
      r = all_reduce(loss, avg, grp)
      ...backward...                            l1 = view(loss, [1])
      flat = cat([g1, g2])                      flat = cat([g1, g2, l1, ones_like(l1)])
      b = wait(all_reduce(flat, sum, grp))      b = wait(all_reduce(flat, sum, grp))
      g1 = view(slice(b, 0, 0, n1), ...)        g1 = view(slice(b, 0, 0, n1), ...)   (unchanged)
                                                s = slice(b, 0, n, n + 2)
      return (wait(r), g1, ...)                 return (div(select(s, 0, 0), select(s, 0, 1)), g1, ...)

A sum needs no count (the loss alone joins). Safety: the loss's reduction is a functional
all_reduce (sum or avg) of a 0-dim tensor, read only by the graph's output; the bucket is
a functional all_reduce with op sum over the same group, of the same dtype, of a ``cat`` along
dim 0 read by nothing else, and it comes after the loss in graph order (the loss is computed
before its cat). The loss goes at the end of the buffer, so every member keeps its offset and
its bits. An average is the sum over the sum of one 1 per rank (the group's size, exactly, with
no need to know it here), which is how c10d's ``all_reduce(avg)`` gets it: a sum divided by the
size. A loss kept for another reader, or a bucket of another group or dtype, is left alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from shardwise.ir.match import (
    Collective,
    CollectiveKind,
    all_collectives,
    insert_call_after,
    is_op,
    topo_index,
)
from shardwise.ir.meta import fake_value

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
_LOSS_OPS = ("sum", "avg")


@dataclass(frozen=True)
class Match:
    loss: Collective  # the 0-dim all_reduce read only by the output
    bucket: Collective  # the sum all_reduce of a private cat it joins


def _is_loss(c: Collective) -> bool:
    val = fake_value(c.input)
    return (c.kind is CollectiveKind.ALL_REDUCE and c.op.target is c10d.all_reduce.default
            and c.reduce_op in _LOSS_OPS and c.wait is not None
            and val is not None and val.dim() == 0
            and all(u.op == "output" for u in c.wait.users))


def _is_bucket(c: Collective) -> bool:
    flat = c.input
    return (c.kind is CollectiveKind.ALL_REDUCE and c.op.target is c10d.all_reduce.default
            and c.reduce_op == "sum" and c.wait is not None and len(flat.users) == 1
            and is_op(flat, aten.cat.default) and (len(flat.args) < 2 or flat.args[1] == 0)
            and fake_value(flat) is not None and fake_value(flat).dim() == 1)


def find(gm: fx.GraphModule) -> list[Match]:
    collectives = all_collectives(gm.graph)
    order = topo_index(gm.graph)
    out = []
    for loss in filter(_is_loss, collectives):
        dtype = fake_value(loss.input).dtype
        buckets = [b for b in collectives if _is_bucket(b) and b.group_name == loss.group_name
                   and fake_value(b.input).dtype == dtype and order[b.input] > order[loss.input]]
        if buckets:
            out.append(Match(loss, max(buckets, key=lambda b: order[b.op])))
    # One loss per bucket: a second would need the first's offsets.
    seen: set[fx.Node] = set()
    return [m for m in out if not (m.bucket.op in seen or seen.add(m.bucket.op))]


def apply(gm: fx.GraphModule) -> int:
    """Move each matched loss reduction into its bucket; returns the number moved."""
    matches = find(gm)
    for m in matches:
        flat, loss, wait = m.bucket.input, m.loss.input, m.bucket.wait
        n = fake_value(flat).shape[0]
        pieces = [insert_call_after(loss, aten.view.default, (loss, [1]))]
        if m.loss.reduce_op == "avg":  # and a 1 from each rank: their count
            pieces.append(insert_call_after(pieces[0], aten.ones_like.default, (pieces[0],)))
        flat.update_arg(0, [*flat.args[0], *pieces])
        for node in (flat, m.bucket.op, wait):
            node.meta["val"] = fake_value(node).new_empty((n + len(pieces),))
        value = insert_call_after(wait, aten.slice.Tensor, (wait, 0, n, n + len(pieces)))
        total = insert_call_after(value, aten.select.int, (value, 0, 0))
        if m.loss.reduce_op == "avg":
            count = insert_call_after(total, aten.select.int, (value, 0, 1))
            total = insert_call_after(count, aten.div.Tensor, (total, count))
        m.loss.wait.replace_all_uses_with(total)
        gm.graph.erase_node(m.loss.wait)
        gm.graph.erase_node(m.loss.op)
    if matches:
        gm.recompile()
    return len(matches)
