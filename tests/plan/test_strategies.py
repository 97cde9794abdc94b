"""Strategy enumeration: asking DTensor once per distinct question changes nothing; our own
rules compute what they say."""

from __future__ import annotations

import operator

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.fx.experimental.proxy_tensor import make_fx

from shardwise.ir.trace import trace_model
from shardwise.mesh import Mesh
from shardwise.passes.pipeline import canonicalize
from shardwise.plan import strategies


@pytest.mark.parametrize("train", [True, False])
def test_one_question_per_distinct_node_gives_every_node_its_own_answer(monkeypatch, train):
    tr = trace_model("llama-tiny", layers=2, batch=4, seq=32, train=train)
    canonicalize(tr)
    mesh = Mesh((2, 2), ("dp", "tp")).device_mesh()
    asked = []
    real_ask = strategies._ask
    monkeypatch.setattr(strategies, "_ask", lambda *a: asked.append(a[0]) or real_ask(*a))
    shared = strategies.enumerate_strategies(tr.gm, mesh)
    ops = [n for n in shared if n.op == "call_function" and n.target is not operator.getitem]
    assert len(asked) < len(ops)  # some answers served several nodes (else this tests nothing)

    monkeypatch.setattr(strategies, "_question", lambda node, choices: node)  # every node afresh
    fresh = strategies.enumerate_strategies(tr.gm, mesh)
    assert shared.keys() == fresh.keys()
    for n in shared:
        assert shared[n].strategies == fresh[n].strategies, n.format_node()
        assert (shared[n].follows, shared[n].fallback) == (fresh[n].follows, fresh[n].fallback)


def _local(x: torch.Tensor, p, rank: int, share: torch.Tensor) -> torch.Tensor:
    """Rank ``rank``'s piece of ``x`` in placement ``p`` over two ranks (``share``: rank 0's part
    of a Partial sum)."""
    if isinstance(p, Shard):
        return x.chunk(2, p.dim)[rank]
    if isinstance(p, Partial):
        return share if rank == 0 else x - share
    return x


def _whole(pieces: list[torch.Tensor], p) -> torch.Tensor:
    if isinstance(p, Shard):
        return torch.cat(pieces, p.dim)
    if isinstance(p, Partial):
        return pieces[0] + pieces[1]
    assert torch.equal(pieces[0], pieces[1])
    return pieces[0]


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_every_way_to_stack_is_offered_and_each_computes_the_stack(dim):
    """stack gets a strategy for every placement that does not split the new dim (DTensor's rule
    gives one), and each, run on two ranks' pieces, gives the whole stack in the output
    placement it names."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(4, 6, 8, generator=g), torch.randn(4, 6, 8, generator=g)
    gm = make_fx(lambda x, y: torch.stack([x, y], dim), tracing_mode="fake")(a, b)
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    found = strategies.enumerate_strategies(gm, Mesh((2,), ("x",)).device_mesh())[node]
    outs = {s.output[0][0] for s in found.strategies}
    assert outs == {Replicate(), Partial(), *(Shard(d) for d in range(4))} - {Shard(dim % 4)}
    assert not found.fallback
    whole = torch.stack([a, b], dim)
    for s in found.strategies:
        shares = [torch.randn(4, 6, 8, generator=g) for _ in range(2)]
        pieces = [torch.stack([_local(x, ps[0], r, sh)
                               for x, ps, sh in zip((a, b), s.inputs, shares, strict=True)], dim)
                  for r in range(2)]
        torch.testing.assert_close(_whole(pieces, s.output[0][0]), whole)


def test_a_constant_made_in_the_forward_is_placed_as_the_constant_not_a_fallback():
    gm = make_fx(lambda x: torch.where(x > 0, x, torch.tensor(-1.0)), tracing_mode="fake")(torch.randn(4, 8))
    ns = strategies.enumerate_strategies(gm, Mesh((2,), ("x",)).device_mesh())
    (copy,) = [n for n in gm.graph.nodes if n.target is torch.ops.aten.lift_fresh_copy.default]
    assert not ns[copy].fallback and ns[copy].strategies
    assert all(s.output == s.inputs for s in ns[copy].strategies)


@pytest.mark.parametrize("backward", [
    lambda g, x: torch.ops.aten.softplus_backward(g, x, 1.0, 20.0),
    lambda g, x: torch.ops.aten.leaky_relu_backward(g, x, 0.01, False),
    lambda g, x: torch.ops.aten.elu_backward(g, 1.0, 1.0, 1.0, False, x),
    lambda g, x: torch.ops.aten.mish_backward(g, x),
    lambda g, x: torch.ops.aten.hardtanh_backward(g, x, -1.0, 1.0),
])
def test_activation_gradients_are_planned_elementwise_and_each_strategy_computes_them(backward):
    """DTensor has no rule for these (softplus: Apertus's xIELU); ours shards or replicates all
    three alike, or takes the gradient Partial with the input whole, and each strategy, run on
    two ranks' pieces, gives the whole op's result."""
    g = torch.Generator().manual_seed(0)
    grad, x = torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)
    gm = make_fx(backward, tracing_mode="fake")(grad, x)
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    found = strategies.enumerate_strategies(gm, Mesh((2,), ("x",)).device_mesh())[node]
    assert not found.fallback
    assert {s.output[0][0] for s in found.strategies} == {Replicate(), Partial(), Shard(0), Shard(1)}
    whole = backward(grad, x)
    for s in found.strategies:
        shares = [torch.randn(4, 6, generator=g) for _ in range(2)]
        pieces = [backward(*(_local(t, ps[0], r, sh)
                             for t, ps, sh in zip((grad, x), s.inputs, shares, strict=True)))
                  for r in range(2)]
        torch.testing.assert_close(_whole(pieces, s.output[0][0]), whole)
