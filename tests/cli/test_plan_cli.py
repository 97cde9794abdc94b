"""``shardwise plan``: the JSON report, saved plans, warnings for ops without a strategy, bad input."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate

import shardwise.ir.ops  # noqa: F401  (registers torch.ops.shardwise)
from shardwise.cli import main
from shardwise.ir.trace import trace
from shardwise.mesh import Mesh
from shardwise.plan import Plan, make_plan

JSON_KEYS = {"status", "objective_s", "mip_gap", "bound_s", "started_from", "timings", "ilp", "baselines",
             "params", "outputs", "memory_per_device_bytes", "collectives", "fallback_ops", "serial_estimate",
             "plans", "step_s", "chosen_from", "ac", "ac_policy", "ac_given"}
TINY = ["--model", "llama-tiny", "--layers", "1", "--batch", "8", "--seq", "32"]
# The gap the schedule objective's refinement may leave on a tiny model (plan/objective.py).
MIP_GAP_AFTER_REFINE = 0.01


def test_json_report_with_baselines_and_saved_plan(capsys, tmp_path):
    path = tmp_path / "plan.json"
    assert main(["plan", *TINY, "--mesh", "2", "--json", "--save", str(path)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == JSON_KEYS
    assert out["status"] in ("optimal", "feasible")  # the schedule objective's bound: plan/objective.py
    assert out["bound_s"] <= out["objective_s"] and out["mip_gap"] <= MIP_GAP_AFTER_REFINE
    assert set(out["timings"]) == {"trace_s", "strategies_s", "ilp_build_s", "solve_s", "total_s"}
    assert set(out["ilp"]) == {"variables", "constraints", "clusters"} and out["ilp"]["variables"] > 0
    assert set(out["baselines"]) == {"ddp", "fsdp", "fsdp_tp", "fsdp_tp_sp"}
    assert out["baselines"]["fsdp_tp"] is None  # no tp dim on a 1-D mesh
    for name in ("ddp", "fsdp"):  # by the step schedule, the measure printed
        assert out["step_s"] <= out["baselines"][name] * (1 + 1e-9)
        assert out["plans"][name]["step_s"] == out["baselines"][name]
    assert out["params"]["output.weight"] in (["R"], ["S(0)"], ["S(1)"])
    # The top level speaks of the chosen plan by the schedule, the measure of every row.
    auto = out["plans"]["auto"]
    assert out["step_s"] == auto["step_s"]
    assert out["memory_per_device_bytes"] == auto["memory_per_device_bytes"]
    assert out["serial_estimate"]["total_s"] > 0
    plan = Plan.load(path)
    assert {k: [str(p) for p in v] for k, v in out["params"].items()}.keys() == plan.params.keys()


def test_a_gap_lets_the_solver_stop_within_it(capsys, monkeypatch):
    import shardwise.plan.objective as objective

    gaps = []
    solve = objective.solve_by_lp_bound

    def spy(m, unit, time_limit_s, start, rel_gap, ahead=None):
        gaps.append(rel_gap)
        return solve(m, unit, time_limit_s, start, rel_gap, ahead)

    monkeypatch.setattr(objective, "solve_by_lp_bound", spy)
    assert main(["plan", *TINY, "--mesh", "2", "--json", "--no-baselines", "--gap", "0.2"]) == 0
    assert gaps and set(gaps) == {0.2}  # the gap reaches every solve
    out = json.loads(capsys.readouterr().out)
    assert out["status"] in ("optimal", "feasible")
    assert out["bound_s"] <= out["objective_s"] and out["mip_gap"] <= 0.2


@pytest.mark.parametrize("as_json", [False, True])
def test_progress_on_a_terminal_but_never_with_json(capsys, monkeypatch, as_json):
    monkeypatch.setattr("sys.stderr.isatty", lambda: True)
    assert main(["plan", *TINY, "--mesh", "2", *(["--json"] if as_json else [])]) == 0
    cap = capsys.readouterr()
    steps = ("tracing llama-tiny", "enumerating strategies", "solving the placement ILP",
             "pricing the fsdp baseline")
    if as_json:
        assert cap.err == "" and json.loads(cap.out)["status"] in ("optimal", "feasible")
    else:
        assert all(step in cap.err for step in steps) and "ILP:" in cap.out


def test_constraint_is_honoured(capsys):
    assert main(["plan", *TINY, "--mesh", "2", "--json", "--no-baselines",
                 "--constrain", "output.weight=S(1)"]) == 0
    assert json.loads(capsys.readouterr().out)["params"]["output.weight"] == ["S(1)"]


def test_an_inference_output_constraint_is_honoured(capsys):
    base = ["plan", *TINY, "--inference", "--mesh", "2x2", "--json", "--no-baselines"]
    assert main(base) == 0
    free = json.loads(capsys.readouterr().out)
    want = ["R", "S(2)"]
    assert free["outputs"] != [want]
    assert main([*base, "--constrain", f"output={','.join(want)}"]) == 0
    held = json.loads(capsys.readouterr().out)
    assert held["outputs"] == [want]
    assert held["objective_s"] >= free["objective_s"] * (1 - 1e-9)


def test_the_optimizer_state_counts_in_memory(capsys, tmp_path):
    # llama-small's Adam state (two fp32 moments, ~15 MB a rank) is more than the allocator's
    # rounding of the schedule's peak; tiny's is not.
    model = ["--model", "llama-small", "--layers", "1", "--batch", "2", "--seq", "32", "--mesh", "2"]
    out = {}
    for opt in ("adam", "sgd"):
        path = tmp_path / f"{opt}.json"
        argv = ["plan", *model, "--json", "--no-baselines", "--optimizer", opt, "--save", str(path)]
        assert main(argv) == 0
        out[opt] = json.loads(capsys.readouterr().out)
        # estimate of the saved plan holds the state it was planned with.
        assert main(["estimate", *model, "--plan", str(path), "--json"]) == 0
        estimated = json.loads(capsys.readouterr().out)
        assert estimated["memory_per_device_bytes"] == out[opt]["memory_per_device_bytes"]
    assert out["sgd"]["memory_per_device_bytes"] < out["adam"]["memory_per_device_bytes"]
    assert out["sgd"]["objective_s"] <= out["adam"]["objective_s"] * (1 + 1e-9)  # less to fit, never dearer


@pytest.mark.parametrize("argv, needle", [
    (["--mesh", "2", "--optimizer", "lion"], "unknown optimizer 'lion'"),
    (["--mesh", "2", "--time-limit", "-1"], "--time-limit must be a positive number of seconds, got -1"),
    (["--mesh", "2", "--gap", "1.5"], "--gap is a relative gap in [0, 1)"),
    (["--mesh", "2", "--gap", "-0.1"], "--gap is a relative gap in [0, 1)"),
    (["--mesh", "2", "--time-limit", "1e-9", "--no-baselines"], "no plan within its 1e-09 s time limit"),
    (["--mesh", "2", "--inference", "--constrain", "output:3=R"], "1 output(s)"),
    (["--mesh", "2", "--inference", "--constrain", "output:x=R"], "names no output"),
    (["--mesh", "2", "--inference", "--constrain", "output=P"], "no plan delivers output 0"),
    (["--mesh", "2", "--constrain", "output=R"], "constrain the parameters instead"),
    (["--mesh", "8x"], "malformed"),
    (["--mesh", "0x8"], "size 0"),
    (["--mesh", "2x2", "--mesh-names", "dp"], "do not match"),
    (["--mesh", "2", "--constrain", "nope.weight=R"], "nope.weight"),
    (["--mesh", "2", "--constrain", "output.weight=R,R"], "2 placements for a 1-dim mesh"),
    (["--mesh", "2", "--memory", "1KiB", "--no-baselines"], "fully-sharded minimum"),
    (["--mesh", "2", "--hardware", "tpu9"], "tpu9"),
    (["--mesh", "2", "--constrain", "layers.*.attn.wq.weight=R"], "matches no parameter, input or output"),
    (["--mesh", "2", "--constrain", "output:*=R"], "matches no parameter"),  # training: no outputs
    (["--mesh", "2", "--constrain", "tok_embeddings.weight=S(5)"],
     "shards parameter 'tok_embeddings.weight' on dim 5, but its shape [256, 64] has dims 0 to 1"),
    (["--mesh", "2", "--save", "/no/such/dir/plan.json"], "directory '/no/such/dir' does not exist"),
    (["--mesh", "2", "--save", "/"], "is a directory"),
    (["--mesh", "3", "--constrain", "norm.weight=S(0)"],
     "parameter 'norm.weight' (shape [64]) fits the constraints on mesh 3 (dp): its dim 0 of size 64 "
     "does not split evenly over 3 devices"),
])
def test_bad_input_is_one_sentence_and_exit_2(capsys, argv, needle):
    assert main(["plan", *TINY, *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_save_all_path_that_is_a_file_is_refused_before_planning(capsys, tmp_path, monkeypatch):
    import shardwise.plan.planner as planner

    monkeypatch.setattr(planner, "plan_with_baselines", None)  # planning would fail loudly
    path = tmp_path / "plans"
    path.write_text("")
    assert main(["plan", *TINY, "--mesh", "2", "--save-all", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"--save-all {str(path)!r} is a file; give a directory." in err
    assert len(err.strip().splitlines()) == 1


class _Hinted(nn.Module):
    """A model with an op the planner has no rule for (shardwise::segment_set)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.shardwise.segment_set(self.lin(x)).sum()


