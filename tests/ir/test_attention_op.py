"""``shardwise::flash_attention``: the portable twin of the CPU-only attention kernels a trace holds.

Its math (what runs on a device where PyTorch's flash kernels do not apply) is checked against
the CPU kernels on random inputs, values and memory layout; a traced training step with its
kernels swapped computes what the original computes.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from shardwise.ir.ops.attention import make_portable, math_backward, math_forward
from shardwise.ir.trace import trace

aten = torch.ops.aten
B, H, L, S, E = 2, 3, 6, 6, 8


def _qkv(dtype: torch.dtype, seed: int, s: int = S, kv_heads: int = H) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    # q, k and v as a model makes them: [B, L, H, E] in memory, viewed as [B, H, L, E].
    return tuple(torch.randn(B, n, h, E, generator=g).to(dtype).transpose(1, 2)
                 for n, h in ((L, H), (s, kv_heads), (s, kv_heads)))


def _mask(kind: str | None, s: int, dtype: torch.dtype) -> torch.Tensor | None:
    """An additive mask in the query's dtype (the CPU kernel takes no other): random biases, or
    0 / -inf (keys a query may not see)."""
    g = torch.Generator().manual_seed(7)
    if kind == "hide":
        hidden = torch.rand(L, s, generator=g) < 0.3
        hidden[:, 0] = False  # every query sees a key (a row with none has no softmax)
        return torch.zeros(L, s).masked_fill(hidden, -torch.inf).to(dtype)
    return torch.randn(L, s, generator=g).to(dtype) if kind == "bias" else None


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("is_causal, mask, scale, s, kv_heads", [
    (True, None, None, S, H), (False, None, 0.3, S + 3, H), (False, "hide", None, S + 3, H),
    (False, "bias", 0.5, S, H), (True, None, None, S, 1), (False, "bias", None, S + 3, 1),
])
def test_math_matches_the_cpu_kernels_values_and_layout(dtype, tol, is_causal, mask, scale, s, kv_heads):
    """... with grouped-query attention too (one k/v head for the three query heads)."""
    q, k, v = _qkv(dtype, seed=s, s=s, kv_heads=kv_heads)
    attn_mask = _mask(mask, s, dtype)
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, attn_mask=attn_mask,
                                                                 scale=scale)
    got_out, got_lse = math_forward(q, k, v, is_causal, attn_mask, scale)
    torch.testing.assert_close(got_out, out, atol=tol, rtol=tol)
    torch.testing.assert_close(got_lse, lse.float(), atol=tol, rtol=tol)
    assert got_out.stride() == out.stride()

    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    want = aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, q, k, v, out, lse, 0.0, is_causal, attn_mask=attn_mask, scale=scale)
    got = math_backward(grad_out, q, k, v, got_out, got_lse, is_causal, attn_mask, scale)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=tol * 4, rtol=tol * 4)
        assert g.stride() == w.stride() and g.dtype == w.dtype


def test_fake_outputs_are_laid_out_as_the_cpu_kernels_lay_theirs_out():
    with FakeTensorMode():
        q, k, v = (torch.empty(B, L, H, E).transpose(1, 2) for _ in range(3))
        ours = torch.ops.shardwise.flash_attention(q, k, v, 0.0, True)
        theirs = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
        assert [(t.shape, t.stride()) for t in ours[:1]] == [(t.shape, t.stride()) for t in theirs[:1]]
        assert ours[1].shape == theirs[1].shape
        grads = torch.ops.shardwise.flash_attention_backward(ours[0], q, k, v, ours[0], ours[1], 0.0, True)
        want = aten._scaled_dot_product_flash_attention_for_cpu_backward(ours[0], q, k, v, ours[0], ours[1],
                                                                         0.0, True)
        assert [(t.shape, t.stride()) for t in grads] == [(t.shape, t.stride()) for t in want]


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(H * E, 3 * H * E)
        self.out = nn.Linear(H * E, H * E)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.view(B, L, H, E).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, L, H * E)
        return self.out(y).pow(2).mean()


def test_a_training_step_with_its_kernels_swapped_computes_the_same():
    torch.manual_seed(0)
    model = _Attention()
    x = torch.randn(B, L, H * E)
    traced = trace(model, x, train=True)
    portable = copy.deepcopy(traced.gm)
    assert make_portable(portable) == 2  # the forward kernel and its backward
    portable.recompile()
    targets = {n.target for n in portable.graph.nodes}
    assert torch.ops.shardwise.flash_attention.default in targets
    assert aten._scaled_dot_product_flash_attention_for_cpu.default not in targets
    params = [model.get_parameter(k).detach() for k in traced.params]
    want = traced.gm(*params, x)
    got = portable(*params, x)
    assert len(got) == len(want) == 1 + len(params)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=0, rtol=0)
