"""Shared graph-matching helpers (shardwise/ir/match.py)."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from shardwise.ir.match import is_op, through_casts

aten = torch.ops.aten


def test_through_casts_walks_back_over_dtype_casts_only():
    """A weight upcast twice before its multiply is found behind both casts; an add under a
    cast is where the walk stops (it is not a cast)."""
    def f(w, x):
        return w.to(torch.float32).to(torch.float64) * (x + 1).to(torch.float64)

    gm = make_fx(f, tracing_mode="fake")(torch.randn(4, dtype=torch.bfloat16), torch.randn(4))
    mul = next(n for n in gm.graph.nodes if is_op(n, aten.mul.Tensor))
    w, x = (through_casts(a) for a in mul.args)
    assert w.op == "placeholder" and w.name == "w_1"
    assert is_op(x, aten.add.Tensor)
    assert through_casts(None) is None
