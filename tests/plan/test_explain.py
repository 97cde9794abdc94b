"""explain(): every alternative of a node or parameter, priced with the rest of the plan fixed."""

from __future__ import annotations

import pytest
import torch

from shardwise.errors import UserError
from shardwise.ir.trace import trace_model
from shardwise.mesh import Mesh
from shardwise.passes.pipeline import canonicalize
from shardwise.plan import make_plan
from shardwise.plan.costs import shard_factor
from shardwise.plan.explain import explain
from shardwise.plan.plan import tensor_args
from shardwise.plan.strategies import placeholder_choices

MESH = Mesh((2, 2), ("dp", "tp"))


@pytest.fixture(scope="module")
def inference():
    traced = trace_model("llama-tiny", train=False, layers=1)
    canonicalize(traced)
    return traced, make_plan(traced, MESH, clustering=False)


@pytest.fixture(scope="module")
def training():
    traced = trace_model("llama-tiny", layers=1)
    canonicalize(traced)
    return traced, make_plan(traced, MESH, baseline="fsdp")


def _isolated(traced, plan) -> list[torch.fx.Node]:
    """Nodes whose choice no other node shares: two or more inputs that only they read, one
    reader of their output (so moving a value once for several readers plays no part)."""
    return [n for n in traced.gm.graph.nodes
            if n.op == "call_function" and n.name in plan.nodes and len(tensor_args(n)) >= 2
            and len(n.users) == 1 and all(len(a.users) == 1 for a in tensor_args(n))
            and isinstance(n.meta.get("val"), torch.Tensor)]


def test_an_optimal_plan_has_no_cheaper_alternative_at_an_isolated_node(inference):
    traced, plan = inference
    nodes = _isolated(traced, plan)
    assert nodes  # the check below must look at something
    for n in nodes:
        alts = explain(traced, plan, n.name).alternatives
        chosen = [a for a in alts if a.chosen]
        assert len(chosen) == 1, n.name
        best = min(a.time_s for a in alts)
        assert chosen[0].time_s <= best * (1 + 1e-9) + 1e-15, (n.name, chosen[0], alts[0])


def test_a_parameter_lists_every_placement_with_its_memory(training):
    traced, plan = training
    name = "layers.0.attention.wq.weight"
    ex = explain(traced, plan, name)
    val = traced.node(traced.params[name]).meta["val"]
    assert {a.output for a in ex.alternatives} == set(placeholder_choices(val, MESH.shape))
    assert [a.output for a in ex.alternatives if a.chosen] == [plan.params[name]]
    full = max(a.memory_bytes for a in ex.alternatives)
    for a in ex.alternatives:  # parameter, gradient and Adam state, split as the placement splits
        assert a.memory_bytes * shard_factor(a.output, MESH.shape) == full
        assert a.compute_s == 0.0 and a.comm_s >= 0.0


def test_an_unknown_name_is_refused(inference):
    traced, plan = inference
    with pytest.raises(UserError, match="neither a parameter nor"):
        explain(traced, plan, "no.such.weight")
