"""Every verb's ``--json`` stdout is exactly one JSON object, run as a real subprocess (so what
native libraries print on descriptor 1, such as the HiGHS banner, would be caught), and bad input
is one sentence on stderr with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

TINY = ["--model", "llama-tiny", "--layers", "1", "--batch", "4", "--seq", "8"]
# Seconds a tiny command may take on a loaded 2-core machine before the test gives up.
SUBPROCESS_TIMEOUT_S = 300


def shardwise(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardwise", *argv], capture_output=True, text=True,
                          timeout=SUBPROCESS_TIMEOUT_S, check=False)


def one_json_object(proc: subprocess.CompletedProcess) -> dict:
    """The whole of stdout parsed as JSON: it must be one object and nothing else."""
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert isinstance(out, dict)
    return out


def test_plan_json_is_one_object_without_the_solver_banner():
    proc = shardwise("plan", *TINY, "--mesh", "2x2", "--mesh-names", "dp,tp", "--json")
    out = one_json_object(proc)
    # (feasible: the schedule objective's relaxed bound may not prove the optimum, plan/objective.py)
    assert out["status"] in ("optimal", "feasible") and "ddp" in out["baselines"]
    assert "HiGHS" not in proc.stdout


def test_plan_human_report_has_no_solver_banner():
    proc = shardwise("plan", *TINY, "--mesh", "2", "--no-baselines")
    assert proc.returncode == 0, proc.stderr
    assert "HiGHS" not in proc.stdout and "ILP:" in proc.stdout


def test_trace_json_is_one_object():
    out = one_json_object(shardwise("trace", *TINY, "--json"))
    assert out["model"] == "llama-tiny" and out["nodes"] > 0


@pytest.mark.parametrize("argv", [
    ["--collective", "all_reduce", "--bytes", "1GiB", "--ranks", "8"],
    ["--matmul", "1024x1024x1024", "--dtype", "bf16"],
])
def test_cost_json_is_one_object(argv):
    out = one_json_object(shardwise("cost", *argv, "--hardware", "h100", "--json"))
    assert out


def test_segment_json_is_one_object():
    out = one_json_object(shardwise("segment", *TINY, "--json"))
    assert out["segments"]


@pytest.mark.slow
def test_run_json_is_one_object():
    out = one_json_object(shardwise("run", *TINY, "--mesh", "2", "--plan", "ddp", "--check", "--json",
                                    "--timeout", "240"))
    assert out["world_size"] == 2 and out["max_rel_err"] <= 1e-4


@pytest.mark.parametrize("argv", [
    ["plan", "--model", "no-such-model", "--json"],
    ["plan", *TINY, "--mesh", "2", "--json", "--constrain", "nothing.matches.*=R"],
    ["cost", "--collective", "all_reduce", "--bytes", "lots", "--ranks", "8", "--json"],
])
def test_bad_input_is_one_sentence_on_stderr_and_nothing_on_stdout(argv):
    proc = shardwise(*argv)
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "error:" in lines[0] and "Traceback" not in proc.stderr