def test_op_without_strategy_is_named_and_planned_replicated(caplog):
    traced = trace(_Hinted(), torch.randn(4, 8), train=False)
    with caplog.at_level(logging.WARNING):
        plan = make_plan(traced, Mesh((2,)))
    assert plan.status == "optimal"
    assert plan.fallback_ops == ["shardwise.segment_set.default"]
    assert "shardwise.segment_set.default" in caplog.text
    seg = next(n for n in traced.gm.graph.nodes if "segment_set" in str(n.target))
    assert all(isinstance(p, Replicate) for p in plan.nodes[seg.name].output[0])


WQ = "layers.{}.attention.wq.weight"
# Plans within this relative difference cost the same (solver.MIP_REL_GAP's comment: plans are
# compared to 1e-6; the LP-bound solve stops within its tolerances).
PLAN_TIE = 1e-6
TWO_LAYERS = ["plan", *TINY, "--layers", "2", "--mesh", "2", "--json", "--no-baselines"]


def _params(capsys, *constraints: str) -> dict[str, list[str]]:
    argv = [*TWO_LAYERS, *(x for c in constraints for x in ("--constrain", c))]
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)["params"]


def test_a_glob_constrains_every_parameter_it_matches(capsys):
    free = _params(capsys)
    # a placement the free plan gives neither wq nor wk, so the constraint changes something
    pin = next(p for p in ("S(1)", "S(0)", "R")
               if all(free[f"layers.0.attention.{w}.weight"] != [p] for w in ("wq", "wk")))
    glob = f"layers.*.attention.w[qk].weight={pin}"
    held, cost = _auto_objective(capsys, glob)
    for layer in (0, 1):
        for w in ("wq", "wk"):
            assert held[f"layers.{layer}.attention.{w}.weight"] == [pin]
    # wv is left to the solver: it reads the activation wq and wk read, so its best placement
    # may change with theirs; pinning it to its unconstrained choice costs at least as much.
    # It is pinned in every layer: pinning one layer's only would split the identical layers'
    # cluster, and two layers planned apart may beat the glob's plan by a hair (1e-5 relative).
    wv = "layers.0.attention.wv.weight"
    _, cost_wv = _auto_objective(capsys, glob, f"layers.*.attention.wv.weight={','.join(free[wv])}")
    assert cost <= cost_wv * (1 + PLAN_TIE)


