"""Attention that runs on any device: ``shardwise::flash_attention`` and its backward.

Programs are traced on fake CPU tensors, where PyTorch's ``scaled_dot_product_attention``
decomposes into ``aten._scaled_dot_product_flash_attention_for_cpu`` (out, logsumexp) and, in
the backward, ``..._for_cpu_backward`` (dq, dk, dv). Those kernels exist for the CPU only. These
two ops take the same arguments and give the same results, so a program bound to another device
swaps them in (``runtime/launch.retarget_device``, ``DEVICE_PORTABLE``):

- on the CPU: the aten CPU kernels themselves;
- elsewhere, PyTorch's flash kernels where they apply (fp16/bf16, no mask, no dropout, one
  number of heads for q, k and v, head dim a multiple of 8 up to 256);
- else the math below: scores in fp32, ``lse = logsumexp(scores)``, ``p = exp(scores - lse)``,
  ``out = p v``; backward ``dv = p^T do``, ``ds = p * (do v^T - rowsum(do * out))``,
  ``dq = scale * ds k``, ``dk = scale * ds^T q``. With fewer k/v heads than query heads
  (grouped-query attention, which the CPU kernel takes), each k/v head serves a group of
  consecutive query heads, and its gradients are the group's sum.

Each pair (forward, backward) runs the same implementation, so the logsumexp the forward hands
the backward is always its own kind. Outputs and gradients are laid out as the CPU kernels lay
them out ([B, L, H, E] in memory, viewed as [B, H, L, E]): the traced program's views assume it.
Dropout inside attention is refused off the CPU: the CPU kernel's random draws cannot be
reproduced by another device's.
"""

from __future__ import annotations

import math

import torch
from torch.utils.flop_counter import register_flop_formula, sdpa_backward_flop_count, sdpa_flop_count

aten = torch.ops.aten
# PyTorch's flash kernels: their dtypes and largest head dim.
FLASH_DTYPES = (torch.float16, torch.bfloat16)
FLASH_MAX_HEAD_DIM = 256
FLASH_HEAD_DIM_MULTIPLE = 8


def _flash_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float,
                   attn_mask: torch.Tensor | None) -> bool:
    e = q.shape[-1]
    return (q.device.type == "cuda" and q.dtype in FLASH_DTYPES and attn_mask is None and dropout_p == 0.0
            and q.shape[1] == k.shape[1] == v.shape[1] and e <= FLASH_MAX_HEAD_DIM
            and e % FLASH_HEAD_DIM_MULTIPLE == 0)


def _as_cpu_layout(t: torch.Tensor) -> torch.Tensor:
    """``t`` [B, H, L, E] stored as [B, L, H, E] (a copy only where it is stored otherwise)."""
    want = torch.empty((t.shape[0], t.shape[2], t.shape[1], t.shape[3]), dtype=t.dtype,
                       device=t.device).transpose(1, 2)
    return t if t.stride() == want.stride() else want.copy_(t)


