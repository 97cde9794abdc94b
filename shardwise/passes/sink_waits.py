"""Sink each collective's wait to just before the first op that reads its result.

A lowered program waits for a collective right after launching it, so the caller blocks while
the collective runs though the next ops do not need its result. Launched where it is and waited
for where it is needed, the collective runs under the ops in between (the backward after the
loss's all_reduce, the rest of the step after a gradient bucket's)::

    before                                   after
      r = all_reduce(x)                        r = all_reduce(x)
      y = wait(r)                              a = f(...)
      v = view(y, ...)                         b = g(a)
      a = f(...)                               y = wait(r)
      b = g(a)                                 v = view(y, ...)
      out = h(v, b)                            out = h(v, b)

Moved: waits, and the pure layout ops (reshapes, slices, transposes) that read a moved node, so
that they keep following it; each goes just before its earliest user. Safety: a wait returns
its collective's result and has no other effect, and the layout ops are pure, so running them
later changes no value; every user still comes after what it reads (the graph is walked from
its end, so a node's users are already in their final place when it moves). Nothing moves
before its inputs, nor past an op that writes in place (the collective may still be reading
the buffer it writes). The collective itself stays where it was launched: every rank issues its
collectives in the same order as before.
"""

from __future__ import annotations

import torch
from torch import fx

from shardwise.ir.match import PERMUTE_OPS, RESHAPE_OPS, is_op, is_wait, writes_in_place

aten = torch.ops.aten
# Pure ops that only relabel their input's memory: moving them costs nothing.
_LAYOUT_OPS = (*RESHAPE_OPS, *PERMUTE_OPS, aten.slice.Tensor, aten.squeeze.dims, aten.unsqueeze.default)


def _sink_point(node: fx.Node) -> fx.Node | None:
    """The earliest of ``node``'s users in graph order (they all come after it), or an earlier
    op that writes in place (a collective may still be reading the buffer it writes)."""
    users = set(node.users)
    cur = node.next
    while cur.op != "root":
        if cur in users or writes_in_place(cur):
            return cur
        cur = cur.next
    return None


def apply(gm: fx.GraphModule) -> int:
    """Sink waits (and the layout ops reading them) in place; returns the number moved."""
    sinking: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if is_wait(node) or (is_op(node, *_LAYOUT_OPS) and any(a in sinking for a in node.all_input_nodes)):
            sinking.add(node)
    moved = 0
    for node in reversed(list(gm.graph.nodes)):
        if node not in sinking:
            continue
        first = _sink_point(node)
        if first is not None and first is not node.next:
            first.prepend(node)
            moved += 1
    if moved:
        gm.recompile()
    return moved
