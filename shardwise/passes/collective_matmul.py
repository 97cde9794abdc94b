"""Collective-matmul fusion (async tensor parallel): overlap a collective with the matmul it feeds.

Rewrites (W = group size; ``g @ b`` is ``[*batch, K] @ [K, N]``)::

    all_gather -> matmul
        g = all_gather(x) along d  (any form ir.match.gathered_value knows: the wait, or a
                                    split/slice + cat reassembly of it, in rank order)
        y_i = g @ b_i              (mm, einsum "...k,kn->...n", or flatten -> mm [-> unflatten])
      ->
        f = shardwise.all_gather_matmul(x, [b_1, ..., b_n], d, group, W)
        g = f[0]; y_i = f[i]       (g only kept where something else reads it)

    matmul -> reduce_scatter
        m = a @ b                  (same matmul forms)
        r = reduce_scatter(m) along d, "sum" or "avg"  (ir.match.scattered_value: direct, or a
                                    dim-0 cat of m's per-rank chunks along d, in rank order)
      ->
        r = shardwise.matmul_reduce_scatter(a, b, d, op, group, W)

Safety conditions (each a named predicate below):
- the group's size is known and at least 2;
- all_gather: no ``b_i`` depends on the collective's result; the reassembly nodes between the
  collective and the gathered value have no readers outside it (the gathered value itself may:
  they read ``f[0]``);
- reduce_scatter: the matmul output and the reassembly feed only the reduce_scatter (a
  reduce_scatter input with other users is left alone); the reduce op is sum or avg;
- only the matched nodes are erased, and only once nothing reads them; producers of a ``b_i``
  that sit after the fused node are moved before it (they cannot depend on the gather).

all_gather fusions run before reduce_scatter ones, so a matmul claimed by one is not claimed by
the other.
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass

import torch
from torch import fx
from torch.utils._pytree import tree_map

import shardwise.ir.ops  # noqa: F401  (registers torch.ops.shardwise.*)
from shardwise.errors import UserError
from shardwise.ir.match import (
    GatherMatch,
    Matmul,
    ScatterMatch,
    arg_node,
    b_is_matrix,
    depends_on,
    erase_if_dead,
    gathered_values,
    is_identity_view,
    matmul_at,
    matmuls_reading,
    only_used_within,
    scattered_values,
    topo_index,
)
from shardwise.ir.meta import copy_meta, shape

aten = torch.ops.aten
log = logging.getLogger(__name__)

ALL_GATHER_MATMUL = torch.ops.shardwise.all_gather_matmul.default
MATMUL_REDUCE_SCATTER = torch.ops.shardwise.matmul_reduce_scatter.default
IMPLS = ("auto", "ring", "symm_mem", "unfused")  # runtime.collective_matmul.Impl values
REDUCE_OPS = ("sum", "avg")  # what the fused reduce-scatter implements
MIN_GROUP_SIZE = 2  # a group of one has nothing to overlap


@dataclass(frozen=True)
class GatherMatmulMatch:
    gather: GatherMatch
    matmuls: tuple[Matmul, ...]


@dataclass(frozen=True)
class MatmulScatterMatch:
    matmul: Matmul
    scatter: ScatterMatch
    views: tuple[fx.Node, ...] = ()  # same-shape reshapes between the matmul and the scatter


# ---------------------------------------------------------------------------------------------
# Safety predicates
# ---------------------------------------------------------------------------------------------

def group_is_fusable(size: int | None) -> bool:
    """The group's size is known and big enough for a ring."""
    return size is not None and size >= MIN_GROUP_SIZE


def b_independent_of_gather(m: Matmul, g: GatherMatch) -> bool:
    """The other operand does not read the collective's result (so it can be computed first)."""
    return not depends_on(m.b, g.collective.op)


def reassembly_private(g: GatherMatch) -> bool:
    """Nothing outside the match reads the collective, its wait or the pieces (only the value)."""
    return only_used_within(g.nodes, exit=g.value_node)


def scatter_input_private(m: Matmul, s: ScatterMatch, views: list[fx.Node] | tuple = ()) -> bool:
    """The matmul output and every node up to the reduce_scatter feed only the reduce_scatter."""
    return only_used_within((m.out, *views, *s.nodes), exit=s.value_node)


def reduce_op_supported(s: ScatterMatch) -> bool:
    """The fused reduce-scatter implements this reduce op."""
    return s.reduce_op in REDUCE_OPS


# ---------------------------------------------------------------------------------------------
# Finding
# ---------------------------------------------------------------------------------------------

def _skip(node: fx.Node, why: str) -> None:
    log.debug("collective_matmul: leaving %s alone: %s", node.name, why)


def find_gather_matmuls(graph: fx.Graph) -> list[GatherMatmulMatch]:
    found = []
    for g in gathered_values(graph):
        matmuls = matmuls_reading(g.value_node)
        if not matmuls:
            continue  # nothing to fuse with
        if not group_is_fusable(g.group_size):
            _skip(g.value_node, f"group size {g.group_size} is unknown or < {MIN_GROUP_SIZE}")
            continue
        if not reassembly_private(g):
            _skip(g.value_node, "a node of the gather's reassembly has readers outside it")
            continue
        safe = [m for m in matmuls if b_independent_of_gather(m, g)]
        for m in matmuls:
            if m not in safe:
                _skip(m.out, "its other operand depends on the gathered value")
        if safe:
            found.append(GatherMatmulMatch(g, tuple(safe)))
    return found