def _per_query_head(kv: torch.Tensor, heads: int) -> torch.Tensor:
    """``kv`` with one head per query head (each k/v head repeated for its group), in fp32."""
    return kv.float().repeat_interleave(heads // kv.shape[1], dim=1)


def _per_kv_head(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """A gradient per query head summed over each k/v head's group."""
    b, h, n, e = grad.shape
    return grad.view(b, kv_heads, h // kv_heads, n, e).sum(2)


def _scores(q: torch.Tensor, k: torch.Tensor, is_causal: bool, attn_mask: torch.Tensor | None,
            scale: float) -> torch.Tensor:
    s = torch.matmul(q.float(), _per_query_head(k, q.shape[1]).transpose(-2, -1)) * scale
    if is_causal:
        keep = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~keep, -math.inf)
    if attn_mask is not None:  # additive, in the query's dtype (the CPU kernel takes no other)
        s = s + attn_mask.float()
    return s


def math_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False,
                 attn_mask: torch.Tensor | None = None,
                 scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, logsumexp) by the math in the module docstring, on any device."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = _scores(q, k, is_causal, attn_mask, scale)
    lse = torch.logsumexp(s, dim=-1)
    out = torch.matmul(torch.exp(s - lse.unsqueeze(-1)), _per_query_head(v, q.shape[1]))
    return _as_cpu_layout(out.to(q.dtype)), lse


def math_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  out: torch.Tensor, lse: torch.Tensor, is_causal: bool = False,
                  attn_mask: torch.Tensor | None = None,
                  scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of ``math_forward`` from its (out, logsumexp)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    p = torch.exp(_scores(q, k, is_causal, attn_mask, scale) - lse.float().unsqueeze(-1))
    do = grad_out.float()
    dv = _per_kv_head(torch.matmul(p.transpose(-2, -1), do), v.shape[1])
    rowsum = (do * out.float()).sum(-1, keepdim=True)
    ds = p * (torch.matmul(do, _per_query_head(v, q.shape[1]).transpose(-2, -1)) - rowsum)
    dq = torch.matmul(ds, _per_query_head(k, q.shape[1])) * scale
    dk = _per_kv_head(torch.matmul(ds.transpose(-2, -1), q.float()) * scale, k.shape[1])
    return tuple(_as_cpu_layout(g.to(x.dtype)) for g, x in ((dq, q), (dk, k), (dv, v)))


def _refuse_dropout(q: torch.Tensor, dropout_p: float) -> None:
    if dropout_p != 0.0 and q.device.type != "cpu":
        raise NotImplementedError(f"attention dropout ({dropout_p:g}) runs on the CPU only: its random draws "
                                  f"cannot be made the same on {q.device.type}.")


@torch.library.custom_op("shardwise::flash_attention", mutates_args=())
def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                    is_causal: bool = False, attn_mask: torch.Tensor | None = None,
                    scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    if q.device.type == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal,
                                                                 attn_mask=attn_mask, scale=scale)
    _refuse_dropout(q, dropout_p)
    if _flash_applies(q, k, v, dropout_p, attn_mask):
        res = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, False, scale=scale)
        return _as_cpu_layout(res[0]), res[1]
    return math_forward(q, k, v, is_causal, attn_mask, scale)


@flash_attention.register_fake
def _flash_attention_fake(q, k, v, dropout_p=0.0, is_causal=False, attn_mask=None, scale=None):
    b, h, length, _ = q.shape
    out = torch.empty((b, length, h, v.shape[-1]), dtype=q.dtype, device=q.device).transpose(1, 2)
    return out, q.new_empty((b, h, length), dtype=torch.float32)


@torch.library.custom_op("shardwise::flash_attention_backward", mutates_args=())
def flash_attention_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             out: torch.Tensor, lse: torch.Tensor, dropout_p: float, is_causal: bool,
                             attn_mask: torch.Tensor | None = None,
                             scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if q.device.type == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
    _refuse_dropout(q, dropout_p)
    if _flash_applies(q, k, v, dropout_p, attn_mask):
        # No dropout: the random state the kernel would read is never read.
        seed = torch.zeros(2, dtype=torch.uint64, device=q.device)
        offset = torch.zeros((), dtype=torch.uint64, device=q.device)
        grads = aten._scaled_dot_product_flash_attention_backward(
            grad_out, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], 0.0, is_causal, seed, offset,
            scale=scale)
        return tuple(_as_cpu_layout(g) for g in grads)
    return math_backward(grad_out, q, k, v, out, lse, is_causal, attn_mask, scale)


@flash_attention_backward.register_fake
def _flash_attention_backward_fake(grad_out, q, k, v, out, lse, dropout_p, is_causal, attn_mask=None,
                                   scale=None):
    def like(x: torch.Tensor) -> torch.Tensor:
        b, h, length, e = x.shape
        return torch.empty((b, length, h, e), dtype=x.dtype, device=x.device).transpose(1, 2)

    return like(q), like(k), like(v)


@register_flop_formula(torch.ops.shardwise.flash_attention, get_raw=True)
def _flop(q, k, v, *args, out_val=None, **kwargs) -> int:
    return sdpa_flop_count(q.shape, k.shape, v.shape)


@register_flop_formula(torch.ops.shardwise.flash_attention_backward, get_raw=True)
def _bwd_flop(grad_out, q, k, v, *args, out_val=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out.shape, q.shape, k.shape, v.shape)


# The CPU-only kernels a traced program holds, and the op that replaces each off the CPU.
DEVICE_PORTABLE = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: torch.ops.shardwise.flash_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default:
        torch.ops.shardwise.flash_attention_backward.default,
}


def make_portable(gm: torch.fx.GraphModule) -> int:
    """Swap ``gm``'s CPU-only kernels for their portable twins (the graph is recompiled by the
    caller); how many it swapped."""
    swapped = 0
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target in DEVICE_PORTABLE:
            n.target = DEVICE_PORTABLE[n.target]
            swapped += 1
    return swapped
