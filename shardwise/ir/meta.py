"""Typed access to the ``node.meta`` keys shardwise reads and writes."""

from __future__ import annotations

import torch
from torch import fx

VAL = "val"
SEQ_NR = "seq_nr"
STACK_TRACE = "stack_trace"
MODULE_STACK = "nn_module_stack"
# Keys a rewrite carries from the node it replaces to the node that replaces it.
KEPT_KEYS = (VAL, SEQ_NR, STACK_TRACE, MODULE_STACK, "tensor_meta")


def fake_value(node: fx.Node) -> torch.Tensor | None:
    """The FakeTensor a node computes, or None when it is not a single tensor."""
    v = node.meta.get(VAL)
    return v if isinstance(v, torch.Tensor) else None


def shape(node: fx.Node) -> tuple[int, ...] | None:
    """Static shape of a tensor node; None when it is not a tensor or any dim is symbolic."""
    v = fake_value(node)
    if v is None:
        return None
    dims = tuple(v.shape)
    return dims if all(isinstance(d, int) for d in dims) else None


def copy_meta(dst: fx.Node, src: fx.Node, *, seq_nr_from: fx.Node | None = None) -> None:
    """Copy the kept meta keys from ``src`` onto ``dst`` (``seq_nr`` optionally from another node)."""
    for k in KEPT_KEYS:
        if k in src.meta:
            dst.meta[k] = src.meta[k]
    if seq_nr_from is not None and SEQ_NR in seq_nr_from.meta:
        dst.meta[SEQ_NR] = seq_nr_from.meta[SEQ_NR]


def flat_leaves(obj: object, kind: type) -> list:
    """The ``kind`` instances in ``obj`` (a value, or arguments nesting lists, tuples and dicts) in
    pytree's flattened order, walked by hand: planning asks this ~10^5 times a plan, where
    pytree's ``tree_flatten`` took seconds."""
    out: list = []
    _walk(obj, kind, out)
    return out


def flat_tensors(obj: object) -> list[torch.Tensor]:
    return flat_leaves(obj, torch.Tensor)


def _walk(obj: object, kind: type, out: list) -> None:
    if isinstance(obj, kind):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for a in obj:
            _walk(a, kind, out)
    elif isinstance(obj, dict):
        for a in obj.values():
            _walk(a, kind, out)


def arg_values(node: fx.Node) -> tuple[tuple, dict]:
    """``node``'s (args, kwargs) with each argument node replaced by its fake value."""
    return fx.node.map_arg((node.args, node.kwargs), lambda a: a.meta.get(VAL))
