"""Canonicalise decomposed RMSNorms into ``shardwise::rms_norm`` and fuse the residual add.

Rewrites, in forward graphs::

    xf = x | _to_copy(x, float32)               (the upcast of HF LlamaRMSNorm / our llama)
    r  = rsqrt(mean(xf ** 2, -1, keepdim) + eps)   (pow or xf * xf; eps added as Tensor/Scalar)
    n  = xf * r
    y  = w * _to_copy(n, x.dtype) | w * n | n * w  (weight last: HF, our llama, F.rms_norm fp32)
        =>  y = shardwise.rms_norm(x, w, eps)

    F.rms_norm as traced in low precision multiplies the weight before the down-cast:
    y = _to_copy(n * w, x.dtype)  =>  shardwise.rms_norm(xf, w, eps) followed by the same cast.

    s = add(a, b) -> rms_norm(s, w, eps)
        =>  add_rms_norm(a, b, w, eps)                      when the norm is the add's only user
        =>  (y, s) = add_rms_norm2(a, b, w, eps)            when ``s`` is also read elsewhere

Safety conditions (each a named predicate below):
- every intermediate node of the decomposition is read only inside it (in a joint graph the
  backward reads ``rsqrt``: such a norm is left alone);
- the statistics are computed in the op's precision: an upcast to float32 of a bf16/fp16 input,
  or no cast of a float32/float64 input;
- the mean is over the last dim with keepdim, the weight is 1-D over the last dim;
- the residual add has two tensor inputs of the norm input's shape and dtype (no broadcast).
"""

from __future__ import annotations

import logging
import numbers
import operator
from dataclasses import dataclass

import torch
from torch import fx

import shardwise.ir.ops  # noqa: F401  (registers torch.ops.shardwise.*)
from shardwise.ir.match import arg_node, cast_dtype, insert_call_after, is_op, mul_other
from shardwise.ir.meta import copy_meta, fake_value, shape

log = logging.getLogger(__name__)
aten = torch.ops.aten
sw = torch.ops.shardwise

RMS_NORM = sw.rms_norm.default
ADD_RMS_NORM = sw.add_rms_norm.default
ADD_RMS_NORM2 = sw.add_rms_norm2.default

LOW_PRECISION = (torch.bfloat16, torch.float16)
OP_PRECISION = (torch.float32, torch.float64)
# eps is added either as a Python scalar to a tensor or by add.Scalar; F.rms_norm traces the
# in-place add_.Scalar on the fresh mean (safe to treat as functional when the mean has no other
# reader, which ``_inner_nodes_private`` checks).
EPS_ADDS = (aten.add.Tensor, aten.add.Scalar, aten.add_.Scalar)


@dataclass
class NormMatch:
    """One decomposed RMSNorm: ``x`` the value normalised (before any upcast), ``compute_in`` the
    node that becomes the op's input, ``out`` the node whose value the op replaces."""

    x: fx.Node
    compute_in: fx.Node
    weight: fx.Node
    eps: float
    out: fx.Node
    inner: list[fx.Node]


def _is_square(node: fx.Node, xf: fx.Node) -> bool:
    if is_op(node, aten.pow.Tensor_Scalar):
        return node.args[0] is xf and node.args[1] == 2
    return is_op(node, aten.mul.Tensor) and node.args[0] is xf and node.args[1] is xf


def _is_last_dim_keepdim_mean(mean: fx.Node, rank: int) -> bool:
    """``mean(sq, [-1], keepdim=True)`` over the last dim only."""
    if not is_op(mean, aten.mean.dim):
        return False
    dims = mean.args[1] if len(mean.args) > 1 else mean.kwargs.get("dim")
    keep = mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim", False)
    return (keep is True and isinstance(dims, (list, tuple)) and len(dims) == 1
            and dims[0] % rank == rank - 1 and "dtype" not in mean.kwargs)


def _is_weight(w: fx.Node, x: fx.Node) -> bool:
    """A 1-D weight over the last dim of ``x``."""
    ws, xs = shape(w), shape(x)
    return ws is not None and xs is not None and len(ws) == 1 and ws[0] == xs[-1]


def _computes_in_op_precision(x: fx.Node, compute_in: fx.Node) -> bool:
    """The decomposition computes its statistics in the precision ``shardwise.rms_norm`` uses."""
    xv, cv = fake_value(x), fake_value(compute_in)
    if xv is None or cv is None:
        return False
    if compute_in is x:
        return xv.dtype in OP_PRECISION
    return xv.dtype in LOW_PRECISION and cv.dtype == torch.float32


def _dead_detaches(node: fx.Node) -> list[fx.Node]:
    """Unread ``detach`` users (make_fx leaves them where autograd saved a value)."""
    return [u for u in node.users if is_op(u, aten.detach.default) and not u.users]


def _inner_nodes_private(inner: list[fx.Node], allowed_users: set[fx.Node]) -> bool:
    """Every intermediate node is read only by nodes of the pattern (nothing else sees them)."""
    return all(set(n.users) - set(_dead_detaches(n)) <= allowed_users for n in inner)


