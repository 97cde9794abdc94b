"""Hugging Face families written by hand from their published hyper-parameters (tests/data):
Phi-3 (fused qkv and gate_up), Qwen2-7B (biased q/k/v), Gemma-2B (head_dim 256, one KV head,
tied embeddings, GeLU-tanh), Gemma-2-2B (soft-capped attention scores and logits, which SDPA
cannot take: transformers' eager attention; sliding-window and full layers alternating; four
norms a layer) and GPT-2 (Conv1D weights, biased LayerNorm, learned positions, tied head).
Reduced to a few layers: each plans with no fallback op and no dearer than the best hand plan
that applies. (Full-size timings: benchmarks/hf_families.py.)"""

from __future__ import annotations

import pytest
from torch.distributed.tensor import Replicate, Shard

from shardwise.ir.trace import trace_model
from shardwise.mesh import Mesh
from shardwise.passes.pipeline import canonicalize
from shardwise.plan.baselines import _tp_role
from shardwise.plan.cluster import cluster
from shardwise.plan.planner import NO_PLAN, plan_with_baselines
from tests.helpers import DATA

FAMILIES = ("phi3.json", "qwen2_7b.json", "gemma_2b.json", "gemma2_2b.json", "gpt2.json")
MESH = Mesh((2, 2), ("dp", "tp"), "h100")
# Relative slack when comparing step times (sums rounded differently).
TIE = 1e-9
# The auto ILP of a 1-layer config here (~75k columns) is not solved within seconds, nor within
# a minute at these latency-bound sizes; what the test checks holds at any limit: the plan has
# no fallback op, and the solve starts from the best hand plan, which a short limit keeps.
# (benchmarks/hf_families.py solves the full-size configs to the optimum.)
TIME_LIMIT_S = 2.0


def _traced(config: str, layers: int):
    tr = trace_model(f"hf:{DATA / config}", layers=layers, batch=4, seq=64)
    canonicalize(tr)
    return tr


@pytest.mark.parametrize("config", FAMILIES)
def test_family_plans_without_fallback_and_beats_or_ties_every_hand_plan(config):
    auto, hand = plan_with_baselines(_traced(config, 1), MESH, time_limit_s=TIME_LIMIT_S)
    assert auto.status not in NO_PLAN
    assert auto.fallback_ops == []
    # by the step schedule, the measure the auto plan is chosen by and the report prints
    priced = [p.info["schedule"]["step_s"] for p in hand.values()
              if p is not None and p.status not in NO_PLAN]
    assert priced, "no hand plan applies"
    assert auto.info["schedule"]["step_s"] <= min(priced) * (1 + TIE)
    assert auto.info["objective"] == "schedule" and auto.info["objective_s"] >= auto.info["bound_s"]


def test_gpt2_layers_cluster_forward_and_backward_with_representatives_first():
    """GPT-2's backward regions interleave in graph order (its saved activations sit among the
    forward nodes); every layer past the first still shares variables, and each representative
    precedes the nodes it stands for (strategies are built in graph order)."""
    tr = _traced("gpt2.json", 4)
    clus = cluster(tr)
    assert len(clus.clusters) == 2  # forward and backward
    index = {n: i for i, n in enumerate(tr.gm.graph.nodes)}
    assert all(index[r] <= index[n] for n, r in clus.rep.items())


@pytest.mark.parametrize("name, ndim, role", [
    ("model.model.layers.0.self_attn.qkv_proj.weight", 2, Shard(0)),  # Phi-3: fused, column
    ("model.model.layers.0.mlp.gate_up_proj.weight", 2, Shard(0)),
    ("model.transformer.h.0.attn.c_attn.weight", 2, Shard(1)),  # GPT-2 Conv1D: [in, out]
    ("model.transformer.h.0.mlp.c_fc.weight", 2, Shard(1)),
    ("model.transformer.h.0.attn.c_proj.weight", 2, Shard(0)),
    ("model.transformer.h.0.attn.c_attn.bias", 1, Shard(0)),
    ("model.transformer.h.0.mlp.c_proj.bias", 1, Replicate()),
    ("model.transformer.wte.weight", 2, Shard(0)),
    ("model.transformer.wpe.weight", 2, Replicate()),
])
def test_megatron_roles_of_fused_and_conv1d_weights(name, ndim, role):
    assert _tp_role(name, ndim) == (role,)
