"""``runtime/inference.py``: a program run where autograd records nothing, its outputs ordinary."""

import torch

from shardwise.runtime.inference import without_autograd


def _program(x: torch.Tensor, w: torch.Tensor):
    y = (x @ w).t()  # a view: the output keeps its strides and offset
    return torch.is_inference_mode_enabled(), y, None, (2.0 * x)[1:]


def test_without_grad_it_runs_in_inference_mode_and_hands_back_ordinary_tensors():
    x, w = torch.randn(3, 4), torch.randn(4, 4, requires_grad=True)
    want = _program(x, w.detach())
    with torch.no_grad():
        inside, y, none, z = without_autograd(_program)(x, w)
    assert inside and none is None
    for got, ref in ((y, want[1]), (z, want[3])):
        assert not got.is_inference() and torch.equal(got, ref)
        assert got.stride() == ref.stride() and got.storage_offset() == ref.storage_offset()
        got.mul_(2.0)  # in place, outside inference mode: refused for an inference tensor
        assert torch.equal(got, 2.0 * ref)


def test_with_grad_it_runs_as_before():
    x, w = torch.randn(3, 4), torch.randn(4, 4, requires_grad=True)
    inside, y, _, _ = without_autograd(_program)(x, w)
    assert not inside and y.grad_fn is not None
    y.sum().backward()
    assert torch.allclose(w.grad, x.sum(0)[:, None].expand(4, 4))


def test_a_single_tensor_comes_back_ordinary():
    with torch.no_grad():
        out = without_autograd(lambda a: a + 1)(torch.zeros(2))
    assert not out.is_inference()
    out.add_(1)
    assert torch.equal(out, torch.full((2,), 2.0))
