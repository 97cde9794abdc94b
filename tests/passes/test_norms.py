"""RMSNorm ops and their canonicalisation: every decomposed form becomes the op, numerics kept."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils.flop_counter import FlopCounterMode

from shardwise.ir.flops import node_cost
from shardwise.ir.ops.norms import rms_norm_flops, rms_norm_reference
from shardwise.passes import norms
from tests.passes.sp_graphs import count, hf_norm, llama_norm

sw = torch.ops.shardwise
aten = torch.ops.aten
H = 16


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _canonicalise(fn, *args):
    gm = make_fx(fn)(*args)
    ref = copy.deepcopy(gm)
    return gm, ref, norms.apply(gm)


def f_rms_norm(x, w, eps):
    return F.rms_norm(x, (x.shape[-1],), w, eps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("form", [llama_norm, hf_norm, f_rms_norm], ids=["llama", "hf", "F.rms_norm"])
def test_each_decomposed_form_becomes_one_op(form, dtype):
    x, w = torch.randn(2, 5, H, dtype=dtype), torch.randn(H, dtype=dtype)
    gm, ref, n = _canonicalise(lambda x, w: form(x, w, 1e-5), x, w)
    assert n == 1
    assert count(gm, sw.rms_norm.default) == 1
    assert aten.rsqrt.default not in _targets(gm) and aten.mean.dim not in _targets(gm)
    torch.testing.assert_close(gm(x, w), ref(x, w), rtol=0, atol=0)


def test_llama_forward_gets_norm_and_residual_ops():
    from shardwise.models import get_model

    spec = get_model("llama-tiny")
    torch.manual_seed(0)
    model = spec.build_module().eval()
    params = {k: v.detach() for k, v in model.named_parameters()}
    tokens = spec.example_inputs(False)[0]
    gm, ref, n = _canonicalise(lambda p, t: torch.func.functional_call(model, p, (t,)), params, tokens)
    layers = spec.n_layers
    # First norm on the embedding, then one add_rms_norm2 per residual add that feeds the next
    # block, and the final add into the last norm fused as add_rms_norm.
    assert count(gm, sw.rms_norm.default) == 1
    assert count(gm, sw.add_rms_norm2.default) == 2 * layers - 1
    assert count(gm, sw.add_rms_norm.default) == 1
    assert n == (2 * layers + 1) + (2 * layers)
    assert aten.rsqrt.default not in _targets(gm)
    torch.testing.assert_close(gm(params, tokens), ref(params, tokens), rtol=0, atol=0)


def test_residual_add_into_norm_only():
    def f(a, b, w):
        return llama_norm(a + b, w, 1e-5)

    args = (torch.randn(3, H), torch.randn(3, H), torch.randn(H))
    gm, ref, _ = _canonicalise(f, *args)
    assert _targets(gm) == [sw.add_rms_norm.default]
    torch.testing.assert_close(gm(*args), ref(*args), rtol=0, atol=0)


def test_residual_add_read_elsewhere_keeps_sum():
    def f(a, b, w):
        s = a + b
        return s * 3.0, llama_norm(s, w, 1e-5)

    args = (torch.randn(3, H), torch.randn(3, H), torch.randn(H))
    gm, ref, _ = _canonicalise(f, *args)
    assert count(gm, sw.add_rms_norm2.default) == 1 and aten.add.Tensor not in _targets(gm)
    torch.testing.assert_close(gm(*args), ref(*args), rtol=0, atol=0)


def test_bias_shaped_add_is_not_fused():
    def f(a, bias, w):
        return llama_norm(a + bias, w, 1e-5)

    args = (torch.randn(3, H), torch.randn(H), torch.randn(H))
    gm, ref, _ = _canonicalise(f, *args)
    assert _targets(gm) == [aten.add.Tensor, sw.rms_norm.default]
    torch.testing.assert_close(gm(*args), ref(*args), rtol=0, atol=0)


def test_forms_that_are_not_rms_norm_are_left_alone():
    def mean_over_dim0(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(0, keepdim=True) + 1e-5))

    def bf16_without_upcast(x, w):  # statistics in bf16: not the op's precision
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))

    def intermediate_read_elsewhere(x, w):
        r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
        return w * (x * r), r

    for fn, dtype in ((mean_over_dim0, torch.float32), (bf16_without_upcast, torch.bfloat16),
                      (intermediate_read_elsewhere, torch.float32)):
        x, w = torch.randn(4, H, dtype=dtype), torch.randn(H, dtype=dtype)
        gm, _, n = _canonicalise(fn, x, w)
        assert n == 0 and count(gm, sw.rms_norm.default) == 0, fn.__name__


def test_joint_training_graph_norms_are_left_alone():
    from shardwise.ir.trace import trace_model

    traced = trace_model("llama-tiny", train=True, layers=1, batch=1, seq=8)
    n = norms.apply(traced.gm)
    assert n == 0  # the backward reads each norm's rsqrt
    assert count(traced.gm, sw.rms_norm.default) == 0


def test_ops_real_fake_and_costs():
    x, r, w = torch.randn(2, 4, H), torch.randn(2, 4, H), torch.randn(H)
    torch.testing.assert_close(sw.rms_norm(x, w, 1e-5), rms_norm_reference(x, w, 1e-5))
    normed, total = sw.add_rms_norm2(x, r, w, 1e-5)
    torch.testing.assert_close(total, x + r)
    torch.testing.assert_close(normed, sw.add_rms_norm(x, r, w, 1e-5))
    xb = x.bfloat16()
    out = sw.rms_norm(xb, w.bfloat16(), 1e-5)
    assert out.dtype == torch.bfloat16
    # Statistics in float32 even for a bf16 input.
    expected = w.bfloat16() * (x.bfloat16().float() * torch.rsqrt(
        xb.float().pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16()
    torch.testing.assert_close(out, expected, rtol=0, atol=0)

    gm = make_fx(lambda x, r, w: sw.add_rms_norm2(x, r, w, 1e-5), tracing_mode="fake")(x, r, w)
    op = next(n for n in gm.graph.nodes if n.target is sw.add_rms_norm2.default)
    assert [tuple(v.shape) for v in op.meta["val"]] == [(2, 4, H), (2, 4, H)]
    cost = node_cost(op)
    assert cost.flops == rms_norm_flops((2, 4, H), fused_add=True) > rms_norm_flops((2, 4, H))
    assert cost.bytes_read == 4 * (2 * x.numel() + H) and cost.bytes_written == 4 * 2 * x.numel()
    with FlopCounterMode(display=False) as fc:
        sw.rms_norm(x, w, 1e-5)
    assert fc.get_total_flops() == rms_norm_flops(x.shape)
