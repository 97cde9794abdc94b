"""Planner -> lowering -> passes -> runtime, on real gloo ranks: the optimisation passes applied
to programs the planner made (issues 6 and 7 end to end)."""

from __future__ import annotations

import pytest
import torch

from shardwise.ir.match import CollectiveKind, all_collectives, arg_node, is_op
from shardwise.ir.trace import trace_model
from shardwise.lower import lower
from shardwise.mesh import Mesh
from shardwise.models import get_model
from shardwise.passes import get_pass
from shardwise.passes.pipeline import canonicalize
from shardwise.plan import make_plan
from shardwise.runtime import run_many
from tests.helpers import SLOW_MACHINE_TIMEOUT_S, hf_model_name

SHAPE = {"layers": 2, "batch": 2, "seq": 8}
MAX_REL_ERR = 1e-5


def _programs(model: str, tp: int, baseline: str, passes: list[str], *, dp: int = 1, train: bool = False,
              shape: dict | None = None):
    shape = shape or SHAPE
    traced = trace_model(model, train=train, **shape)
    canonicalize(traced)
    plan = make_plan(traced, Mesh((dp, tp), ("dp", "tp")), baseline=baseline)
    plain, rewritten = lower(traced, plan), lower(traced, plan)
    for prog in (plain, rewritten):  # real values for the constants an hf: trace captures
        prog.model = get_model(model, **shape)
    counts = {p: get_pass(p)(rewritten.gm) for p in passes}
    return plain, rewritten, counts


def _norm_fed_all_reduces(gm) -> int:
    """all_reduces whose value reaches a shardwise norm through views."""
    n = 0
    for c in all_collectives(gm.graph):
        if c.kind is not CollectiveKind.ALL_REDUCE:
            continue
        frontier, feeds = [c.value], False
        while frontier and not feeds:
            x = frontier.pop()
            for u in x.users:
                feeds |= str(u.target).startswith("shardwise.") and "norm" in str(u.target)
                if is_op(u, torch.ops.aten.view, torch.ops.aten._unsafe_view) and arg_node(u) is x:
                    frontier.append(u)
        n += feeds
    return n


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


@pytest.mark.slow
@pytest.mark.parametrize("model", ["llama-tiny", "hf"])
def test_sequence_parallel_on_lowered_tensor_parallel_plans(model):
    model = hf_model_name("llama") if model == "hf" else model
    pairs = [_programs(model, tp, "fsdp_tp", ["sequence_parallel"]) for tp in (2,)]
    pairs += [_programs(model, 4, "fsdp_tp", ["sequence_parallel"])] if model == "llama-tiny" else []
    for plain, rewritten, counts in pairs:
        before = _norm_fed_all_reduces(plain.gm)
        # Pre-norm decoder: 2 per layer, plus the vocab-parallel embedding's all_reduce.
        assert before == 2 * SHAPE["layers"] + 1
        assert counts["sequence_parallel"] == before
        assert _norm_fed_all_reduces(rewritten.gm) == 0
    for plain, rewritten, _ in pairs:  # one launch per world size, both programs in it
        results = run_many([plain, rewritten], check=True, timeout_s=SLOW_MACHINE_TIMEOUT_S)
        assert _max_rel(results[1].outputs[0], results[0].outputs[0]) <= MAX_REL_ERR
        assert results[0].max_rel_err <= 1e-4


@pytest.mark.slow
def test_collective_matmul_on_a_lowered_sequence_parallel_plan():
    plain, rewritten, counts = _programs("llama-tiny", 2, "fsdp_tp_sp",
                                         ["sequence_parallel", "collective_matmul"])
    targets = [str(n.target) for n in rewritten.gm.graph.nodes]
    gathers = sum(t.startswith("shardwise.all_gather_matmul") for t in targets)
    scatters = sum(t.startswith("shardwise.matmul_reduce_scatter") for t in targets)
    # Every projection is fused: per layer q/k/v share one gathered input, w1/w3 another, and
    # wo and w2 reduce-scatter their outputs; plus the output head.
    layers = SHAPE["layers"]
    assert (gathers, scatters) == (2 * layers + 1, 2 * layers)
    assert counts["collective_matmul"] == gathers + scatters
    results = run_many([plain, rewritten], check=True, timeout_s=SLOW_MACHINE_TIMEOUT_S)
    assert _max_rel(results[1].outputs[0], results[0].outputs[0]) <= MAX_REL_ERR


@pytest.mark.slow
def test_collective_matmul_on_a_training_step_over_fsdp_and_tensor_parallel():
    """The joint graph on a 2x2 (dp, tp) mesh: every forward projection fused (the backward's
    matmuls fuse too where their collectives allow), and every gradient unchanged. Two sequences
    per dp rank: with one, the planner finds gathering the batch cheaper than keeping it split."""
    passes = ["sequence_parallel", "collective_matmul"]
    plain, rewritten, counts = _programs("llama-tiny", 2, "fsdp_tp_sp", passes, dp=2, train=True,
                                         shape={**SHAPE, "batch": 4})
    fused = [n for n in rewritten.gm.graph.nodes if str(n.target).startswith("shardwise.")]
    gathered = sum(len(n.args[1]) for n in fused if "all_gather_matmul" in str(n.target))
    scattered = sum("matmul_reduce_scatter" in str(n.target) for n in fused)
    layers = SHAPE["layers"]
    # Forward alone: q/k/v/w1/w3 and the head read gathered inputs, wo and w2 scatter outputs.
    assert gathered >= 5 * layers + 1 and scattered >= 2 * layers
    assert counts["collective_matmul"] == len(fused)
    results = run_many([plain, rewritten], check=True, timeout_s=SLOW_MACHINE_TIMEOUT_S)
    assert results[1].max_rel_err <= 1e-4
    for got, want in zip(results[1].outputs, results[0].outputs, strict=True):
        assert _max_rel(got, want) <= MAX_REL_ERR
