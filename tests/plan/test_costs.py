"""The planner's cost cache: nodes that look alike by op and shapes but do different work are
priced each by its own work, whatever order they are asked in."""

from __future__ import annotations

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
