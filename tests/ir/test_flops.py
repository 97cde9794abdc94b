"""Per-node cost facts: FLOP formulas (einsum of any batch rank), bytes, views, and agreement
with torch.utils.flop_counter."""

from __future__ import annotations

import math

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from shardwise.ir.flops import einsum_flops, graph_flops, is_view, node_cost, node_flops

aten = torch.ops.aten


def nodes_of(fn, *args):
    gm = make_fx(fn, tracing_mode="fake")(*args)
    return gm, [n for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize(("equation", "shapes", "letters"), [
    ("bsk,kn->bsn", [(2, 3, 4), (4, 5)], {"b": 2, "s": 3, "k": 4, "n": 5}),
    ("bsuk,kn->bsun", [(2, 3, 6, 4), (4, 5)], {"b": 2, "s": 3, "u": 6, "k": 4, "n": 5}),
    ("bn,bk->nk", [(7, 5), (7, 4)], {"b": 7, "n": 5, "k": 4}),
    ("bsn,bsk->nk", [(2, 3, 5), (2, 3, 4)], {"b": 2, "s": 3, "n": 5, "k": 4}),
])
def test_einsum_flops_is_two_per_multiply_add(equation, shapes, letters):
    expected = 2 * math.prod(letters.values())
    assert einsum_flops(equation, [torch.Size(s) for s in shapes]) == expected
    # torch's counter (which sees the einsum's bmm decomposition) agrees
    tensors = [torch.randn(*s) for s in shapes]
    with FlopCounterMode(display=False) as counter:
        torch.einsum(equation, *tensors)
    assert counter.get_total_flops() == expected


def test_einsum_formula_is_registered_and_one_operand_einsum_is_free():
    assert aten.einsum in flop_registry
    assert einsum_flops("bsk->bks", [torch.Size((2, 3, 4))]) == 0


def test_node_flops_of_mm_and_einsum_nodes():
    gm, nodes = nodes_of(lambda a, b, x, w: (a @ b, torch.einsum("bsk,kn->bsn", x, w)),
                         torch.randn(6, 4), torch.randn(4, 5), torch.randn(2, 3, 4), torch.randn(4, 5))
    (mm,) = [n for n in nodes if n.target is aten.mm.default]
    assert node_flops(mm) == 2 * 6 * 4 * 5
    # make_fx decomposes einsum; a graph holding aten.einsum itself is costed by our formula
    g = torch.fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    x.meta["val"], w.meta["val"] = torch.empty(2, 3, 4, device="meta"), torch.empty(4, 5, device="meta")
    e = g.call_function(aten.einsum.default, ("bsk,kn->bsn", [x, w]))
    e.meta["val"] = torch.empty(2, 3, 5, device="meta")
    assert node_flops(e) == 2 * 2 * 3 * 4 * 5
    assert graph_flops(gm) == 2 * 6 * 4 * 5 + 2 * 2 * 3 * 4 * 5


def test_node_cost_bytes_and_free_views():
    _, nodes = nodes_of(lambda a, b: (a @ b).view(2, 3, 5) + 1,
                        torch.randn(6, 4, dtype=torch.float32), torch.randn(4, 5, dtype=torch.float32))
    mm = next(n for n in nodes if n.target is aten.mm.default)
    view = next(n for n in nodes if n.target is aten.view.default)
    add = next(n for n in nodes if n.target is aten.add.Tensor)
    assert node_cost(mm).bytes_read == (6 * 4 + 4 * 5) * 4
    assert node_cost(mm).bytes_written == 6 * 5 * 4
    assert is_view(view) and node_cost(view).bytes == 0 and node_cost(view).flops == 0
    assert node_cost(add).flops == 0 and node_cost(add).bytes == 2 * 6 * 5 * 4


def test_graph_flops_agrees_with_flop_counter_on_a_joint_llama():
    from shardwise.ir.trace import trace_model
    from tests.helpers import real_inputs_for

    traced = trace_model("llama-tiny", layers=1)
    with FlopCounterMode(display=False) as counter:
        traced.gm(*real_inputs_for(traced.gm))
    assert graph_flops(traced.gm) == counter.get_total_flops() > 0
