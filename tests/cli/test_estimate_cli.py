"""``shardwise estimate`` as a user runs it: a subprocess, stdout parsed with json.loads."""

from __future__ import annotations

import json
import subprocess

import pytest

from shardwise.cost.schedule import exposed_time
from shardwise.ir.trace import trace_model
from shardwise.mesh import parse_mesh
from shardwise.passes.pipeline import canonicalize
from shardwise.plan import make_plan
from tests.helpers import cli, cli_all

TINY = ["--model", "llama-tiny", "--batch", "8", "--seq", "64"]
BREAKDOWN = {"compute_s", "recompute_s", "comm_s", "exposed_comm_s", "hidden_comm_s", "optimizer_s"}


def _cli(*args: str) -> subprocess.CompletedProcess:
    return cli("estimate", *args)


def test_json_report_and_timelines(tmp_path):
    trace, png = tmp_path / "step.json", tmp_path / "step.png"
    r = _cli(*TINY, "--mesh", "2x2", "--mesh-names", "dp,tp", "--plan", "fsdp_tp_sp", "--ac", "full",
             "--async-tp", "--timeline", str(trace), "--timeline-png", str(png), "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out["breakdown"]) == BREAKDOWN
    assert out["step_s"] > 0 and 0 < out["mfu"] < 1 and out["fits"] is True
    assert out["tokens_per_s_per_device"] == pytest.approx(8 * 64 / 4 / out["step_s"])
    assert out["breakdown"]["recompute_s"] > 0 and out["recomputed_nodes"] > 0
    assert 0 <= out["breakdown"]["exposed_comm_s"] <= out["breakdown"]["comm_s"]
    assert png.stat().st_size > 0 and png.read_bytes()[:4] == b"\x89PNG"
    events = json.loads(trace.read_text())["traceEvents"]
    tracks = {e["args"]["name"]: e["tid"] for e in events if e.get("name") == "thread_name"}
    assert set(tracks) == {"compute", "comm:dp", "comm:tp"}
    compute = sorted((e for e in events if e["ph"] == "X" and e["tid"] == tracks["compute"]),
                     key=lambda e: e["ts"])
    for a, b in zip(compute, compute[1:], strict=False):
        assert b["ts"] >= a["ts"] + a["dur"] - 1e-6, f"{a['name']} overlaps {b['name']}"
    span_s = (compute[-1]["ts"] + compute[-1]["dur"]) / 1e6
    assert span_s == pytest.approx(out["step_s"], rel=0.01)
    comm = [(e["ts"], e["ts"] + e["dur"]) for e in events if e["ph"] == "X" and e["tid"] != tracks["compute"]]
    busy = [(e["ts"], e["ts"] + e["dur"]) for e in compute]
    exposed_s = exposed_time(comm, busy) / 1e6
    assert exposed_s == pytest.approx(out["breakdown"]["exposed_comm_s"], rel=1e-6, abs=1e-12)


def _refused(r: subprocess.CompletedProcess, *words: str) -> None:
    assert r.returncode == 2, r.stderr
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    for w in words:
        assert w in lines[0]


def test_bad_input_is_one_sentence(tmp_path, hf_tiny_config):
    # a plan file made for another model
    traced = trace_model("llama-tiny", batch=8, seq=64)
    canonicalize(traced)
    path = tmp_path / "tiny.json"
    make_plan(traced, parse_mesh("2"), baseline="fsdp").save(path)
    cases = [
        ([*TINY, "--mesh", "2", "--plan", "fsdp", "--ac", "sometimes"], ("--ac", "selective")),
        # async TP on a mesh without a tp dim, and on a plan that shards nothing over tp
        ([*TINY, "--mesh", "2", "--plan", "fsdp", "--async-tp"], ("tp",)),
        ([*TINY, "--mesh", "2x2", "--mesh-names", "dp,tp", "--plan", "fsdp", "--async-tp"], ("fsdp", "tp")),
        (["--model", f"hf:{hf_tiny_config}", "--batch", "8", "--seq", "64", "--mesh", "2",
          "--plan", str(path)], ("llama-tiny",)),
        # refused even where the model is too shallow to extrapolate
        ([*TINY, "--mesh", "2", "--plan", "fsdp", "--extrapolate-from", "0"], ("at least 1 layer",)),
        ([*TINY, "--mesh", "2", "--plan", "fsdp", "--timeline", str(tmp_path / "no" / "t.json")],
         ("--timeline", "does not exist")),
    ]
    for (_, words), proc in zip(cases, cli_all([["estimate", *argv] for argv, _ in cases]), strict=True):
        _refused(proc, *words)


def test_memory_report():
    """Peak memory is the caching allocator's reserved peak; the allocated peak's breakdown adds
    up; a budget between the two says it does not fit (OOM happens against reserved)."""
    r = _cli(*TINY, "--mesh", "2", "--plan", "fsdp", "--ac", "selective", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    alloc, reserved = out["memory_allocated_peak_bytes"], out["memory_reserved_peak_bytes"]
    assert out["memory_per_device_bytes"] == reserved >= alloc > 0
    m = out["memory_breakdown"]
    parts = ("static_bytes", "grads_bytes", "gathered_params_bytes", "saved_activations_bytes",
             "transients_bytes")
    assert sum(m[k] for k in parts) == m["total_bytes"] == alloc
    assert m["phase"] in ("forward", "backward") and m["at"]
    assert all(e["bytes"] > 0 for e in m["largest"])
    between = str((alloc + reserved) // 2)
    r = _cli(*TINY, "--mesh", "2", "--plan", "fsdp", "--ac", "selective", "--memory", between,
             "--no-expandable-segments", "--json")
    assert r.returncode == 0, r.stderr
    tight = json.loads(r.stdout)
    assert tight["memory_allocated_peak_bytes"] == alloc  # the same tensors
    assert tight["fits"] is (tight["memory_reserved_peak_bytes"] <= int(between))
    assert out["fits"] is True
