"""The planner's cost cache: nodes that look alike by op and shapes but do different work are
priced each by its own work, whatever order they are asked in."""

from __future__ import annotations

import operator

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import Replicate

from shardwise.cost.hardware import get_hardware
from shardwise.plan.costs import PlannerCosts
from shardwise.plan.strategies import Strategy

MESH_SHAPE = (2,)
R = (Replicate(),)
N = 64


def _two_einsums():
    """One graph, two einsums over [N, N] operands into [N, N]: a matmul and a product."""
    graph = fx.Graph()
    with FakeTensorMode() as mode:
        vals = {"a": mode.from_tensor(torch.empty(N, N)), "b": mode.from_tensor(torch.empty(N, N))}
        args = []
        for name, val in vals.items():
            node = graph.placeholder(name)
            node.meta["val"] = val
            args.append(node)
        out = []
        for eq in ("ij,jk->ik", "ij,ij->ij"):
            node = graph.call_function(torch.ops.aten.einsum.default, (eq, args))
            node.meta["val"] = torch.einsum(eq, *vals.values())
            out.append(node)
    graph.output(tuple(out))
    return out


def test_like_shaped_einsums_are_priced_by_their_own_work_in_any_order():
    matmul, elementwise = _two_einsums()
    s = Strategy((R,), (R, R))
    costs = PlannerCosts(MESH_SHAPE, get_hardware("cpu"))
    first = (costs.compute_time(matmul, s), costs.compute_time(elementwise, s))
    costs = PlannerCosts(MESH_SHAPE, get_hardware("cpu"))
    second = (costs.compute_time(elementwise, s), costs.compute_time(matmul, s))
    assert first == second[::-1]
    assert first[0] > first[1]  # N^3 multiply-adds against N^2 products


def test_tensor_args_are_pytrees_flattening_of_every_node(tiny_two_layers):
    """The planner's hand walk of a node's arguments gives what pytree's flatten does: every
    tensor argument, repeats included, in (args, kwargs) order; on a whole training step and on
    lists and kwargs nested as fx allows."""
    from torch.utils._pytree import tree_flatten

    from shardwise.plan.plan import tensor_args

    def by_pytree(n: fx.Node) -> list[fx.Node]:
        flat, _ = tree_flatten((n.args, n.kwargs))
        return [a for a in flat if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]

    nodes = list(tiny_two_layers.gm.graph.nodes)
    assert any(len(tensor_args(n)) > len(set(tensor_args(n))) for n in nodes)  # a repeat: mul(x, x)
    assert any(isinstance(a, (list, tuple)) for n in nodes for a in n.args)  # cat's list
    for n in nodes:
        assert tensor_args(n) == by_pytree(n), n.format_node()
    g = fx.Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    for v in (x, y):
        v.meta["val"] = torch.empty(2)
    n = g.call_function(torch.ops.aten.cat.default, ([x, (y, x)],), {"out": [y], "dim": 0})
    assert tensor_args(n) == by_pytree(n) == [x, y, x, y]


def test_node_costs_hand_walk_matches_pytrees_on_a_whole_step(tiny_two_layers):
    """Bytes and FLOPs read off a node's arguments by the hand walk (``ir.meta.flat_tensors``,
    ``arg_values``) are what pytree's map and flatten give, on every node of a training step."""
    from torch.utils._pytree import tree_flatten, tree_map
    from torch.utils.flop_counter import flop_registry

    from shardwise.ir.flops import NodeCost, is_view, node_cost, tensor_bytes
    from shardwise.ir.meta import arg_values, flat_tensors

    def val(a):
        return a.meta.get("val") if isinstance(a, fx.Node) else a

    def by_pytree(n: fx.Node) -> NodeCost:
        if n.op != "call_function" or is_view(n) or n.target is operator.getitem:
            return NodeCost(0, 0, 0)
        args, kwargs = tree_map(val, (n.args, n.kwargs))
        formula = flop_registry.get(getattr(n.target, "overloadpacket", None))
        flops = int(formula(*args, **kwargs, out_val=n.meta.get("val"))) if formula else 0
        tensors = [v for v in tree_flatten((args, kwargs))[0] if isinstance(v, torch.Tensor)]
        outs = [v for v in tree_flatten(n.meta.get("val"))[0] if isinstance(v, torch.Tensor)]
        return NodeCost(flops, sum(map(tensor_bytes, tensors)), sum(map(tensor_bytes, outs)))

    nodes = list(tiny_two_layers.gm.graph.nodes)
    assert any(isinstance(n.meta.get("val"), tuple) for n in nodes)  # attention's several outputs
    for n in nodes:
        assert node_cost(n) == by_pytree(n), n.format_node()
        flat = [v for v in tree_flatten(tree_map(val, (n.args, n.kwargs)))[0] if isinstance(v, torch.Tensor)]
        assert [id(t) for t in flat_tensors(arg_values(n))] == [id(v) for v in flat]
    assert sum(node_cost(n).flops for n in nodes) > 0
