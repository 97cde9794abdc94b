"""square_grad: an RMSNorm backward's scalars move onto its small operand, the values bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from shardwise.passes import square_grad
from tests.passes.sp_graphs import count, hf_norm

aten = torch.ops.aten


def _is_copy_pow(n) -> bool:
    return n.op == "call_function" and n.target is aten.pow.Tensor_Scalar and n.args[1] == 1


def _norm_step(x, w, g):
    """An RMSNorm's forward and its gradients, as a training step's graph holds them."""
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    y = hf_norm(x, w, 1e-5)
    gx, gw = torch.autograd.grad(y, (x, w), g)
    return y, gx, gw


def _rewritten(fn, *args):
    gm = make_fx(fn)(*args)
    ref = copy.deepcopy(gm)
    return gm, ref, square_grad.find(gm), square_grad.apply(gm)


@pytest.mark.parametrize("hidden", [64, 24], ids=["power-of-two", "other"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_norm_backward_loses_three_full_size_ops_and_keeps_every_bit(hidden, dtype):
    torch.manual_seed(0)
    args = (torch.randn(3, 7, hidden, dtype=dtype), torch.randn(hidden, dtype=dtype),
            torch.randn(3, 7, hidden, dtype=dtype))
    gm, ref, (folds, copies), n = _rewritten(_norm_step, *args)
    assert (len(folds), len(copies), n) == (1, 0, 1)
    assert not any(_is_copy_pow(node) for node in gm.graph.nodes)
    # pow, mul by 2, expand and the division of the broadcast out; one division of the small operand in
    assert len(gm.graph.nodes) == len(ref.graph.nodes) - 3
    assert count(gm, aten.expand.default) == count(ref, aten.expand.default) - 1
    for seed in range(3):
        torch.manual_seed(seed)
        xs = [torch.randn_like(a) * 10 ** (seed - 1) for a in args]
        for got, want in zip(gm(*xs), ref(*xs), strict=True):
            assert torch.equal(got, want)


def _pattern(x, m, scale, read_div):
    g = aten.div.Scalar(aten.expand.default(m, list(x.shape)), 8)
    y = aten.mul.Tensor(g, aten.mul.Scalar(aten.pow.Tensor_Scalar(x, 1.0), scale))
    return (y, g) if read_div else (y,)


@pytest.mark.parametrize(("scale", "read_div"), [(3.0, False), (2.0, True)],
                         ids=["not-a-power-of-two", "division-read-elsewhere"])
def test_no_fold_where_it_would_round_differently_or_keep_the_full_size_division(scale, read_div):
    x, m = torch.randn(4, 8), torch.randn(4, 1)
    gm, ref, (folds, copies), n = _rewritten(lambda x, m: _pattern(x, m, scale, read_div), x, m)
    assert folds == [] and len(copies) == 1 and n == 1  # only the copy pow(x, 1.0) goes
    assert count(gm, aten.div.Scalar) == 1 and count(gm, aten.mul.Scalar) == 1
    for got, want in zip(gm(x, m), ref(x, m), strict=True):
        assert torch.equal(got, want)


def test_a_copy_that_is_returned_or_written_in_place_stays_a_copy():
    def returned(x):
        return aten.pow.Tensor_Scalar(x, 1.0), x * 2

    def written(x):
        p = aten.pow.Tensor_Scalar(x, 1.0)
        return aten.add_.Tensor(p, 1.0), x

    for fn in (returned, written):
        x = torch.randn(5)
        gm, ref, (folds, copies), n = _rewritten(fn, x)
        assert (folds, copies, n) == ([], [], 0)
        assert sum(map(_is_copy_pow, gm.graph.nodes)) == 1
        got, want = gm(x.clone()), ref(x.clone())
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_canonicalisation_folds_every_norm_of_a_llama_training_step():
    from shardwise.ir.trace import trace
    from shardwise.models import get_model
    from shardwise.passes.pipeline import canonicalize

    spec = get_model("llama-tiny")
    traced = trace(spec.build_module(), *spec.example_inputs(True))
    counts = canonicalize(traced)
    norms = 2 * spec.n_layers + 1
    assert counts["square_grad"] == norms
    assert not any(_is_copy_pow(node) for node in traced.gm.graph.nodes)
