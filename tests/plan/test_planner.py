"""Planner behaviour on small models: optimality under clustering, baselines, memory, plan files."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from shardwise.errors import UserError
from shardwise.ir.trace import Phase, trace_model
from shardwise.mesh import Mesh
from shardwise.passes.pipeline import canonicalize
from shardwise.plan import BASELINES, Constraints, Plan, estimate, make_plan
from shardwise.plan.cluster import cluster, regions
from shardwise.plan.planner import no_plan_reason
from tests.helpers import BLOOM_TINY

MESH = Mesh((2,), hardware="h100")


def _traced(layers: int, *, batch: int = 8, seq: int = 64):
    tr = trace_model("llama-tiny", layers=layers, batch=batch, seq=seq)
    canonicalize(tr)
    return tr


@pytest.fixture(scope="module")
def tiny2():
    return _traced(2)


@pytest.mark.parametrize("layers", [2, 4])
def test_clustering_keeps_the_optimum(layers):
    tr = _traced(layers)
    on = make_plan(tr, MESH)
    off = make_plan(tr, MESH, clustering=False)
    assert on.status == off.status == "optimal"
    assert math.isclose(on.info["objective_s"], off.info["objective_s"], rel_tol=1e-6)
    assert on.info["ilp"]["variables"] < off.info["ilp"]["variables"]


def test_identical_layers_share_variables():
    three, five = _traced(3), _traced(5)
    c3, c5 = cluster(three), cluster(five)
    # Two more layers add nodes to the graph but no representatives.
    assert len(c5.rep) > len(c3.rep)
    assert len(c5.representatives) == len(c3.representatives)


@pytest.mark.parametrize("layers", [2, 4])
def test_the_last_layers_backward_joins_its_cluster_where_it_lines_up(layers):
    """The last layer's backward lacks the add that sums the residual's gradient with the next
    layer's, so it matches no other layer exactly; its nodes still line up with theirs and share
    their variables, each with a representative of its own op and shape that comes before it in
    the graph (with two layers, the two backwards pair up). Its nodes that read its parameters
    (kept gathered from the forward, so read in other placements) or make their gradients keep
    their own variables, as do the followers that read those."""
    tr = _traced(layers)
    clus = cluster(tr)
    (backward,) = [c for c in clus.clusters if tr.phase(c[0][0]) is Phase.BACKWARD]
    assert len(backward) == layers
    index = {n: i for i, n in enumerate(tr.gm.graph.nodes)}
    for copy in backward:
        for n in copy:
            r = clus.rep[n]
            assert index[r] <= index[n] and r.target == n.target
            assert _shapes(r.meta["val"]) == _shapes(n.meta["val"])
    sizes = sorted(map(len, backward))
    assert sizes[0] > sizes[-1] / 2 and len(set(sizes[1:])) == 1
    # the copy that lacks nodes is the last layer's; its einsums that read a weight are apart
    region = regions(tr)
    last = min(backward, key=len)
    assert {region[n] for n in last} == {layers - 1}
    weights = {tr.node(p) for p in tr.params.values()}
    for n in tr.gm.graph.nodes:  # and their transposes (the backward reads t(t(w)))
        if n.target is torch.ops.aten.t.default and n.args[0] in weights:
            weights.add(n)
    apart = [n for n in tr.gm.graph.nodes if region.get(n) == layers - 1 and tr.phase(n) is Phase.BACKWARD
             and n.target is torch.ops.aten.einsum.default and set(n.all_input_nodes) & weights]
    assert apart and all(n not in last and clus.rep[n] is n for n in apart)


def _shapes(val) -> list:
    vals = val if isinstance(val, tuple) else (val,)
    return [tuple(v.shape) if v is not None else None for v in vals]


def test_objective_equals_node_by_node_estimate(tiny2):
    plan = make_plan(tiny2, MESH)
    total = plan.estimate.total_s
    again = estimate(tiny2, plan)
    assert math.isclose(plan.info["objective_s"], total, rel_tol=1e-6)
    assert math.isclose(again.total_s, total, rel_tol=1e-12)


def test_auto_never_worse_than_a_baseline(tiny2):
    auto = make_plan(tiny2, MESH)
    priced = 0
    for name in BASELINES:
        b = make_plan(tiny2, MESH, baseline=name)
        if b is None:
            continue
        priced += 1
        assert b.status == "optimal"
        assert auto.estimate.total_s <= b.estimate.total_s * (1 + 1e-9)
    assert priced >= 2  # ddp and fsdp apply on a 1-D mesh


def test_baselines_fix_what_they_say(tiny2):
    ddp = make_plan(tiny2, MESH, baseline="ddp")
    fsdp = make_plan(tiny2, MESH, baseline="fsdp")
    assert all(ps == (Replicate(),) for ps in ddp.params.values())
    assert fsdp.params["layers.0.attention.wq.weight"] == (Shard(0),)
    # FSDP keeps less per device than DDP; its weights are gathered for use and its gradients
    # reduced (reduce_scatter, or all_reduce then a free local slice: the cost model decides).
    assert fsdp.estimate.memory_bytes < ddp.estimate.memory_bytes
    assert "all_gather" in fsdp.collectives
    assert {"reduce_scatter", "all_reduce"} & set(fsdp.collectives)
    # fsdp_tp needs a tp mesh dim.
    assert make_plan(tiny2, MESH, baseline="fsdp_tp") is None


def test_memory_budget_binds(tiny2):
    # 80% of the free plan's memory: its MIP takes 0.6 s on a quiet 2-core machine (at 70% it
    # took 14 s, and beside the suite the stall guard could stop it short of its proof).
    free = make_plan(tiny2, MESH)
    tight = make_plan(tiny2, MESH, memory_budget=free.estimate.memory_bytes * 0.8)
    assert tight.status == "optimal"
    assert tight.estimate.memory_bytes <= free.estimate.memory_bytes * 0.8
    sharded = lambda p: sum(any(isinstance(x, Shard) for x in ps) for ps in p.params.values())  # noqa: E731
    assert sharded(tight) > sharded(free)
    impossible = make_plan(tiny2, MESH, memory_budget=1000)
    assert impossible.status == "infeasible"
    assert impossible.info["min_memory_bytes"] > 1000


def test_inference_weights_count_against_the_budget():
    tr = trace_model("llama-tiny", train=False, layers=2, batch=8, seq=64)
    canonicalize(tr)
    weights = sum(tr.node(ph).meta["val"].nbytes for ph in tr.params.values())
    free = make_plan(tr, MESH)
    assert free.estimate.memory_bytes > weights * 0.7  # the unconstrained plan would not fit
    tight = make_plan(tr, MESH, memory_budget=weights * 0.7)
    assert tight.status == "optimal" and tight.estimate.memory_bytes <= weights * 0.7
    assert tight.info["objective_s"] >= free.info["objective_s"] * (1 - 1e-9)
    impossible = make_plan(tr, MESH, memory_budget=weights * 0.4)  # less than half: not even fully sharded
    assert impossible.status == "infeasible" and impossible.info["min_memory_bytes"] > weights * 0.4


@pytest.mark.parametrize("status, name, floor, needle", [
    ("unsolved", "auto", 10, "no plan within its 5 s time limit"),
    ("infeasible", "auto", 2 * 2**30, "no plan fits 1 GiB per device; the fully-sharded minimum is 2 GiB"),
    ("infeasible", "ddp", 2 * 2**30, "the ddp plan needs at least 2 GiB"),
    ("infeasible", "auto", 2**29, "tied to one another"),  # the floor fits: the ties do not
])
def test_why_there_is_no_plan(status, name, floor, needle):
    plan = Plan(name=name, model="m", mesh_shape=(2,), mesh_names=("dp",), hardware="h100", train=True,
                fingerprint="", nodes={}, status=status)
    plan.info = {"memory_budget_bytes": 2**30, "min_memory_bytes": floor, "time_limit_s": 5.0}
    assert needle in no_plan_reason(plan)


def test_the_planner_reports_its_phases(tiny2):
    phases = []
    make_plan(tiny2, MESH, on_phase=phases.append)
    assert [p.split()[0] for p in phases] == ["enumerating", "building", "solving"]


def test_constraints(tiny2):
    want = (Shard(0),)
    plan = make_plan(tiny2, MESH, constraints=Constraints({"output.weight": want}, {}))
    assert plan.params["output.weight"] == want
    with pytest.raises(UserError, match="nope"):
        make_plan(tiny2, MESH, constraints=Constraints({"nope": want}, {}))


def test_plan_file_round_trip(tiny2, tmp_path):
    plan = make_plan(tiny2, MESH, baseline="fsdp")
    path = tmp_path / "plan.json"
    plan.save(path)
    back = Plan.load(path)
    assert back.nodes == plan.nodes and back.params == plan.params and back.outputs == plan.outputs
    assert back.collectives == plan.collectives
    back.check_matches(plan.model, plan.mesh_shape, plan.train, plan.fingerprint)
    with pytest.raises(UserError, match="mesh 2, not 4"):
        back.check_matches(plan.model, (4,), plan.train, plan.fingerprint)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(UserError, match="cannot be read"):
        Plan.load(tmp_path / "bad.json")


def test_inference_outputs_are_not_partial():
    tr = trace_model("llama-tiny", train=False, layers=1, batch=8, seq=64)
    canonicalize(tr)
    plan = make_plan(tr, Mesh((2, 2)))
    assert plan.status == "optimal"
    for ps in plan.outputs:
        assert all(isinstance(p, (Shard, Replicate)) for p in ps)


def test_hf_llama_plans_without_fallbacks(hf_tiny_config):
    """HF graphs hold captured constants (rotary tables), masked attention and nll_loss: all
    have rules, so nothing falls back to replication."""
    tr = trace_model(f"hf:{hf_tiny_config}", layers=1, batch=4, seq=16)
    canonicalize(tr)
    plan = make_plan(tr, Mesh((2, 2)), baseline="fsdp_tp")
    assert plan is not None and plan.status == "optimal"
    assert plan.fallback_ops == []


# Cohere: a LayerNorm written out, (x - mean) * rsqrt(var + eps), its weight upcast before the
# multiply; attention and MLP read one norm's output.
COHERE_TINY = {"model_type": "cohere", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
               "num_key_value_heads": 2, "num_hidden_layers": 1, "vocab_size": 256}


@pytest.mark.parametrize("model, projections", [("llama-tiny", 5), ("hf", 5), ("bloom", 2), ("cohere", 5)])
def test_sequence_parallel_baseline_gathers_right_before_each_column_projection(model, projections,
                                                                                 hf_tiny_config, tmp_path):
    """fsdp_tp_sp: the value a column-parallel projection reads (the norm's output scaled by its
    weight, bf16 HF norms casting in between; a LayerNorm's output, Bloom's inside
    native_layer_norm, Cohere's written out) is sequence-sharded on tp and gathered by the
    projection itself, so the all_gather and the matmul are adjacent (what collective-matmul
    fusion needs), in the training graph too."""
    from shardwise.ir.flops import is_view
    from shardwise.plan.baselines import COLUMN

    config = tmp_path / "config.json"
    config.write_text(json.dumps({"bloom": BLOOM_TINY, "cohere": COHERE_TINY}.get(model, {})))
    name = {"llama-tiny": model, "hf": f"hf:{hf_tiny_config}"}.get(model, f"hf:{config}")
    tr = trace_model(name, layers=1, batch=4, seq=16, dtype="bf16")
    canonicalize(tr)
    mesh = Mesh((2, 2), ("dp", "tp"))
    plan = make_plan(tr, mesh, baseline="fsdp_tp_sp")
    by_ph = {ph: p for p, ph in tr.params.items()}
    checked = 0
    for n in tr.gm.graph.nodes:
        if "einsum" not in str(n.target) or tr.phase(n).name != "FORWARD":
            continue
        act, w = n.args[1]
        while w.op != "placeholder" and w.all_input_nodes:
            w = w.all_input_nodes[0]
        if not COLUMN.search(by_ph.get(w.name, "")) or "embed" in by_ph[w.name]:
            continue
        src = act
        while is_view(src):
            src = src.all_input_nodes[0]
        assert plan.nodes[n.name].inputs[0][1] == Replicate(), n.name
        assert plan.nodes[src.name].output[0][1] == Shard(1), (n.name, src.name)
        checked += 1
    assert checked >= projections  # q, k, v, gate, up (and the head); Bloom's query_key_value, h_to_4h


def test_fsdp_keeps_the_logits_and_the_loss_batch_split():
    """torchtitan's data parallelism: each rank computes the loss of its own tokens (a pending
    average), so no rank gathers the [tokens, vocab] logits."""
    from torch.distributed.tensor import Partial

    from shardwise.ir.flops import is_view
    from shardwise.plan.ilp import GRAD_SINK
    from shardwise.plan.planner import destination, edges

    traced = trace_model("llama-tiny", batch=8, seq=32)
    canonicalize(traced)
    plan = make_plan(traced, Mesh((4,), ("dp",)), baseline="fsdp")
    vocab = 256
    for u, v, j in edges(traced):
        val = u.meta["val"]
        base = u
        while is_view(base):
            base = base.all_input_nodes[0]
        weight = base.op == "placeholder"
        # FSDP gathers weights and reduce-scatters their gradients, never values
        if val.dim() >= 2 and vocab in val.shape and not weight and j != GRAD_SINK:
            assert plan.nodes[u.name].output[0] == destination(plan, v, j), f"{u.name} moves"
    loss = next(n for n in traced.gm.graph.nodes if "nll_loss_forward" in str(n.target))
    assert plan.nodes[loss.name].output[0] == (Partial("avg"),)
    logits = next(n for n in traced.gm.graph.nodes if "_log_softmax" == n.name)
    assert plan.nodes[logits.name].output[0] == (Shard(0),)


def test_fsdp_over_a_tensor_parallel_weight_gathers_only_its_tp_shard():
    """FSDP2 splits a column-parallel weight's tp shard again over dp (a strided shard), so its
    gather over dp moves that shard, 1/tp of the weight. The fsdp_tp baselines store such a
    weight Shard(1) over dp (the same bytes): DTensor's nested (Shard(0), Shard(0)) undoes the tp
    split to gather over dp (through hops, ``cost/reshard.hop_tree``: an eighth over tp, then
    over dp, then an all_to_all over tp). Row-parallel weights keep Shard(0) over dp."""
    from shardwise.cost.hardware import get_hardware
    from shardwise.plan.baselines import baseline_spec
    from shardwise.plan.costs import PlannerCosts

    tr = trace_model("llama3-8b", layers=1, batch=8, seq=128)
    mesh = Mesh((8, 8), ("dp", "tp"), "h100")
    by_name = {p: tr.node(ph) for p, ph in tr.params.items()}
    wq = next(n for p, n in by_name.items() if p.endswith("wq.weight"))
    wo = next(n for p, n in by_name.items() if p.endswith("wo.weight"))
    costs = PlannerCosts(mesh.shape, get_hardware("h100"))
    gathered, nested = (Replicate(), Shard(0)), (Shard(0), Shard(0))
    for name in ("fsdp_tp", "fsdp_tp_sp"):
        fixed = baseline_spec(name, tr, mesh).fixed
        assert fixed[wq.name] == (Shard(1), Shard(0)) and fixed[wo.name] == (Shard(0), Shard(1))
        times = costs.move_times([fixed[wq.name], nested], [gathered], wq.meta["val"])
        assert times[0, 0] < times[1, 0] / 1.5  # one tp shard's gather, against three collectives
