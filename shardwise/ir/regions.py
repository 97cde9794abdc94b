"""Where a joint training step's forward ends and its backward begins, the residual spine of
its forward, and which allocation a value lives in.

- ``backward_start``: the seed of autograd, the first node outside the forward (the loss and
  its ancestors, ``ir/trace.forward_nodes``) that reads a 0-dim forward tensor
  (``ones_like(loss)``). Nodes before it are the forward region (including the ``detach`` of
  values autograd keeps, which the tracer marks backward), nodes after it the backward region.
- ``spine``: the nodes every path from the step's inputs (token ids) to the loss passes
  through: the embedding, the residual stream, the head (a post-dominator chain).
- ``alias_root``: the node whose allocation a view's value shares.

These read only the graph and its ``meta["val"]``, so they work alike on a canonical graph and on
a lowered per-rank program.
"""

from __future__ import annotations

import torch
from torch import fx

from shardwise.ir.match import is_getitem
from shardwise.ir.meta import fake_value
from shardwise.ir.trace import forward_nodes


def _output(graph: fx.Graph) -> fx.Node:
    return next(n for n in reversed(graph.nodes) if n.op == "output")


def backward_start(gm: fx.GraphModule, fwd: set[fx.Node] | None = None) -> fx.Node | None:
    """The seed of the backward: the first non-forward node that reads a 0-dim forward tensor
    (``ones_like(loss)``; an alias of a forward scalar that autograd keeps, ``detach``, is not a
    seed); None when the graph has no backward (inference)."""
    fwd = forward_nodes(gm) if fwd is None else fwd
    for n in gm.graph.nodes:
        if n in fwd or n.op in ("placeholder", "output", "get_attr") or is_view_op(n):
            continue
        if any(a in fwd and a.op != "placeholder" and is_scalar(a) for a in n.all_input_nodes):
            return n
    return None


def input_placeholders(gm: fx.GraphModule) -> list[fx.Node]:
    """The placeholders of the step's inputs (not its parameters). A joint graph returns
    ``(loss, *grads)`` with one slot per parameter, and parameters are the first placeholders
    (see ``ir/trace.py``); so the inputs are the placeholders after the first ``len(outputs) - 1``."""
    out = _output(gm.graph)
    results = out.args[0] if isinstance(out.args[0], (tuple, list)) else (out.args[0],)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return placeholders[max(len(results) - 1, 0):]


def spine(region: list[fx.Node], exit_node: fx.Node, sources: list[fx.Node]) -> set[fx.Node]:
    """Nodes of ``region`` on the main chain to ``exit_node``: the longest post-dominator chain
    from one of ``sources`` (the step's inputs): from the token ids, it is the embedding, the
    residual stream, the head and the loss (placeholders themselves are not returned).

    A node ``d`` post-dominates ``n`` when every path from ``n`` to the exit passes through
    ``d``; the immediate post-dominator of ``n`` is the nearest common post-dominator of its
    users (computed in reverse topological order, walking up the tree by depth).
    """
    reach: set[fx.Node] = {exit_node}
    for n in reversed(region):
        if n.op != "get_attr" and any(u in reach for u in n.users):
            reach.add(n)
    ipdom: dict[fx.Node, fx.Node | None] = {exit_node: None}
    depth: dict[fx.Node, int] = {exit_node: 0}

    def lca(a: fx.Node, b: fx.Node) -> fx.Node:
        while a is not b:
            if depth[a] >= depth[b]:
                a = ipdom[a]
            else:
                b = ipdom[b]
        return a

    for n in reversed(region):
        if n not in reach or n is exit_node:
            continue
        users = [u for u in n.users if u in depth]
        d = users[0]
        for u in users[1:]:
            d = lca(d, u)
        ipdom[n] = d
        depth[n] = depth[d] + 1
    starts = [s for s in sources if s in depth] or [n for n in depth if n.op == "placeholder"]
    if not starts:
        return {exit_node}
    chain: set[fx.Node] = set()
    cur: fx.Node | None = max(starts, key=lambda n: depth[n])
    while cur is not None:
        if cur.op != "placeholder":
            chain.add(cur)
        cur = ipdom[cur]
    return chain


def is_scalar(node: fx.Node) -> bool:
    """The node computes a 0-dim tensor (a loss)."""
    v = fake_value(node)
    return v is not None and v.dim() == 0


def is_view_op(node: fx.Node) -> bool:
    """An ATen op whose result aliases its input (a view: ``t``, ``view``, ``detach``, ``split``...)."""
    t = node.target
    return (node.op == "call_function" and isinstance(t, torch._ops.OpOverload)
            and any(r.alias_info is not None for r in t._schema.returns))


def alias_root(node: fx.Node) -> fx.Node:
    """The node whose allocation ``node``'s value lives in: through view ops (``t``, ``view``,
    ``detach``, a ``split``'s pieces...) to the first node that allocates."""
    n = node
    while True:
        if is_getitem(n) and isinstance(n.args[0], fx.Node) and is_view_op(n.args[0]):
            n = n.args[0]
        elif is_view_op(n) and n.all_input_nodes:
            n = n.all_input_nodes[0]
        else:
            return n
