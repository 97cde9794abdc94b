"""Placement vocabulary of plans: DTensor's ``Shard(d)``, ``Replicate()``, ``Partial()``.

A ``Placements`` is one placement per mesh dim. Text form (plan files, reports, CLI):
``"S(0)"``, ``"R"``, ``"P"`` (a pending sum), ``"P(avg)"`` and friends for other reductions.
"""

from __future__ import annotations

import re

from torch import fx
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from shardwise.errors import UserError
from shardwise.ir.flops import is_view
from shardwise.ir.match import is_transpose_2d

Placements = tuple[Placement, ...]


def placement_str(p: Placement) -> str:
    if isinstance(p, Shard):
        return f"S({p.dim})"
    if isinstance(p, Replicate):
        return "R"
    if isinstance(p, Partial):
        op = getattr(p, "reduce_op", "sum")
        return "P" if op == "sum" else f"P({op})"
    raise ValueError(f"placement {p!r} has no text form")


def placements_str(ps: Placements) -> list[str]:
    return [placement_str(p) for p in ps]


def parse_placement(text: str) -> Placement:
    text = text.strip()
    if text == "R":
        return Replicate()
    if text == "P":
        return Partial()
    m = re.fullmatch(r"S\((-?\d+)\)", text)
    if m:
        return Shard(int(m.group(1)))
    m = re.fullmatch(r"P\((\w+)\)", text)
    if m:
        return Partial(m.group(1))
    raise UserError(f"placement {text!r} is not one of S(d), R, P.")


def parse_placements(items: list[str]) -> Placements:
    return tuple(parse_placement(x) for x in items)


def on_mesh(ps: Placements, mesh_shape: tuple[int, ...]) -> Placements:
    """``ps`` with every size-1 mesh dim replicated: a split into one piece, or a sum of one term,
    is the whole tensor. Plans use only this form, so that equal layouts are one choice (and
    DTensor is never asked to move a tensor between two spellings of it)."""
    return tuple(Replicate() if m == 1 else p for p, m in zip(ps, mesh_shape, strict=True))


def view_base_placements(u: fx.Node, dst: Placements) -> Placements:
    """The placement of the node at the base of ``u``'s view chain that reading ``u`` in ``dst``
    amounts to: each 2-D transpose down the chain swaps the sharded dims (a weight's forward
    reads it as ``t(w)``, its backward as ``t(t(w))``: one gather of ``w`` serves both)."""
    while u.op == "call_function" and is_view(u) and u.all_input_nodes:
        if is_transpose_2d(u):
            dst = tuple(Shard(1 - p.dim) if isinstance(p, Shard) and p.dim in (0, 1) else p for p in dst)
        u = u.all_input_nodes[0]
    return dst
