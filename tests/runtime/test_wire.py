"""Graphs to bytes and back: the same program, nothing run on the way."""

from __future__ import annotations

import pickle

import torch
from torch import fx

import shardwise.ir.ops  # noqa: F401  (registers the shardwise ops the graphs below call)
from shardwise.runtime import wire
from shardwise.runtime.wire import WireGraph

aten = torch.ops.aten


def _graph(*, collective: bool) -> fx.GraphModule:
    """x * c + rms_norm(x, w) with constants c and w; optionally also an all_reduce of the constant alone
    on a group no process has (GraphModule's own pickling would run it while re-tracing)."""
    root = torch.nn.Module()
    root.c, root.w = torch.randn(4, 8), torch.randn(8)
    g = fx.Graph()
    x = g.placeholder("x")
    c = g.get_attr("c")
    norm = g.call_function(torch.ops.shardwise.rms_norm.default, (x, g.get_attr("w"), 1e-6))
    y = g.call_function(aten.add.Tensor, (g.call_function(aten.mul.Tensor, (x, c)), norm))
    if collective:
        r = g.call_function(torch.ops._c10d_functional.all_reduce.default, (c, "sum", "no-such-group"))
        g.output((y, r))
    else:
        g.output(y)
    return fx.GraphModule(root, g)


def _round_trip(gm: fx.GraphModule) -> fx.GraphModule:
    return pickle.loads(wire.dumps(WireGraph.of(gm))).module()


def test_a_graph_comes_back_node_for_node_and_computes_the_same():
    gm = _graph(collective=False)
    back = _round_trip(gm)
    assert [(n.op, n.name, n.target) for n in back.graph.nodes] == \
        [(n.op, n.name, n.target) for n in gm.graph.nodes]
    x = torch.randn(4, 8)
    torch.testing.assert_close(back(x), gm(x), rtol=0, atol=0)


def test_loading_runs_nothing():
    gm = _graph(collective=True)
    back = _round_trip(gm)  # an all_reduce run here would fail: its group does not exist
    assert sum("all_reduce" in str(n.target) for n in back.graph.nodes) == 1
    assert torch.equal(back.c, gm.c)
