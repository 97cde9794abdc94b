"""Direct calls (runtime/bindings.py): each listed op's Python binding reaches the same ATen op
and computes the same bits; a whole training step called through them equals its graph."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from shardwise.runtime.bindings import DIRECT_CALLS, direct_calls

aten = torch.ops.aten


class _Record(TorchDispatchMode):
    """The ATen ops a call reaches, as op packets (``mul``, not ``mul.Scalar``)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket)
        return func(*args, **(kwargs or {}))


def _samples() -> dict:
    """Arguments as a traced graph passes them, per op: (args, kwargs)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 6, 8, generator=g)
    w = torch.randn(5, 8, generator=g)
    ones = torch.randn(4, 1, 8, generator=g)
    return {
        aten.view.default: ((x, [24, 8]), {}),
        aten.reshape.default: ((x.transpose(0, 1), [24, 8]), {}),  # not contiguous: a copy
        aten.t.default: ((w,), {}),
        aten.transpose.int: ((x, 1, 2), {}),
        aten.permute.default: ((x, [2, 0, 1]), {}),
        aten.expand.default: ((ones, [4, 6, 8]), {}),
        aten.unsqueeze.default: ((x, 2), {}),
        aten.squeeze.dims: ((ones, [1]), {}),
        aten.split.Tensor: ((x, 4, -1), {}),
        aten.cat.default: (([x, ones.expand(4, 6, 8)], -1), {}),
        aten.clone.default: ((x.transpose(1, 2),), {"memory_format": torch.contiguous_format}),
        aten.mm.default: ((x.view(24, 8), w.t()), {}),
        aten.bmm.default: ((x, x.transpose(1, 2)), {}),
        aten.mul.Tensor: ((x, ones), {}),
        aten.mul.Scalar: ((x, -0.5), {}),
        aten.add.Tensor: ((x, 1e-5), {}),
        aten.sub.Tensor: ((x, ones), {}),
        aten.div.Tensor: ((x, ones.abs() + 1), {}),
        aten.div.Scalar: ((x, 64), {}),
        aten.neg.default: ((x,), {}),
        aten.pow.Tensor_Scalar: ((x, 3), {}),
        aten.rsqrt.default: ((x.abs() + 1,), {}),
        aten.sum.dim_IntList: ((x, [0, 1], True), {}),
        aten.mean.dim: ((x, [-1], True), {}),
        aten.silu.default: ((x,), {}),
        aten.embedding.default: ((w, torch.randint(0, 5, (4, 6), generator=g)), {}),
    }


def _same_bits(got, want) -> bool:
    got, want = tree_leaves(got), tree_leaves(want)
    return len(got) == len(want) and all(
        a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride() and torch.equal(a, b)
        for a, b in zip(got, want, strict=True))


SAMPLES = _samples()


def test_every_direct_call_has_a_sample():
    assert set(SAMPLES) == set(DIRECT_CALLS)


@pytest.mark.parametrize("op", list(DIRECT_CALLS), ids=str)
def test_a_binding_reaches_the_same_aten_op_and_bits(op):
    args, kwargs = SAMPLES[op]
    with _Record() as via_op:
        want = op(*args, **kwargs)
    with _Record() as via_binding:
        got = DIRECT_CALLS[op](*args, **kwargs)
    assert via_binding.ops == via_op.ops and via_op.ops
    assert _same_bits(got, want)


def test_a_training_step_called_directly_computes_the_same_bits():
    from benchmarks.bindings import step_graph

    gm, args = step_graph("llama-tiny", layers=2, batch=4, seq=8)
    fast = direct_calls(gm)
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    direct = [n for n in fast.graph.nodes if n.op == "call_function" and n.target in DIRECT_CALLS.values()]
    # Most of a step's ops are listed; the graph handed in keeps its OpOverloads.
    assert len(direct) > len(calls) / 2
    assert not any(n.target in DIRECT_CALLS.values() for n in calls)
    assert _same_bits(fast(*args), gm(*args))
