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
for the clustered problem: 32 identical layers cost one layer's variables. A layer whose nodes
all but line up with a cluster's joins it (``cluster``): the positions it lines up with share
the cluster's variables, its other nodes keep their own; two such layers pair up.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field

import torch
from torch import fx

from shardwise.ir.match import is_getitem
from shardwise.ir.regions import alias_root, is_view_op
from shardwise.ir.trace import Phase, Traced
from shardwise.plan.plan import tensor_args

HEAD = -1
TAIL = 1 << 30
_LAYER_RE = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)\.")


@dataclass
class Clustering:
    """``rep[node]`` is the node whose variables ``node`` uses (itself when not clustered)."""

    rep: dict[fx.Node, fx.Node]
    # cluster -> copies -> nodes (a copy that joined without matching exactly, ``cluster``, holds
    # only the nodes that line up with the cluster's positions)
    clusters: list[list[list[fx.Node]]] = field(default_factory=list)

    @property
    def representatives(self) -> list[fx.Node]:
        return list(dict.fromkeys(self.rep.values()))

    def copies(self) -> dict[fx.Node, int]:
        """How many graph nodes each representative stands for."""
        out: dict[fx.Node, int] = {}
        for r in self.rep.values():
            out[r] = out.get(r, 0) + 1
        return out


