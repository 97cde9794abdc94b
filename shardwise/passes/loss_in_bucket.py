"""Reduce the loss with the gradients: its all_reduce, and a mean's token count, join the
gradient bucket reduced last.

A data-parallel step reduces, over the same ranks, the loss (one number, for the user), the
gradients (which ``bucket`` has grouped into flat buffers) and, for a mean cross entropy, the
number of tokens counted (``early_loss_weight`` launches that one at the start: the backward
divides by it). Each collective call pays its own launch and wait, and one in the middle of the
step stops the ranks there: on two gloo ranks of a 2-core machine, removing the count's
all_reduce from llama-tiny's ddp step made it 1-2 ms faster (of ~21 ms; DDP's step issues one
collective). Nothing in the step reads the reduced loss (``simplify`` has moved the backward's
seed, a ``ones_like``, onto the local loss), so it can travel in the last bucket; and a mean's
division by the count commutes with the sum over ranks, so each rank can differentiate its
local *sum* and the gradients be divided by the count after their reduction::

    before                                       after (a mean cross entropy)
      c = count of labels                          c = count of labels
      rc = all_reduce(c, sum, grp)
      l = nll_loss_forward(x, t, None, mean)[0]    l = nll_loss_forward(x, t, None, sum)[0]
      r = all_reduce(l, avg, grp)
      gx = nll_loss_backward(.., mean, wait(rc))   gx = nll_loss_backward(.., sum, c)
      ...backward...                               flat = cat([g1, g2, view(l, [1]), view(c, [1])])
      flat = cat([g1, g2])                         b = wait(all_reduce(flat, sum, grp))
      b = wait(all_reduce(flat, sum, grp))         s = slice(b, 0, n, n + 2); N = select(s, 0, 1)
      g1 = view(slice(b, 0, 0, n1), ...)           g1 = view(slice(div(b, N), 0, 0, n1), ...)
      return (wait(r), g1, ...)                    return (div(select(s, 0, 0), N), g1, ...)

Any other loss reduced by sum or avg joins alone: the average of a mean cross entropy weighted
by each rank's token count (``global_mean_loss.weighted_loss``), any other average with a 1 from
each rank (the sum of them is the group's size). A mean cross entropy's loss becomes the global
mean, the sum of every rank's terms over all their tokens, which is what one process computes (a
mean of the ranks' means was that only when every rank counted as many tokens); gradients differ
from the scaled-first ones by rounding.

Safety: the loss's reduction is a functional all_reduce (sum or avg) of a 0-dim tensor, read
only by the graph's output; the bucket is a functional all_reduce with op sum over the same
group, of the same dtype, of a ``cat`` along dim 0 read by nothing else, and it comes after the
loss in graph order. The loss goes at the end of the buffer, so every member keeps its offset
and its bits. The mean form needs in addition: the loss is ``nll_loss_forward``'s (no class
weights, mean) read otherwise only by ``*_like`` factories (metadata); the count's all_reduce
(sum, same group) is read only by one ``nll_loss_backward`` of the same inputs; and every other
output of the graph is a view or slice of a sum all_reduce over the group, so every gradient is
divided. Where that does not hold the loss joins alone; a loss kept for another reader, or a
bucket of another group or dtype, is left alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from shardwise.ir.match import (
    LIKE_OPS,
    VIEW_OPS,
    Collective,
    CollectiveKind,
    Reduction,
    all_collectives,
    collective,
    insert_call_after,
    is_op,
    is_wait,
    mean_cross_entropy,
    move_readers_after,
    reported_loss,
    topo_index,
)
from shardwise.ir.meta import fake_value
from shardwise.passes.global_mean_loss import weighted_loss

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


@dataclass(frozen=True)
class Mean:
    """A mean cross entropy whose division moves past the gradients' reduction."""

    forward: fx.Node  # nll_loss_forward
    backward: fx.Node  # nll_loss_backward, reading the reduced count
    count: Collective  # all_reduce(sum) of the local token count
    grads: tuple[Collective, ...]  # the sum all_reduces every gradient output comes from


@dataclass(frozen=True)
class Match:
    loss: Collective  # the 0-dim all_reduce read only by the output
    bucket: Collective  # the sum all_reduce of a private cat it joins
    mean: Mean | None = None


def _is_bucket(c: Collective) -> bool:
    flat = c.input
    return (c.kind is CollectiveKind.ALL_REDUCE and c.op.target is c10d.all_reduce.default
            and c.reduce_op == "sum" and c.wait is not None and len(flat.users) == 1
            and is_op(flat, aten.cat.default) and (len(flat.args) < 2 or flat.args[1] == 0)
            and fake_value(flat) is not None and fake_value(flat).dim() == 1)


def _is_sum_reduce(c: Collective | None, group: str) -> bool:
    return (c is not None and c.kind is CollectiveKind.ALL_REDUCE and c.reduce_op == "sum"
            and c.group_name == group and c.wait is not None)


def _sum_reduce(node: object, group: str) -> Collective | None:
    """The sum all_reduce over ``group`` whose result ``node`` is (through views)."""
    while is_op(node, *VIEW_OPS):
        node = node.args[0]
    c = collective(node) if is_wait(node) else None
    return c if _is_sum_reduce(c, group) else None


