"""Activation checkpointing per decoder layer: recorded in the plan, priced by the step schedule."""

from __future__ import annotations

import json

import pytest

from shardwise.cost.hardware import get_hardware
from shardwise.cost.step import estimate_prepared, plan_for, regions_layers, tokens_per_step
from shardwise.ir.trace import trace_model
from shardwise.mesh import parse_mesh
from shardwise.passes.pipeline import canonicalize
from shardwise.passes.remat import ACPolicy, LayerPolicies
from shardwise.plan.plan import ACChoice, ACGroup, Plan
from tests.helpers import cli, json_object

LAYERS = 4
MODEL_ARGS = ("--model", "llama-tiny", "--layers", str(LAYERS), "--batch", "8", "--seq", "256")
MIXED = ACChoice((ACGroup((0, 1, 2, 3), none=2, selective=1, full=1),))


@pytest.fixture(scope="module")
def setup():
    traced = trace_model("llama-tiny", layers=LAYERS, batch=8, seq=256)
    canonicalize(traced)
    mesh = parse_mesh("2", None, "h100")
    plan = plan_for(traced, mesh, "fsdp")
    return traced, mesh, plan


def _estimate(setup, ac):
    traced, mesh, plan = setup
    return estimate_prepared([(traced, plan)], LAYERS, tokens_per_step(traced), mesh, get_hardware("h100"),
                             {"ac": ac})


def test_a_group_assigns_full_then_selective_then_none():
    assert MIXED.layer_policies() == LayerPolicies((ACPolicy.FULL, ACPolicy.SELECTIVE, ACPolicy.NONE,
                                                    ACPolicy.NONE))
    assert MIXED.describe() == "none x 2, selective x 1, full x 1"
    assert ACChoice.uniform([0, 1], ACPolicy.FULL).layer_policies() == LayerPolicies((ACPolicy.FULL,) * 2)
    with pytest.raises(ValueError):
        ACGroup((0, 1), none=1, selective=1, full=1)


def test_mixed_layers_price_between_none_and_full(setup):
    none, full = _estimate(setup, ACPolicy.NONE), _estimate(setup, ACPolicy.FULL)
    mixed = _estimate(setup, MIXED.layer_policies())
    assert none.step_s < mixed.step_s < full.step_s
    assert 0.0 == none.recompute_s < mixed.recompute_s < full.recompute_s
    peak = [e.memory_allocated_peak_bytes for e in (full, mixed, none)]
    assert peak == sorted(set(peak))
    # Every layer one policy: exactly that policy.
    every = ACChoice.uniform(sorted(regions_layers(setup[0])), ACPolicy.FULL)
    same = _estimate(setup, every.layer_policies())
    assert same.step_s == full.step_s and same.memory_per_device_bytes == full.memory_per_device_bytes


def test_plan_file_keeps_its_ac_and_old_files_load(setup, tmp_path):
    _, _, plan = setup
    plan.ac = MIXED
    path = tmp_path / "p.json"
    plan.save(path)
    assert Plan.load(path).ac == MIXED
    doc = json.loads(path.read_text())
    del doc["ac"]  # a plan file written before per-layer AC
    path.write_text(json.dumps(doc))
    assert Plan.load(path).ac is None
    plan.ac = None


def _cli(*args: str) -> dict:
    return json_object(cli(*args, "--json"))


def test_estimate_of_a_saved_plan_runs_its_ac_and_ac_overrides(setup, tmp_path):
    traced, mesh, plan = setup
    plan.ac = MIXED
    path = tmp_path / "mixed.json"
    plan.save(path)
    plan.ac = None
    common = ("estimate", *MODEL_ARGS, "--mesh", "2", "--hardware", "h100", "--plan", str(path))
    got = _cli(*common)
    want = _estimate(setup, MIXED.layer_policies())
    assert got["ac"] == MIXED.describe()
    assert got["step_s"] == pytest.approx(want.step_s, rel=1e-9)
    assert got["memory_per_device_bytes"] == want.memory_per_device_bytes
    over = _cli(*common, "--ac", "full")
    assert over["ac"] == "full"
    assert over["step_s"] == pytest.approx(_estimate(setup, ACPolicy.FULL).step_s, rel=1e-9)