def keeps_gathered(region: int, last_layer: int | None) -> bool:
    """FSDP2 keeps the blocks of ``region`` gathered from the forward to the backward: the root
    (everything outside the decoder layers) and, as torchtitan sets reshard_after_forward=False
    for it, the last layer (``last_layer``, the largest layer region)."""
    return not 0 <= region < TAIL or region == last_layer


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
    choice is every copy's.

    A layer that matches no other exactly joins a cluster of its phase where nearly all its
    nodes line up with the cluster's (``_align``), or pairs with a layer that matches no other
    either: the last layer's backward lacks the add that sums the residual's gradient with the
    next layer's. The last layer's parameter ends keep their own variables (below). On
    llama3-8b over 8x8 that takes the ILP from 109,370 to 87,312 columns with 32 layers (14.6 ->
    10.2 s to plan) and from 107,977 to 87,297 with 2 (15.2 -> 10.6 s), for the same plans."""
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
    found = [copies for copies in by_sig.values() if len(copies) >= 2]
    # Each cluster's copies as {position: node}; a partial copy lacks some positions.
    placed = [[dict(enumerate(c)) for c in copies] for copies in found]
    last_layer = max((r for r in region.values() if r not in (HEAD, TAIL)), default=None)
    ends = _parameter_ends(traced)
    for (phase, _), copies in by_sig.items():
        if len(copies) > 1:
            continue
        lone = copies[0]
        for k, full in enumerate(found):
            if traced.phase(full[0][0]) is not phase:
                continue
            # The last layer keeps its parameters gathered into its backward (FSDP2), so there
            # its parameters' readers and gradients' producers may do better in other placements:
            # they keep their own variables. Tied, they bent the cluster's shared choice: 2
            # layers of llama3-8b over 8x8, a plan 12% slower; Qwen2-7B, 28 layers, 1.5%.
            kept = {keeps_gathered(region[c[0]], last_layer) for c in (lone, full[0])}
            apart = phase is Phase.BACKWARD and len(kept) == 2
            at = _align(lone, full[0], pinned, ends if apart else frozenset())
            if at is not None:
                placed[k].append(at)
                full.append(lone)
                break
        else:  # a cluster of one, for a layer that lines up with it to join (the last of two)
            found.append([lone])
            placed.append([dict(enumerate(lone))])
    paired = [k for k, copies in enumerate(found) if len(copies) >= 2]
    found, placed = [found[k] for k in paired], [placed[k] for k in paired]
    for copies, positions in zip(found, placed, strict=True):
        # The earliest copy in graph order comes first, and each position is represented by its
        # earliest copy, so strategies and variables are built for a representative before its
        # copies. (Regions interleave: a forward value the backward saves, e.g. GPT-2's detached
        # activations, sits in the graph among the forward nodes, in the reverse order of its
        # layer's backward region; and the backward runs the last layer first.)
        order = sorted(range(len(copies)), key=lambda c: index[copies[c][0]])
        result.clusters.append([[positions[c][i] for i in sorted(positions[c])] for c in order])
        for i in positions[0]:
            members = [at[i] for at in positions if i in at]
            r = min(members, key=index.__getitem__)
            for n in members:
                result.rep[n] = r
    _unline_other_producers(result)
    return result


def _unline_other_producers(clus: Clustering) -> None:
    """A getitem or a follower takes its placement from its producer: represented by a node
    whose producer is represented otherwise, it would read its own producer in the placement
    the other one yields, and the lowering would add a move no one priced. ``_align`` lines such
    nodes up where both producers are outside the layer, which serves where they are copies of
    one position (layer k reading layer k-1's output). Not where they are not: over 2 layers of
    GPT-2, the gradient entering layer 0 is a getitem of layer 1's LayerNorm backward (which
    keeps its own variables), and the one it was represented by, entering layer 1, the tail's;
    its fsdp_tp_sp plan then lowered an all_gather it had not priced. Such a node keeps its own
    variables, and so, in turn, do the single-input nodes that read it."""
    position = {n: (k, c) for k, cluster in enumerate(clus.clusters)
                for c, copy in enumerate(cluster) for n in copy}
    changed = True
    while changed:
        changed = False
        for n, r in clus.rep.items():
            if r is n or not (mine := _single_input(n)):
                continue
            theirs = _single_input(r)
            if not theirs or clus.rep.get(mine[0], mine[0]) is not clus.rep.get(theirs[0], theirs[0]):
                clus.rep[n] = n
                k, c = position[n]
                clus.clusters[k][c].remove(n)
                changed = True


# The share of a cluster's nodes a layer must line up with to join it without matching exactly.
PARTIAL_MATCH = 0.95


def _node_key(n: fx.Node, pinned: Mapping[str, Hashable]) -> tuple:
    """What a node must share with a cluster position to take its strategies: op, target, output,
    and each argument's shape, strides and dtype (where it comes from is the edges' to price)."""
    def arg(a):
        if isinstance(a, fx.Node):
            v = a.meta.get("val")
            return ("node", tuple(v.shape), v.stride(), v.dtype) if isinstance(v, torch.Tensor) else ("node",)
        if isinstance(a, (list, tuple)):
            return tuple(arg(x) for x in a)
        return a

    v = n.meta.get("val")
    out = (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else None
    return (n.op, str(n.target), out, str(arg(n.args)), str(sorted((k, arg(a)) for k, a in n.kwargs.items())),
            pinned.get(n.name))


def _align(copy: list[fx.Node], full: list[fx.Node], pinned: Mapping[str, Hashable],
           apart: frozenset[fx.Node] | set[fx.Node] = frozenset()) -> dict[int, fx.Node] | None:
    """``copy``'s nodes by the position of ``full`` (a copy of the cluster) they line up with, or
    None where fewer than PARTIAL_MATCH of ``full``'s positions do. Nodes are lined up by their
    ``_node_key`` in order; a node with one tensor argument (a follower, or a getitem of its
    parent) lines up only where its argument does with the position's (or both come from
    outside): it reads its input in its producer's placement, which the representative's
    producer decides. The nodes of ``apart`` then keep their own variables (and so do the
    single-input nodes that read them): they are not counted against PARTIAL_MATCH."""
    keys = [_node_key(n, pinned) for n in copy]
    matcher = difflib.SequenceMatcher(None, keys, [_node_key(n, pinned) for n in full], autojunk=False)
    at: dict[fx.Node, int] = {}
    for a, b, size in matcher.get_matching_blocks():
        for d in range(size):
            at[copy[a + d]] = b + d
    _unline_readers(at, full)
    if len(at) < PARTIAL_MATCH * len(full):
        return None
    if apart:
        at = {n: i for n, i in at.items() if n not in apart}
        _unline_readers(at, full)
    return {i: n for n, i in at.items()}


def _unline_readers(at: dict[fx.Node, int], full: list[fx.Node]) -> None:
    """Drop from ``at`` each single-input node whose argument does not line up with its
    position's argument (unlining a node can unline the single-input nodes that read it)."""
    pos_full = {n: i for i, n in enumerate(full)}
    changed = True
    while changed:
        changed = False
        for n, i in list(at.items()):
            ref = _single_input(full[i])
            if ref and [at.get(a) for a in _single_input(n)] != [pos_full.get(a) for a in ref]:
                del at[n]
                changed = True


def _parameter_ends(traced: Traced) -> set[fx.Node]:
    """The nodes that read a parameter (itself or a view of it) and those that produce a
    parameter's gradient (before the views that lead to it)."""
    params = {traced.node(p) for p in traced.params.values()}
    ends = {n for n in traced.gm.graph.nodes if n.op == "call_function" and not is_view_op(n)
            and any(alias_root(a) in params for a in tensor_args(n))}
    return ends | {alias_root(traced.node(g)) for g in traced.grads.values()}


def _single_input(n: fx.Node) -> list[fx.Node]:
    """A getitem's parent, or the one tensor argument of a node with one (a follower in the
    making, ``strategies._make_follower``); [] otherwise."""
    if is_getitem(n):
        return [n.args[0]]
    args = tensor_args(n)
    return args if len(args) == 1 else []
