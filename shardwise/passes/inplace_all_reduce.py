"""Reduce a private buffer in place: ``all_reduce(x)`` -> ``all_reduce_(x)`` when nothing else
reads ``x``.

c10d's functional ``all_reduce`` leaves its input untouched, so it first copies it and reduces
the copy. When the input is a buffer that the program has just computed and reads nowhere else
(a gradient bucket's ``cat``, a weight gradient's ``mm``), that copy is pure overhead: on a
DDP-style step it copies every gradient once more. DDP reduces its buckets in place::

    before                                   after
      flat = cat([g1, g2])                     flat = cat([g1, g2])
      r = all_reduce(flat, sum, grp)           r = all_reduce_(flat, sum, grp)
      y = wait(r)                              y = wait(r)

Safety: ``x`` is the output of an op that allocates it (its schema returns no alias of an
input, and the op writes nothing in place), so no other tensor shares its storage; the
collective is ``x``'s only reader, so overwriting ``x`` with the sum changes no value that any
other op sees. Graph inputs, constants and views are never reduced in place (another tensor, or
the next step, may read them). The result is the same tensor ``all_reduce`` would have returned,
so the wait and everything after it are unchanged.

The rewritten graph mutates a buffer, so this is a runtime pass: it runs last on a bound
program, after every pass that expects a functional graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from shardwise.ir.match import CollectiveKind, all_collectives, writes_in_place

c10d = torch.ops._c10d_functional


def _allocates(node: fx.Node) -> bool:
    """``node``'s value is a tensor it allocated: an op whose schema aliases no input."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    returns = target._schema.returns
    return (len(returns) == 1 and returns[0].alias_info is None and not writes_in_place(node)
            and isinstance(node.meta.get("val"), torch.Tensor))


@dataclass(frozen=True)
class InPlaceReduce:
    op: fx.Node  # the functional all_reduce
    buffer: fx.Node  # its input, read by nothing else


def find(gm: fx.GraphModule) -> list[InPlaceReduce]:
    return [InPlaceReduce(c.op, c.input) for c in all_collectives(gm.graph)
            if c.kind is CollectiveKind.ALL_REDUCE and c.op.target is c10d.all_reduce.default
            and len(c.input.users) == 1 and _allocates(c.input)]


def apply(gm: fx.GraphModule) -> int:
    """Reduce each private buffer in place; returns the number of all_reduces rewritten."""
    matches = find(gm)
    for m in matches:
        m.op.target = c10d.all_reduce_.default
    if matches:
        gm.recompile()
    return len(matches)
