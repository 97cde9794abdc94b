"""Regions of a joint step: where the backward starts, the residual spine, what a view aliases."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from shardwise.ir import regions
from shardwise.ir.trace import trace_model
from shardwise.passes.pipeline import canonicalize

aten = torch.ops.aten
LAYERS = 2


def test_llama_regions_and_spine():
    traced = trace_model("llama-tiny", layers=LAYERS)
    canonicalize(traced)
    gm = traced.gm
    start = regions.backward_start(gm)
    assert start.target is aten.ones_like.default
    assert [n.name for n in regions.input_placeholders(gm)] == traced.inputs
    nodes = list(gm.graph.nodes)
    forward = nodes[:nodes.index(start)]
    loss = traced.node(traced.loss)
    chain = regions.spine(forward, loss, regions.input_placeholders(gm))
    # The embedding, two residual adds per layer, and the head down to the loss; no node of an
    # attention or MLP block.
    assert loss in chain
    assert any(n.target is aten.embedding.default for n in chain)
    assert sum(1 for n in chain if n.target is aten.add.Tensor) == 2 * LAYERS
    assert not any(n.target is aten.silu.default or n.target is aten.rsqrt.default for n in chain)


def test_inference_graph_has_no_backward():
    gm = trace_model("llama-tiny", layers=1, train=False).gm
    assert regions.backward_start(gm) is None


def _step(w: torch.Tensor, x: torch.Tensor):
    y = torch.tanh(x * w)
    loss = y.sum()
    kept = loss.detach()  # an alias of a forward scalar, before the seed: not the seed
    seed = torch.ones_like(loss)
    return loss, seed * (1 - y * y) * x * kept


def test_the_seed_is_not_an_alias():
    gm = make_fx(_step)(torch.randn(4), torch.randn(4))
    assert regions.backward_start(gm).target is aten.ones_like.default


def test_alias_root_follows_views_and_split_pieces():
    def f(x):
        y = torch.exp(x)
        a, b = y.split(2)
        return a.t(), b.view(-1), x.t()

    gm = make_fx(f)(torch.randn(4, 4))
    a_t, b_v, x_t = list(gm.graph.nodes)[-1].args[0]
    exp = next(n for n in gm.graph.nodes if n.target is aten.exp.default)
    assert regions.alias_root(a_t) is exp and regions.alias_root(b_v) is exp
    assert regions.alias_root(x_t).op == "placeholder"
    assert regions.is_view_op(a_t) and not regions.is_view_op(exp)