def match_norm(rsqrt: fx.Node) -> NormMatch | None:
    """Recognise the RMSNorm whose ``rsqrt`` node is given; None when it is not one."""
    if not is_op(rsqrt, aten.rsqrt.default):
        return None
    eps_add = arg_node(rsqrt)
    if not is_op(eps_add, *EPS_ADDS) or not isinstance(eps_add.args[1], numbers.Real):
        return None
    mean = arg_node(eps_add)
    sq = arg_node(mean) if mean is not None else None
    if sq is None or not (is_op(sq, aten.pow.Tensor_Scalar, aten.mul.Tensor)):
        return None
    xf = arg_node(sq)
    if xf is None or not _is_square(sq, xf) or shape(xf) is None:
        return None
    if not _is_last_dim_keepdim_mean(mean, len(shape(xf))):
        return None
    scaled = next((u for u in rsqrt.users if mul_other(u, rsqrt) is xf), None)
    if scaled is None:
        return None
    cast_in = cast_dtype(xf)
    x = arg_node(xf) if cast_in is not None else xf
    compute_in = x
    if x is None or not _computes_in_op_precision(x, xf):
        return None
    inner = [sq, mean, eps_add, rsqrt, scaled]
    if cast_in is not None:
        inner.insert(0, xf)
    # The tail: down-cast then weight (HF, our llama), weight then down-cast (F.rms_norm), or the
    # weight straight on the fp32 value.
    nxt = next(iter(scaled.users)) if len(scaled.users) == 1 else None
    if nxt is None:
        return None
    xdtype = fake_value(x).dtype
    if cast_in is not None and cast_dtype(nxt) == xdtype and len(nxt.users) == 1:
        mul = next(iter(nxt.users))
        w = mul_other(mul, nxt)
        inner.append(nxt)
        out = mul
    else:
        w = mul_other(nxt, scaled)
        out = nxt
        if cast_in is not None:
            # F.rms_norm in low precision: the op runs on the fp32 value, the cast stays.
            compute_in = xf
            inner.remove(xf)
    if w is None or w is scaled or not _is_weight(w, x):
        return None
    users_in = set(inner) | {out}
    if not _inner_nodes_private(inner, users_in):
        return None
    return NormMatch(x=x, compute_in=compute_in, weight=w, eps=float(eps_add.args[1]), out=out,
                     inner=inner)


def find_norms(graph: fx.Graph) -> list[NormMatch]:
    return [m for n in graph.nodes if (m := match_norm(n)) is not None]


def _replace_norm(graph: fx.Graph, m: NormMatch) -> fx.Node:
    with graph.inserting_before(m.out):
        node = graph.call_function(RMS_NORM, (m.compute_in, m.weight, m.eps))
    copy_meta(node, m.out)
    m.out.replace_all_uses_with(node)
    for n in m.inner:
        for d in _dead_detaches(n):
            graph.erase_node(d)
    for n in [m.out, *reversed(m.inner)]:
        if not n.users:
            graph.erase_node(n)
    return node


@dataclass
class ResidualMatch:
    """``add(a, b)`` feeding ``rms_norm``: fused into add_rms_norm (``keep_sum`` False) or
    add_rms_norm2 (``keep_sum`` True: the sum is read elsewhere too). The fused op goes right
    after ``anchor`` (the later of the add and the weight)."""

    add: fx.Node
    norm: fx.Node
    keep_sum: bool
    anchor: fx.Node


def _is_plain_residual_add(add: fx.Node) -> bool:
    """``add.Tensor(a, b)`` of two tensors with the sum's shape and dtype (no broadcast, alpha 1)."""
    if not is_op(add, aten.add.Tensor) or add.kwargs or len(add.args) != 2:
        return False
    vals = [fake_value(a) if isinstance(a, fx.Node) else None for a in add.args]
    out = fake_value(add)
    return out is not None and all(
        v is not None and v.shape == out.shape and v.dtype == out.dtype for v in vals)


def match_residual(norm: fx.Node) -> ResidualMatch | None:
    if not is_op(norm, RMS_NORM):
        return None
    add = arg_node(norm)
    if add is None or not _is_plain_residual_add(add):
        return None
    anchor = _fused_anchor(add, norm)
    if anchor is None:
        return None
    return ResidualMatch(add, norm, keep_sum=len(add.users) > 1, anchor=anchor)


def _fused_anchor(add: fx.Node, norm: fx.Node) -> fx.Node | None:
    """Where the fused op can go: after the add and the norm's weight, before every reader of the
    sum. None when a reader of the sum comes before the weight is computed."""
    order = {n: i for i, n in enumerate(add.graph.nodes)}
    weight = norm.args[1]
    anchor = weight if isinstance(weight, fx.Node) and order[weight] > order[add] else add
    if any(order[u] <= order[anchor] for u in add.users):
        return None
    return anchor


def _fuse_residual(graph: fx.Graph, m: ResidualMatch) -> None:
    a, b = m.add.args
    _, w, eps = m.norm.args
    target = ADD_RMS_NORM2 if m.keep_sum else ADD_RMS_NORM
    fused = insert_call_after(m.anchor, target, (a, b, w, eps), meta_from=m.norm)
    if not m.keep_sum:
        m.norm.replace_all_uses_with(fused)
    else:
        normed = insert_call_after(fused, operator.getitem, (fused, 0), meta_from=m.norm)
        total = insert_call_after(normed, operator.getitem, (fused, 1), meta_from=m.add)
        m.norm.replace_all_uses_with(normed)
    graph.erase_node(m.norm)
    if m.keep_sum:
        m.add.replace_all_uses_with(total)
    graph.erase_node(m.add)


def apply(gm: fx.GraphModule, *, fuse_residual: bool = True) -> int:
    """Canonicalise every decomposed RMSNorm (and, with ``fuse_residual``, the residual add in
    front of it); returns the number of norms and residual adds rewritten."""
    count = 0
    for m in find_norms(gm.graph):
        _replace_norm(gm.graph, m)
        count += 1
    if fuse_residual:
        for n in list(gm.graph.nodes):
            r = match_residual(n)
            if r is not None:
                _fuse_residual(gm.graph, r)
                count += 1
    gm.graph.lint()
    gm.recompile()
    return count