def find_matmul_scatters(graph: fx.Graph) -> list[MatmulScatterMatch]:
    found = []
    for s in scattered_values(graph):
        src, views = s.input_value, []
        while is_identity_view(src):  # lowering leaves these between a matmul and its scatter
            views.append(src)
            src = arg_node(src)
        m = matmul_at(src)
        if m is None or not b_is_matrix(m):
            continue  # the scattered value is no matmul
        if not group_is_fusable(s.group_size):
            _skip(s.value_node, f"group size {s.group_size} is unknown or < {MIN_GROUP_SIZE}")
        elif not reduce_op_supported(s):
            _skip(s.value_node, f"reduce op {s.reduce_op!r} is not one of {REDUCE_OPS}")
        elif not scatter_input_private(m, s, views):
            _skip(s.value_node, "the matmul output or its reassembly has other readers")
        else:
            found.append(MatmulScatterMatch(m, s, tuple(views)))
    return found


# ---------------------------------------------------------------------------------------------
# Rewriting
# ---------------------------------------------------------------------------------------------

def _val(a: object) -> object:
    return a.meta.get("val") if isinstance(a, fx.Node) else a


def _call(graph: fx.Graph, target, args: tuple, like: fx.Node | None = None) -> fx.Node:
    """A new node whose fake value is computed from its inputs' (meta copied from ``like``)."""
    node = graph.call_function(target, args)
    if like is not None:
        copy_meta(node, like)
    node.meta["val"] = target(*tree_map(_val, args))
    return node


def hoist_before(anchor: fx.Node, roots: list[fx.Node]) -> None:
    """Move the producers of ``roots`` that sit at or after ``anchor`` to just before it (in order)."""
    order = topo_index(anchor.graph)
    lo = order[anchor]
    late: set[fx.Node] = set()
    stack = [r for r in roots if order[r] >= lo]
    while stack:
        n = stack.pop()
        if n in late:
            continue
        late.add(n)
        stack.extend(i for i in n.all_input_nodes if order[i] >= lo)
    for n in sorted(late, key=order.__getitem__):
        anchor.prepend(n)


def _b_operand(graph: fx.Graph, m: Matmul) -> fx.Node:
    return _call(graph, aten.t.default, (m.b,)) if m.transpose_b else m.b


def _output(graph: fx.Graph, fused: fx.Node, index: int, out: fx.Node) -> fx.Node:
    """``fused[index]``, viewed to ``out``'s shape when ``out`` was a flattened mm."""
    item = _call(graph, operator.getitem, (fused, index), like=out)
    if shape(item) != shape(out):
        item = _call(graph, aten.view.default, (item, list(shape(out))), like=out)
    return item


def rewrite_gather_matmul(gm: fx.GraphModule, match: GatherMatmulMatch, impl: str) -> None:
    graph, g = gm.graph, match.gather
    order = topo_index(graph)
    anchor = min(g.value_node.users, key=order.__getitem__)  # before every reader of the value
    hoist_before(anchor, [m.b for m in match.matmuls])
    with graph.inserting_before(anchor):
        bs = [_b_operand(graph, m) for m in match.matmuls]
        args = (g.input, bs, g.dim, g.collective.group_name, g.group_size, impl)
        fused = _call(graph, ALL_GATHER_MATMUL, args, like=match.matmuls[0].out)
        fused.meta.pop("tensor_meta", None)  # describes the matmul's one tensor, not the op's list
        outs = [_output(graph, fused, i + 1, m.out) for i, m in enumerate(match.matmuls)]
        gathered = _call(graph, operator.getitem, (fused, 0), like=g.value_node)
    for m, o in zip(match.matmuls, outs, strict=True):
        m.out.replace_all_uses_with(o)
        erase_if_dead(m.nodes)
    g.value_node.replace_all_uses_with(gathered)
    erase_if_dead(reversed(g.nodes))
    erase_if_dead([gathered])


def rewrite_matmul_scatter(gm: fx.GraphModule, match: MatmulScatterMatch, impl: str) -> None:
    graph, m, s = gm.graph, match.matmul, match.scatter
    with graph.inserting_before(s.collective.op):
        args = (m.a, _b_operand(graph, m), s.dim, s.reduce_op, s.collective.group_name, s.group_size, impl)
        fused = _call(graph, MATMUL_REDUCE_SCATTER, args, like=s.value_node)
    copy_meta(fused, s.value_node, seq_nr_from=m.out)
    s.value_node.replace_all_uses_with(fused)
    erase_if_dead(reversed(s.nodes))
    erase_if_dead(match.views)
    erase_if_dead(m.nodes)


def _alive(graph: fx.Graph, nodes: list[fx.Node]) -> bool:
    return all(n.graph is graph and not getattr(n, "_erased", False) for n in nodes)


def apply(gm: fx.GraphModule, impl: str = "auto") -> int:
    """Fuse every safe all_gather -> matmul and matmul -> reduce_scatter; returns the fusions made.

    ``impl``: the runtime implementation the fused ops record (auto, ring, symm_mem, unfused).
    """
    if impl not in IMPLS:
        raise UserError(f"collective_matmul impl {impl!r} is unknown; use one of {', '.join(IMPLS)}.")
    count = 0
    for match in find_gather_matmuls(gm.graph):
        if _alive(gm.graph, [*match.gather.nodes, *(n for m in match.matmuls for n in m.nodes)]):
            rewrite_gather_matmul(gm, match, impl)
            count += 1
    for match in find_matmul_scatters(gm.graph):
        if _alive(gm.graph, [*match.scatter.nodes, *match.matmul.nodes]):
            rewrite_matmul_scatter(gm, match, impl)
            count += 1
    gm.graph.lint()
    gm.recompile()
    return count
