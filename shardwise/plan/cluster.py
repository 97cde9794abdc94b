"""Find structurally identical regions (the decoder layers) so they share decision variables.

Each node gets a region: ``HEAD`` (before the first layer), a layer index, or ``TAIL``. Layer
parameters are recognised by their names (``...layers.<i>....``). Forward nodes take the
largest region among their inputs (so a layer's forward is what depends on its parameters and
no later ones); backward nodes take the largest region among their users (a layer's backward is
what feeds its parameters' gradients). Regions of one phase whose node sequences match (op,
target, shapes, and for each argument either its position inside the region or, for a value
from outside, just its shape) form a cluster: position ``i`` of every copy shares the variables
of position ``i`` of the first copy, its representative.

The planner then prices every graph edge on representatives, summing copies, which is exact
for the clustered problem: 32 identical layers cost one layer's variables.
"""

from __future__ import annotations

import re
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field

import torch
from torch import fx

from shardwise.ir.trace import Phase, Traced

HEAD = -1
TAIL = 1 << 30
_LAYER_RE = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)\.")


@dataclass
class Clustering:
    """``rep[node]`` is the node whose variables ``node`` uses (itself when not clustered)."""

    rep: dict[fx.Node, fx.Node]
    clusters: list[list[list[fx.Node]]] = field(default_factory=list)  # cluster -> copies -> nodes

    @property
    def representatives(self) -> list[fx.Node]:
        return list(dict.fromkeys(self.rep.values()))

    def copies(self) -> dict[fx.Node, int]:
        """How many graph nodes each representative stands for."""
        out: dict[fx.Node, int] = {}
        for r in self.rep.values():
            out[r] = out.get(r, 0) + 1
        return out


def no_clustering(gm: fx.GraphModule) -> Clustering:
    return Clustering({n: n for n in gm.graph.nodes if n.op != "output"})


def _param_layer(name: str) -> int | None:
    m = _LAYER_RE.search(name)
    return int(m.group(1)) if m else None


def regions(traced: Traced) -> dict[fx.Node, int]:
    """Region of every node: HEAD, a layer index or TAIL (see module docstring)."""
    gm = traced.gm
    ph_param = traced.param_of_placeholder()
    layer_of_param = {n: _param_layer(p) for n, p in ph_param.items()}
    layered = [v for v in layer_of_param.values() if v is not None]
    if not layered:
        return {}
    order = list(traced.params)
    first_layer_pos = min(i for i, p in enumerate(order) if _param_layer(p) is not None)
    region: dict[fx.Node, int] = {}
    nodes = [n for n in gm.graph.nodes if n.op != "output"]
    for n in nodes:  # forward: max over inputs
        if n.op == "placeholder":
            p = ph_param.get(n.name)
            if p is None:
                region[n] = HEAD
            elif layer_of_param[n.name] is not None:
                region[n] = layer_of_param[n.name]
            else:
                region[n] = HEAD if order.index(p) < first_layer_pos else TAIL
        elif traced.phase(n) is Phase.FORWARD:
            region[n] = max((region[a] for a in n.all_input_nodes), default=HEAD)
    grad_region = {g: region[traced.node(traced.params[p])] for p, g in traced.grads.items()}
    for n in reversed(nodes):  # backward: max over users
        if n in region:
            continue
        vals = [region[u] for u in n.users if u in region and traced.phase(u) is Phase.BACKWARD]
        if n.name in grad_region:
            vals.append(grad_region[n.name])
        region[n] = max(vals, default=TAIL)
    return region


def _arg_signature(a, pos: dict[fx.Node, int]):
    """An argument as the signature sees it: a node inside the region by its position, one
    outside by its shape (copies read different but like-shaped values from outside), anything
    else as itself."""
    if isinstance(a, fx.Node):
        if a in pos:
            return ("in", pos[a])
        av = a.meta.get("val")
        return ("ext", tuple(av.shape) if isinstance(av, torch.Tensor) else None)
    if isinstance(a, (list, tuple)):
        return tuple(("in", pos[x]) if isinstance(x, fx.Node) and x in pos else
                     ("ext",) if isinstance(x, fx.Node) else x for x in a)
    return a


def _signature(group: list[fx.Node], pinned: Mapping[str, Hashable]) -> tuple:
    pos = {n: i for i, n in enumerate(group)}
    sig = []
    for n in group:
        v = n.meta.get("val")
        shp = tuple(v.shape) if isinstance(v, torch.Tensor) else None
        args = tuple(_arg_signature(a, pos) for a in n.args)
        # Keyword arguments too (an attention mask passed as attn_mask= is a node like any other).
        kwargs = tuple(sorted((k, str(_arg_signature(a, pos))) for k, a in n.kwargs.items()))
        sig.append((n.op, str(n.target) if n.op != "placeholder" else "param", shp, args, kwargs,
                    pinned.get(n.name)))
    return tuple(sig)


def cluster(traced: Traced, pinned: Mapping[str, Hashable] | None = None) -> Clustering:
    """Cluster identical layers of ``traced`` (forward and backward separately). ``pinned``
    maps placeholder names to what fixes them (a user constraint, a baseline's placement):
    layers whose parameters are pinned differently are not identical, since a representative's
    choice is every copy's."""
    pinned = pinned or {}
    result = no_clustering(traced.gm)
    region = regions(traced)
    groups: dict[tuple[Phase, int], list[fx.Node]] = {}
    for n in traced.gm.graph.nodes:
        if n in region and region[n] not in (HEAD, TAIL):
            groups.setdefault((traced.phase(n), region[n]), []).append(n)
    by_sig: dict[tuple, list[list[fx.Node]]] = {}
    for (_phase, _layer), nodes in sorted(groups.items(), key=lambda kv: (kv[0][0].value, kv[0][1])):
        by_sig.setdefault((_phase, _signature(nodes, pinned)), []).append(nodes)
    index = {n: i for i, n in enumerate(traced.gm.graph.nodes)}
    for copies in by_sig.values():
        if len(copies) < 2:
            continue
        # The earliest copy in graph order represents the others, so a representative's
        # producers always have their own representatives planned before it.
        copies.sort(key=lambda c: index[c[0]])
        result.clusters.append(copies)
        # Each position is represented by its earliest copy in graph order, so strategies and
        # variables are built for a representative before its copies. (Regions interleave: a
        # forward value the backward saves, e.g. GPT-2's detached activations, sits in the graph
        # among the forward nodes, in the reverse order of its layer's backward region.)
        for position in zip(*copies, strict=True):
            r = min(position, key=index.__getitem__)
            for n in position:
                result.rep[n] = r
    return result
