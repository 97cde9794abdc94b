"""Fold the scalars of a square's backward onto the small operand it is multiplied by.

Autograd differentiates ``x ** 2`` as ``grad * 2.0 * x ** 1.0``, and a mean over the last dim as
``expand(grad) / n``; an RMSNorm's backward multiplies the two, three full-size elementwise ops
(a copy, a doubling, a division of the broadcast) around the one product it needs::

    p = pow(x, 1.0)                          s = div(m, n / 2.0)           (m: [..., 1], small)
    t = mul(p, 2.0)                  =>      y = mul(x, s)                 (broadcast, as before)
    g = div(expand(m, shape(x)), n)
    y = mul(g, t)

and ``pow(x, 1.0) -> x`` elsewhere (ATen's pow copies its base for exponent 1), where no reader
writes in place and it is no graph output (the copy may not become an alias of ``x`` there).

Safety: the result is the same bit for bit. Scaling by a power of two commutes with rounding
(no overflow or gradual underflow: a gradient 2**100 times smaller than float32's smallest
normal number is not a training run), so ``s = m / (n / 2)`` is ``2 * (m / n)`` exactly (so too
where ATen divides by multiplying with the reciprocal) and ``x * s`` rounds as ``(2 * x) * (m / n)``;
only the multiplier 2.0 (or any power of two) is moved, the division by ``n`` stays as it was.
Each removed node must be read only inside the pattern; all tensors share one floating dtype
(no type promotion in between); ``m`` broadcasts to ``x``'s shape and the product has it.
Runs at canonicalisation, so the planner and every later pass see the smaller graph.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import fx

from shardwise.ir.match import (
    arg_node,
    erase_if_dead,
    insert_call_after,
    is_graph_output,
    is_op,
    mul_other,
    single_user,
    writes_in_place,
)
from shardwise.ir.meta import fake_value, shape

aten = torch.ops.aten


@dataclass(frozen=True)
class SquareGrad:
    """``y = div(expand(m), n) * (pow(x, 1.0) * c)`` with ``c`` a power of two."""

    y: fx.Node
    x: fx.Node
    m: fx.Node
    divisor: float  # n / c: the small operand's one division
    dead: tuple[fx.Node, ...]  # div, expand, mul.Scalar, pow: read by nothing once y is replaced


def _is_identity_pow(node: object) -> bool:
    return is_op(node, aten.pow.Tensor_Scalar) and len(node.args) == 2 and node.args[1] == 1


def _finite_number(c: object) -> bool:
    return isinstance(c, (int, float)) and not isinstance(c, bool) and math.isfinite(c)


def _power_of_two(c: object) -> bool:
    return _finite_number(c) and c > 0 and math.frexp(c)[0] == 0.5


def _one_float_dtype(*nodes: fx.Node) -> bool:
    dtypes = {getattr(fake_value(n), "dtype", None) for n in nodes}
    return len(dtypes) == 1 and None not in dtypes and next(iter(dtypes)).is_floating_point


def _match(pw: fx.Node) -> SquareGrad | None:
    """The pattern read from its ``pow(x, 1.0)``."""
    x, t = arg_node(pw), single_user(pw)
    if x is None or not is_op(t, aten.mul.Scalar) or len(t.args) != 2 or not _power_of_two(t.args[1]):
        return None
    y = single_user(t)
    g = mul_other(y, t) if y is not None else None
    if g is None or g is t or single_user(g) is not y or not is_op(g, aten.div.Scalar) or len(g.args) != 2:
        return None
    n, expand = g.args[1], arg_node(g)
    if not _finite_number(n) or n == 0:
        return None
    if not is_op(expand, aten.expand.default) or single_user(expand) is not g:
        return None
    m = arg_node(expand)
    xs, ms, ys = shape(x), (shape(m) if m is not None else None), shape(y)
    if xs is None or ms is None or ys != xs or shape(expand) != xs or len(ms) > len(xs):
        return None
    if torch.broadcast_shapes(ms, xs) != xs or not _one_float_dtype(x, m, y):
        return None
    return SquareGrad(y, x, m, n / t.args[1], (g, expand, t, pw))


def _copy_to_drop(pw: fx.Node) -> bool:
    """``pw = pow(x, 1.0)`` may read ``x`` itself instead."""
    x = arg_node(pw)
    return (x is not None and _one_float_dtype(pw, x) and not is_graph_output(pw)
            and not any(writes_in_place(u) for u in pw.users))


def find(gm: fx.GraphModule) -> tuple[list[SquareGrad], list[fx.Node]]:
    """The folds, and the other ``pow(x, 1.0)`` copies to drop."""
    folds, copies = [], []
    for node in gm.graph.nodes:
        if not _is_identity_pow(node):
            continue
        match = _match(node)
        if match is not None:
            folds.append(match)
        elif _copy_to_drop(node):
            copies.append(node)
    return folds, copies


def apply(gm: fx.GraphModule) -> int:
    folds, copies = find(gm)
    for f in folds:
        small = insert_call_after(f.y.prev, aten.div.Scalar, (f.m, f.divisor), meta_from=f.y)
        product = insert_call_after(small, aten.mul.Tensor, (f.x, small), meta_from=f.y)
        f.y.replace_all_uses_with(product)
        gm.graph.erase_node(f.y)
        erase_if_dead(f.dead)
    for pw in copies:
        pw.replace_all_uses_with(arg_node(pw))
        gm.graph.erase_node(pw)
    if folds or copies:
        gm.graph.lint()
        gm.recompile()
    return len(folds) + len(copies)