def _count_reader(c: Collective, fwd: fx.Node, group: str) -> fx.Node | None:
    """The ``nll_loss_backward`` of ``fwd``'s inputs that alone reads ``c`` as its total weight,
    when ``c`` is a sum all_reduce over ``group``."""
    if not _is_sum_reduce(c, group) or len(c.wait.users) != 1:
        return None
    bw = next(iter(c.wait.users))
    ok = is_op(bw, aten.nll_loss_backward.default) and tuple(bw.args[1:6]) == tuple(fwd.args) \
        and bw.args[6] is c.wait
    return bw if ok else None


def _mean(gm: fx.GraphModule, loss: Collective, bucket: Collective, collectives: list[Collective],
          order: dict[fx.Node, int]) -> Mean | None:
    fwd = mean_cross_entropy(loss.input)
    if fwd is None:
        return None
    if any(u is not loss.op and not is_op(u, *LIKE_OPS) for u in loss.input.users):
        return None
    counts = [(c, bw) for c in collectives if (bw := _count_reader(c, fwd, loss.group_name)) is not None]
    if len(counts) != 1:
        return None
    count, backward = counts[0]
    if fake_value(count.input) is None or fake_value(count.input).dtype != fake_value(loss.input).dtype:
        return None
    outputs = [a for a in gm.graph.output_node().args[0] if isinstance(a, fx.Node) and a is not loss.wait]
    grads = [_sum_reduce(a, loss.group_name) for a in outputs]
    # Every gradient is divided once the bucket's sum (and the count in it) has arrived.
    if not outputs or any(g is None or order[g.wait] > order[bucket.wait] for g in grads):
        return None
    return Mean(fwd, backward, count, tuple(dict.fromkeys(grads)))


def find(gm: fx.GraphModule) -> list[Match]:
    collectives = all_collectives(gm.graph)
    order = topo_index(gm.graph)
    out = []
    for loss in filter(reported_loss, collectives):
        dtype = fake_value(loss.input).dtype
        buckets = [b for b in collectives if _is_bucket(b) and b.group_name == loss.group_name
                   and fake_value(b.input).dtype == dtype and order[b.input] > order[loss.input]]
        if buckets:
            last = max(buckets, key=lambda b: order[b.op])
            out.append(Match(loss, last, _mean(gm, loss, last, collectives, order)))
    # One loss per bucket: a second would need the first's offsets.
    first: dict[fx.Node, Match] = {}
    for m in out:
        first.setdefault(m.bucket.op, m)
    return list(first.values())


def apply(gm: fx.GraphModule) -> int:
    """Move each matched loss reduction into its bucket; returns the number moved."""
    matches = find(gm)
    for m in matches:
        flat, loss, wait = m.bucket.input, m.loss.input, m.bucket.wait
        n = fake_value(flat).shape[0]
        fwd = mean_cross_entropy(loss)
        if m.mean is not None:  # and each rank's token count
            count = m.mean.count.input
            pieces = [insert_call_after(loss, aten.view.default, (loss, [1])),
                      insert_call_after(count, aten.view.default, (count, [1]))]
            _differentiate_the_sum(m.mean)
        elif m.loss.reduce_op == "avg" and fwd is not None:  # weighted by each rank's token count
            pieces = list(weighted_loss(loss, fwd))
        else:
            pieces = [insert_call_after(loss, aten.view.default, (loss, [1]))]
            if m.loss.reduce_op == "avg":  # and a 1 from each rank: their count
                pieces.append(insert_call_after(pieces[0], aten.ones_like.default, (pieces[0],)))
        flat.update_arg(0, [*flat.args[0], *pieces])
        for node in (flat, m.bucket.op, wait):
            node.meta["val"] = fake_value(node).new_empty((n + len(pieces),))
        value = insert_call_after(wait, aten.slice.Tensor, (wait, 0, n, n + len(pieces)))
        total = insert_call_after(value, aten.select.int, (value, 0, 0))
        if len(pieces) == 2:
            count = insert_call_after(total, aten.select.int, (value, 0, 1))
            total = insert_call_after(count, aten.div.Tensor, (total, count))
            if m.mean is not None:
                _divide_gradients(m.mean, count, after=total, keep=value)
        m.loss.wait.replace_all_uses_with(total)
        gm.graph.erase_node(m.loss.wait)
        gm.graph.erase_node(m.loss.op)
    if matches:
        gm.recompile()
    return len(matches)


def _differentiate_the_sum(mean: Mean) -> None:
    """The loss and its backward reduce by sum over this rank's tokens; the count's own
    all_reduce goes (the count travels in the bucket)."""
    mean.forward.update_arg(3, int(Reduction.SUM))
    mean.backward.update_arg(4, int(Reduction.SUM))
    mean.backward.update_arg(6, mean.count.input)  # read by a sum's kernel for its shape only
    graph = mean.count.op.graph
    graph.erase_node(mean.count.wait)
    graph.erase_node(mean.count.op)


def _divide_gradients(mean: Mean, count: fx.Node, *, after: fx.Node, keep: fx.Node) -> None:
    """Every gradient reduction's result is read divided by the global ``count`` (``keep``, the
    loss's slice of the bucket, reads the sum)."""
    for g in mean.grads:
        after = insert_call_after(after, aten.div.Tensor, (g.wait, count))
        g.wait.replace_all_uses_with(after, delete_user_cb=lambda u, d=after: u not in (d, keep))
        # An earlier bucket's slices stood right after its own wait, before this division.
        move_readers_after(after)
