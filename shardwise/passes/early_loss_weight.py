"""Count a mean loss's tokens from the labels, at the start of the step, so that the all_reduce
of that count runs under the forward instead of stopping every rank between forward and backward.

A data-parallel step's mean cross entropy divides by the number of counted tokens of the whole
batch: each rank's ``nll_loss_forward`` returns its own count (``total_weight``), the program
all_reduces it, and ``nll_loss_backward`` reads the sum. Launched right after the loss, that
all_reduce is waited for right away: a synchronisation of every rank in the middle of the step.
The count depends only on the labels::

    before                                         after
                                                   c = sum(ne(target, ignore)).to(x.dtype)
                                                   r = all_reduce(c, sum)        (at the start)
      ...forward...                                ...forward...
      out = nll_loss_forward(x, target, None, mean, ignore)
      r = all_reduce(getitem(out, 1), sum)
      g = nll_loss_backward(..., wait(r))          g = nll_loss_backward(..., wait(r))

Safety: with no class weights and mean reduction, ``total_weight`` is exactly the number of
targets not equal to ``ignore_index``, in the input's dtype (ATen's NLLLoss kernels); other
weights or reductions are left alone. The count is taken over the labels before any reshape (a
count does not depend on the shape). Its ops and the collective go just after the labels are
computed (for labels that are a graph input, right after the inputs); every rank moves the same
collective to the same place, so ranks still issue their collectives in one order. The wait
stays where it was.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from shardwise.ir.match import (
    CollectiveKind,
    Reduction,
    collective,
    insert_call_after,
    is_getitem,
    is_op,
    source_through_reshapes,
)

aten = torch.ops.aten


@dataclass(frozen=True)
class Match:
    loss: fx.Node  # nll_loss_forward
    weight_out: fx.Node  # getitem(loss, 1)
    reduction: fx.Node  # the all_reduce of the count


def find(gm: fx.GraphModule) -> list[Match]:
    out = []
    for node in gm.graph.nodes:
        if not is_op(node, aten.nll_loss_forward.default):
            continue
        _x, target, weight, reduction, _ignore = node.args
        if weight is not None or reduction != Reduction.MEAN or not isinstance(target, fx.Node):
            continue
        for g in node.users:
            if not is_getitem(g, 1):
                continue
            for u in g.users:
                c = collective(u)
                if c is not None and c.op is u and c.kind is CollectiveKind.ALL_REDUCE \
                        and c.reduce_op == "sum":
                    out.append(Match(node, g, u))
    return out


def apply(gm: fx.GraphModule) -> int:
    """Rewrite every match in place; returns how many."""
    matches = find(gm)
    for m in matches:
        x, target, _w, _r, ignore = m.loss.args
        dtype = x.meta["val"].dtype
        # A count is the same over any reshape of the labels: count their source.
        labels, _ = source_through_reshapes(target, single_user=False)
        anchor = labels
        if labels.op == "placeholder":  # after every placeholder: the graph's inputs come first
            anchor = list(gm.graph.find_nodes(op="placeholder"))[-1]
        at = insert_call_after(anchor, aten.ne.Scalar, (labels, ignore), meta_from=m.weight_out)
        at = insert_call_after(at, aten.sum.default, (at,), meta_from=m.weight_out)
        count = insert_call_after(at, aten._to_copy.default, (at,), {"dtype": dtype}, meta_from=m.weight_out)
        m.reduction.replace_input_with(m.weight_out, count)
        count.append(m.reduction)
    if matches:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return len(matches)
