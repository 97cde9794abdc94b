"""Forwarding: values that every segment recomputes from graph inputs instead of reading them
from another segment through device memory.

Before -> after, for ``t1 = full([n], 1.0); t2 = x + t1; t3 = segment_set(t2); t4 = t3 + t1``::

    seg0: full, add, segment_set   out: t3, t1        seg0: full, add, segment_set   out: t3
    seg1: add                      in:  t3, t1   ->   seg1: full, add                in:  t3

Rules (a node found by a rule is *forwarded*: it belongs to no segment, and each segment that
reads it holds its own copy of it and of the forwarded nodes it reads):

(a) ``UNARY``: a unary pointwise op whose only tensor operand is a graph input or a forwarded
    value that it is the single user of (a chain of single-use unary ops; the last link may have
    many users);
(b) ``FACTORY``: a factory op (``full``, ``zeros``, ``arange``, ``*_like`` ...; never a random
    op) whose tensor operands, if any, are graph inputs or forwarded;
(c) ``BROADCAST``: a broadcast or view (``unsqueeze``, ``expand``, ``view``, ``permute`` ...)
    of a graph input or forwarded value: the segment takes the input at its own shape and
    re-applies the view.

Safety conditions (named predicates below): a forwarded node is never a graph output; rules (a)
and (c) never forward a node that feeds ``segment_set`` or that starts from a mutated input;
rules (a) and (b) never forward into a collective (it runs no arithmetic of ours);
rule (c) also refuses inputs aliased to an output and a reduce followed by a broadcast back over
the reduced dim (the allreduce pattern, which must stay in its reduction kernel). Random ops are
never forwarded.
"""

from __future__ import annotations

import enum
from collections.abc import Collection
from dataclasses import dataclass, field

from torch import fx

from shardwise.ir.flops import is_view
from shardwise.passes.segment.classify import (
    is_broadcast_view,
    is_collective,
    is_degenerate_reduce,
    is_expanding,
    is_factory,
    is_getitem,
    is_random,
    is_segment_set,
    is_unary_pointwise,
)


class ForwardKind(enum.StrEnum):
    UNARY = "unary"
    FACTORY = "factory"
    BROADCAST = "broadcast"


@dataclass
class Forwarding:
    """The forwarded nodes and the rule that forwarded each."""

    kinds: dict[fx.Node, ForwardKind] = field(default_factory=dict)

    def __contains__(self, node: object) -> bool:
        return node in self.kinds

    def counts(self) -> dict[str, int]:
        out = {k.value: 0 for k in ForwardKind}
        for k in self.kinds.values():
            out[k.value] += 1
        return out


def is_graph_input(node: fx.Node) -> bool:
    return node.op in ("placeholder", "get_attr")


def is_graph_output(node: fx.Node) -> bool:
    return any(u.op == "output" for u in node.users)


def feeds_segment_set(node: fx.Node) -> bool:
    """``node`` is read by a ``segment_set`` hint (its boundary is asked for explicitly)."""
    return any(is_segment_set(u) for u in node.users)


def feeds_collective(node: fx.Node) -> bool:
    """``node`` is read by a collective, which cannot recompute it (it runs no arithmetic of ours)."""
    return any(is_collective(u) for u in node.users)


def is_output_aliased(inp: fx.Node) -> bool:
    """The graph returns ``inp`` itself or a view of it."""
    stack, seen = [inp], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if is_graph_output(n):
            return True
        stack.extend(u for u in n.users if is_view(u) or is_getitem(u))
    return False


@dataclass
class _Chain:
    """Where a forwarded value comes from: its graph input (None for a factory) and whether a
    reduce over a size-1 dim happened on the way (then a later broadcast would re-create it)."""

    source: fx.Node | None
    reduced: bool = False


def reduces_then_broadcasts(node: fx.Node, chain: _Chain) -> bool:
    """``node`` broadcasts back a value that a reduce (over a size-1 dim) produced earlier in the chain."""
    return chain.reduced and is_expanding(node)


def find_forwarded(graph: fx.Graph, *, mutated_inputs: Collection[str] = ()) -> Forwarding:
    """Apply rules (a), (b), (c) in one pass over the nodes in graph order."""
    mutated = {n for n in graph.nodes if is_graph_input(n) and n.name in mutated_inputs}
    aliased = {n for n in graph.nodes if is_graph_input(n) and is_output_aliased(n)}
    chains: dict[fx.Node, _Chain] = {n: _Chain(n) for n in graph.nodes if is_graph_input(n)}
    fwd = Forwarding()
    for n in graph.nodes:
        if n.op != "call_function" or is_random(n) or is_graph_output(n):
            continue  # random values differ per copy; a graph output must be written anyway
        srcs = n.all_input_nodes
        if not all(s in chains for s in srcs):
            continue  # it reads a value that some segment computes
        if feeds_collective(n) and not (is_broadcast_view(n) or is_degenerate_reduce(n)):
            continue  # a collective kernel reads its operand from memory
        if is_factory(n):
            fwd.kinds[n] = ForwardKind.FACTORY
            chains[n] = _Chain(None)
            continue
        if len(srcs) != 1 or feeds_segment_set(n):
            continue  # rules (a) and (c) take one operand; segment_set asks for a real boundary
        src, chain = srcs[0], chains[srcs[0]]
        if chain.source in mutated:
            continue  # a copy read after the write-back would see the new value
        if is_unary_pointwise(n) and len(src.users) == 1:
            fwd.kinds[n] = ForwardKind.UNARY
            chains[n] = chain
        elif is_broadcast_view(n) or is_degenerate_reduce(n):
            if chain.source in aliased or reduces_then_broadcasts(n, chain):
                continue  # the view must stay where the output (or the reduction) is
            fwd.kinds[n] = ForwardKind.BROADCAST
            chains[n] = _Chain(chain.source, chain.reduced or is_degenerate_reduce(n))
    return fwd
