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
    c10d.all_gather_into_tensor.default: CollectiveKind.ALL_GATHER,
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
