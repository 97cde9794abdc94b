"""RMSNorm ops: ``shardwise::rms_norm``, ``shardwise::add_rms_norm``, ``shardwise::add_rms_norm2``.

Semantics (the form LLaMA-family code writes, see ``models/llama.py`` and HF ``LlamaRMSNorm``)::

    rms_norm(x, w, eps)       = w * (xc * rsqrt(mean(xc**2, -1, keepdim) + eps)).to(x.dtype)
                                with xc = x computed in at least float32
    add_rms_norm(x, r, w, eps)  = rms_norm(x + r, w, eps)
    add_rms_norm2(x, r, w, eps) = (rms_norm(x + r, w, eps), x + r)

``w`` is the 1-D weight over the last dim. The norm is per token (a reduction over the last dim
only), which is what lets the sequence-parallel pass run it on a slice of the tokens.

Costs: FLOPs count the arithmetic per element (below); bytes come from the fake values of the
inputs and outputs like every other node (``ir/flops.node_cost``).
"""

from __future__ import annotations

import math

import torch
from torch.utils.flop_counter import register_flop_formula

# Arithmetic per normalised element: square, accumulate, scale by the inverse RMS, scale by the
# weight. The per-token mean/eps/rsqrt is counted once per row.
RMS_NORM_FLOPS_PER_ELEMENT = 4
RMS_NORM_FLOPS_PER_ROW = 3
# The residual add fused in front of the norm: one more add per element.
ADD_FLOPS_PER_ELEMENT = 1


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the statistics are computed in: float32, or the input's when it is wider."""
    return torch.promote_types(dtype, torch.float32)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xc = x.to(compute_dtype(x.dtype))
    normed = xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def _norm_out(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x, dtype=torch.promote_types(x.dtype, weight.dtype))


@torch.library.custom_op("shardwise::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return rms_norm_reference(x, weight, eps)


@rms_norm.register_fake
def _rms_norm_fake(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _norm_out(x, weight)


@torch.library.custom_op("shardwise::add_rms_norm", mutates_args=())
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return rms_norm_reference(x + residual, weight, eps)


@add_rms_norm.register_fake
def _add_rms_norm_fake(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> torch.Tensor:
    return _norm_out(torch.empty_like(x + residual), weight)


@torch.library.custom_op("shardwise::add_rms_norm2", mutates_args=())
def add_rms_norm2(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    total = x + residual
    return rms_norm_reference(total, weight, eps), total


@add_rms_norm2.register_fake
def _add_rms_norm2_fake(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    total = torch.empty_like(x + residual)
    return _norm_out(total, weight), total


def rms_norm_flops(shape: torch.Size | tuple[int, ...], fused_add: bool = False) -> int:
    """FLOPs of one (add-)RMSNorm over a tensor of ``shape`` (normalised over the last dim)."""
    numel = math.prod(shape)
    rows = numel // shape[-1] if len(shape) and shape[-1] else 0
    per_elem = RMS_NORM_FLOPS_PER_ELEMENT + (ADD_FLOPS_PER_ELEMENT if fused_add else 0)
    return per_elem * numel + RMS_NORM_FLOPS_PER_ROW * rows


@register_flop_formula(torch.ops.shardwise.rms_norm, get_raw=True)
def _rms_norm_flop(x, weight, eps, *args, out_val=None, **kwargs) -> int:
    return rms_norm_flops(x.shape)


@register_flop_formula(torch.ops.shardwise.add_rms_norm, get_raw=True)
def _add_rms_norm_flop(x, residual, weight, eps, *args, out_val=None, **kwargs) -> int:
    return rms_norm_flops(x.shape, fused_add=True)


@register_flop_formula(torch.ops.shardwise.add_rms_norm2, get_raw=True)
def _add_rms_norm2_flop(x, residual, weight, eps, *args, out_val=None, **kwargs) -> int:
    return rms_norm_flops(x.shape, fused_add=True)


NORM_OPS = (torch.ops.shardwise.rms_norm.default, torch.ops.shardwise.add_rms_norm.default,
            torch.ops.shardwise.add_rms_norm2.default)