def test_a_later_constraint_overrides_an_earlier_glob(capsys):
    held = _params(capsys, "layers.*.attention.wq.weight=S(1)", f"{WQ.format(0)}=S(0)")
    assert held[WQ.format(0)] == ["S(0)"] and held[WQ.format(1)] == ["S(1)"]


def _auto_objective(capsys, *constraints: str) -> tuple[dict[str, list[str]], float]:
    argv = [*TWO_LAYERS, *(x for c in constraints for x in ("--constrain", c))]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    return out["params"], out["plans"]["auto"]["objective_s"]


def test_a_constraint_on_one_clustered_layer_holds_for_that_layer_only(capsys):
    """Layer 1 is a copy of layer 0 in the clustering: pinning only its weight must split it off
    rather than be overridden by layer 0's choice (or impose itself on layer 0: layer 0 may
    still take its free choice at no cost; the schedule objective has ties, so it need not)."""
    free = _params(capsys)
    # A placement layer 0 does not take by itself (its free choice is one of the tied optima).
    pin = "S(0)" if free[WQ.format(0)] == ["S(1)"] else "S(1)"
    held, cost = _auto_objective(capsys, f"{WQ.format(1)}={pin}")
    assert held[WQ.format(1)] == [pin]
    both, cost_both = _auto_objective(capsys, f"{WQ.format(1)}={pin}",
                                      f"{WQ.format(0)}={','.join(free[WQ.format(0)])}")
    assert both[WQ.format(0)] == free[WQ.format(0)] and both[WQ.format(1)] == [pin]
    assert cost_both == pytest.approx(cost, rel=1e-9)


def test_a_glob_over_inputs_and_outputs(capsys):
    base = ["plan", *TINY, "--inference", "--mesh", "2", "--json", "--no-baselines"]
    assert main([*base, "--constrain", "output:?=R", "--constrain", "tok*=S(0)"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["outputs"] == [["R"]]
