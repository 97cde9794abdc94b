"""Reduce a mean cross entropy over tokens split between ranks as the mean of all the tokens.

Data parallelism gives each rank its own tokens, and a mean loss's ``nll_loss_forward`` returns
the mean over this rank's counted tokens (those whose label is not ``ignore_index``). The
lowering reduces that the way DTensor's rule for it says, as a pending average: the mean of the
ranks' means. That is the mean over all the tokens, what one process computes, only where every
rank counts as many of them. With labels ignored unevenly (padding at -100) the step reported
another number than the loss whose gradient it computed (the backward divides by the reduced
count). Here the count travels with the loss instead::

    before                                       after
      o = nll_loss_forward(x, t, None, mean, i)    o = nll_loss_forward(x, t, None, mean, i)
      l = getitem(o, 0)                            l, c = getitem(o, 0), getitem(o, 1)
                                                   p = cat([view(mul(l, c), [1]), view(c, [1])])
      r = wait(all_reduce(l, avg, grp))            s = wait(all_reduce(p, sum, grp))
      return (r, ...)                              return (div(select(s, 0, 0), select(s, 0, 1)), ...)

The step still issues one collective for its loss, of two numbers. Where no rank counts a token
the loss is 0/0 = nan, as in one process.

Safety: ``l`` is output 0 of a mean ``nll_loss_forward`` without class weights, so its output 1
is the number of tokens counted, in ``l``'s dtype (ATen's kernels); the reduction is a
functional all_reduce (avg) whose wait only the graph's output reads (``simplify`` has moved the
backward's seed off it), so nothing else sees the change of value. ``loss_in_bucket`` runs
before this pass and already moves a data-parallel step's loss into its gradient bucket,
weighted the same way (``weighted_loss``); this pass takes the losses reduced on their own (FSDP,
tensor-parallel and ``auto`` plans).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import fx

from shardwise.ir.match import (
    Collective,
    all_collectives,
    insert_call_after,
    mean_cross_entropy,
    reported_loss,
)

aten = torch.ops.aten


@dataclass(frozen=True)
class Match:
    reduction: Collective  # all_reduce(l, avg) read only by the graph's output
    forward: fx.Node  # the mean nll_loss_forward that l is output 0 of


def find(gm: fx.GraphModule) -> list[Match]:
    out = []
    for c in all_collectives(gm.graph):
        fwd = mean_cross_entropy(c.input)
        if fwd is not None and reported_loss(c, ("avg",)):
            out.append(Match(c, fwd))
    return out


def weighted_loss(loss: fx.Node, forward: fx.Node) -> tuple[fx.Node, fx.Node]:
    """``view(mul(loss, count), [1])`` and ``view(count, [1])``, inserted after ``loss``: a mean
    cross entropy's parts whose sums over the ranks divide into the mean of all their tokens
    (``count``: ``forward``'s output 1, the tokens it counted)."""
    # A getitem of its own, right after the loss: one the graph has may come before the loss.
    count = insert_call_after(loss, operator.getitem, (forward, 1))
    weighted = insert_call_after(count, aten.mul.Tensor, (loss, count))
    num = insert_call_after(weighted, aten.view.default, (weighted, [1]))
    den = insert_call_after(num, aten.view.default, (count, [1]))
    return num, den


def apply(gm: fx.GraphModule) -> int:
    """Reduce each matched mean loss with its count; returns the number rewritten."""
    matches = find(gm)
    for m in matches:
        c = m.reduction
        num, den = weighted_loss(c.input, m.forward)
        pair = insert_call_after(den, aten.cat.default, ([num, den],))
        c.op.update_arg(0, pair)
        c.op.update_arg(1, "sum")
        for node in (c.op, c.wait):
            node.meta["val"] = pair.meta["val"].new_empty((2,))
        total = insert_call_after(c.wait, aten.select.int, (c.wait, 0, 0))
        count = insert_call_after(total, aten.select.int, (c.wait, 0, 1))
        mean = insert_call_after(count, aten.div.Tensor, (total, count))
        c.wait.replace_all_uses_with(mean, delete_user_cb=lambda u, keep=(total, count): u not in keep)
    if matches:
        gm.recompile()
    return len(matches)
