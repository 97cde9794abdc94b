"""explain(): every alternative of a node or parameter, priced with the rest of the plan fixed."""

from __future__ import annotations

import copy
import operator

import pytest
import torch

from shardwise.errors import UserError
from shardwise.ir.trace import trace_model
from shardwise.mesh import Mesh
from shardwise.passes.pipeline import canonicalize
from shardwise.plan import make_plan
from shardwise.plan.costs import shard_factor
from shardwise.plan.explain import explain
from shardwise.plan.plan import NodeSpec, tensor_args
from shardwise.plan.planner import estimate
from shardwise.plan.strategies import enumerate_strategies, placeholder_choices

MESH = Mesh((2, 2), ("dp", "tp"))


@pytest.fixture(scope="module")
def inference():
    traced = trace_model("llama-tiny", train=False, layers=1)
    canonicalize(traced)
    return traced, make_plan(traced, MESH, clustering=False)


@pytest.fixture(scope="module")
def inference_8b():
    """A plan with collectives (llama-tiny's best plan needs none)."""
    traced = trace_model("llama3-8b", train=False, layers=1, batch=2, seq=256)
    canonicalize(traced)
    return traced, make_plan(traced, MESH, clustering=False)


@pytest.fixture(scope="module")
def training():
    traced = trace_model("llama-tiny", layers=1)
    canonicalize(traced)
    return traced, make_plan(traced, MESH, baseline="fsdp")


def _free_choices(traced, plan):
    """Nodes the ILP could re-decide alone (no follower tied to them, not following one
    themselves), with the strategies it had for each: at an optimum none of those is cheaper
    with the rest of the plan held."""
    ns = enumerate_strategies(traced.gm, MESH.device_mesh())
    tied = {st.follows for st in ns.values() if st.follows is not None}
    return {n: {(s.output[0], s.inputs) for s in st.strategies} for n, st in ns.items()
            if n.op == "call_function" and st.follows is None and st.alias_of is None and n not in tied
            and n.name in plan.nodes and isinstance(n.meta.get("val"), torch.Tensor)}


@pytest.mark.parametrize("case", ["inference", "inference_8b"])
def test_no_alternative_the_ilp_had_is_cheaper_at_an_optimum(case, request):
    traced, plan = request.getfixturevalue(case)
    assert plan.status == "optimal"
    assert plan.collectives or case == "inference"
    nodes = _free_choices(traced, plan)
    # Shared moves must play a part: some node reads a value another node reads too.
    assert any(len(a.users) > 1 for n in nodes for a in tensor_args(n))
    slack = 1e-6 * plan.info["objective_s"]  # the ILP's own tolerance, with room for rounding
    for n, offered in nodes.items():
        alts = explain(traced, plan, n.name).alternatives
        chosen = [a for a in alts if a.chosen]
        assert len(chosen) == 1, n.name
        best = min((a for a in alts if (a.output, a.inputs) in offered), key=lambda a: a.time_s)
        assert chosen[0].time_s <= best.time_s + slack, (n.name, chosen[0], best)


def test_an_alternative_changes_the_step_time_by_its_difference_from_the_choice(inference_8b):
    """explain's communication is exactly what an alternative adds: re-estimating the plan with
    only that node changed moves the step time by the difference (moves shared between readers
    counted once, as the ILP and the lowering do)."""
    traced, plan = inference_8b
    base = estimate(traced, plan).total_s
    shared = [n for n in traced.gm.graph.nodes if n.op == "call_function" and n.name in plan.nodes
              and isinstance(n.meta.get("val"), torch.Tensor) and n.target is not operator.getitem
              and (len(n.users) > 1 or any(len(a.users) > 1 for a in tensor_args(n)))]
    assert len(shared) >= 10
    checked = 0
    for n in shared:
        alts = explain(traced, plan, n.name).alternatives
        chosen = next(a for a in alts if a.chosen)
        for a in alts:
            other = copy.deepcopy(plan)
            other.nodes[n.name] = NodeSpec((a.output,), a.inputs)
            moved = estimate(traced, other).total_s - base
            assert moved == pytest.approx(a.time_s - chosen.time_s, rel=1e-9, abs=1e-12), (n.name, a)
            checked += a.comm_s != chosen.comm_s
    assert checked  # some alternatives move differently from the choice


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


def test_a_node_reading_one_value_twice_is_explained(inference):
    traced, plan = inference
    twice = [n for n in traced.gm.graph.nodes
             if n.op == "call_function" and len(set(tensor_args(n))) < len(tensor_args(n))]
    assert twice  # rotary embedding's cat(x, x)
    for n in twice:
        alts = explain(traced, plan, n.name).alternatives
        assert sum(a.chosen for a in alts) == 1
        assert all(len(a.inputs) == len(tensor_args(n)) for a in alts)


def test_an_unknown_name_is_refused(inference):
    traced, plan = inference
    with pytest.raises(UserError, match="neither a parameter nor"):
        explain(traced, plan, "no.such.weight")
