"""Fused collective-matmul ops: ``shardwise::all_gather_matmul``, ``shardwise::matmul_reduce_scatter``.

Semantics (W = ``group_size``; ``a @ b`` is ``torch.matmul`` with a 2-D ``b``: ``[*batch, K] @
[K, N] -> [*batch, N]``)::

    all_gather_matmul(a, bs, gather_dim, group_name, group_size, impl)
        = [g, g @ bs[0], g @ bs[1], ...]          with g = all_gather(a) along gather_dim
    matmul_reduce_scatter(a, b, scatter_dim, reduce_op, group_name, group_size, impl)
        = reduce_scatter(a @ b) along scatter_dim  with reduce_op "sum" or "avg"

The gathered value ``g`` is returned so that its other users keep reading it. ``impl`` names the
runtime implementation (``runtime.collective_matmul.Impl``: auto, ring, symm_mem, unfused); the
real implementation dispatches there. FLOPs are the matmuls' (``2 * rows * K * N``); bytes come
from the fake values like every other node.
"""

from __future__ import annotations

import math

import torch
from torch.utils.flop_counter import register_flop_formula

# The runtime is imported where the ops run, so importing the op namespace stays light.
REDUCE_OPS = ("sum", "avg")


def _check_matmul(a: torch.Tensor, b: torch.Tensor, k: int, op: str) -> None:
    if a.dim() < 2 or b.dim() != 2 or b.shape[0] != k:
        raise ValueError(f"shardwise::{op}: needs a of rank >= 2 and b of shape [K, N] with K = {k}; "
                         f"got a {tuple(a.shape)}, b {tuple(b.shape)}.")


def gathered_shape(a: torch.Tensor, gather_dim: int, group_size: int) -> list[int]:
    dim = gather_dim % a.dim()
    return [d * group_size if i == dim else d for i, d in enumerate(a.shape)]


def scattered_shape(out: list[int], scatter_dim: int, group_size: int) -> list[int]:
    dim = scatter_dim % len(out)
    if out[dim] % group_size:
        raise ValueError(f"shardwise::matmul_reduce_scatter: dim {dim} of the product {out} does not "
                         f"split into {group_size} equal chunks.")
    return [d // group_size if i == dim else d for i, d in enumerate(out)]


@torch.library.custom_op("shardwise::all_gather_matmul", mutates_args=())
def all_gather_matmul(a: torch.Tensor, bs: list[torch.Tensor], gather_dim: int, group_name: str,
                      group_size: int, impl: str = "auto") -> list[torch.Tensor]:
    from shardwise.runtime import collective_matmul as rt

    return rt.all_gather_matmul(a, list(bs), gather_dim, group_name, group_size, rt.Impl(impl))


@all_gather_matmul.register_fake
def _all_gather_matmul_fake(a: torch.Tensor, bs: list[torch.Tensor], gather_dim: int, group_name: str,
                            group_size: int, impl: str = "auto") -> list[torch.Tensor]:
    shp = gathered_shape(a, gather_dim, group_size)
    for b in bs:
        _check_matmul(a, b, shp[-1], "all_gather_matmul")
    g = a.new_empty(shp)
    return [g, *(a.new_empty([*shp[:-1], b.shape[1]], dtype=torch.promote_types(a.dtype, b.dtype))
                 for b in bs)]


@torch.library.custom_op("shardwise::matmul_reduce_scatter", mutates_args=())
def matmul_reduce_scatter(a: torch.Tensor, b: torch.Tensor, scatter_dim: int, reduce_op: str, group_name: str,
                          group_size: int, impl: str = "auto") -> torch.Tensor:
    from shardwise.runtime import collective_matmul as rt

    return rt.matmul_reduce_scatter(a, b, scatter_dim, rt.ReduceOp(reduce_op), group_name, group_size,
                                    rt.Impl(impl))


@matmul_reduce_scatter.register_fake
def _matmul_reduce_scatter_fake(a: torch.Tensor, b: torch.Tensor, scatter_dim: int, reduce_op: str,
                                group_name: str, group_size: int, impl: str = "auto") -> torch.Tensor:
    _check_matmul(a, b, a.shape[-1], "matmul_reduce_scatter")
    if reduce_op not in REDUCE_OPS:
        raise ValueError(f"shardwise::matmul_reduce_scatter: reduce_op {reduce_op!r} is not one of "
                         f"{REDUCE_OPS}.")
    out = [*a.shape[:-1], b.shape[1]]
    return a.new_empty(scattered_shape(out, scatter_dim, group_size),
                       dtype=torch.promote_types(a.dtype, b.dtype))


def matmul_flops(a_shape: torch.Size | list[int], n: int) -> int:
    """2 * rows * K * N for ``[*rows, K] @ [K, N]`` (one multiply-add per point)."""
    return 2 * math.prod(a_shape) * n


@register_flop_formula(torch.ops.shardwise.all_gather_matmul, get_raw=True)
def _all_gather_matmul_flop(a, bs, gather_dim, group_name, group_size, impl="auto", *args,
                            out_val=None, **kwargs) -> int:
    shp = gathered_shape(a, gather_dim, group_size)
    return sum(matmul_flops(shp, b.shape[1]) for b in bs)


@register_flop_formula(torch.ops.shardwise.matmul_reduce_scatter, get_raw=True)
def _matmul_reduce_scatter_flop(a, b, scatter_dim, reduce_op, group_name, group_size, impl="auto", *args,
                                out_val=None, **kwargs) -> int:
    return matmul_flops(a.shape, b.shape[1])
