"""Shared graph-matching helpers: every pass matches through these, never through private copies.

Conventions: helpers take and return ``fx.Node``; a matcher that fails returns ``None`` (never
raises); shapes are compared as static integer tuples (a symbolic dim never matches).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable

import torch
from torch import fx

from shardwise.ir.meta import shape

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
    if not is_op(view, aten.view.default, aten._unsafe_view.default, aten.reshape.default):
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
    if not is_op(view, aten.view.default, aten._unsafe_view.default, aten.reshape.default):
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


def erase_if_dead(nodes: Iterable[fx.Node]) -> None:
    """Erase each node that no longer has users (in the given order)."""
    for n in nodes:
        if not n.users and n.op == "call_function":
            n.graph.erase_node(n)
