"""Every verb's ``--json`` stdout is exactly one JSON object, run as a real subprocess (so what
native libraries print on descriptor 1, such as the HiGHS banner, would be caught), and bad input
is one sentence on stderr with exit code 2."""

from __future__ import annotations

import pytest

from tests.helpers import cli, cli_all, json_object

TINY = ["--model", "llama-tiny", "--layers", "1", "--batch", "4", "--seq", "8"]
def test_plan_json_is_one_object_without_the_solver_banner():
    proc = cli("plan", *TINY, "--mesh", "2x2", "--mesh-names", "dp,tp", "--json")
    out = json_object(proc)
    # (feasible: the schedule objective's relaxed bound may not prove the optimum, plan/objective.py)
    assert out["status"] in ("optimal", "feasible") and "ddp" in out["baselines"]
    assert "HiGHS" not in proc.stdout


def test_plan_human_report_has_no_solver_banner():
    proc = cli("plan", *TINY, "--mesh", "2", "--no-baselines")
    assert proc.returncode == 0, proc.stderr
    assert "HiGHS" not in proc.stdout and "ILP:" in proc.stdout


def test_trace_json_is_one_object():
    out = json_object(cli("trace", *TINY, "--json"))
    assert out["model"] == "llama-tiny" and out["nodes"] > 0


@pytest.mark.parametrize("argv", [
    ["--collective", "all_reduce", "--bytes", "1GiB", "--ranks", "8"],
    ["--matmul", "1024x1024x1024", "--dtype", "bf16"],
])
def test_cost_json_is_one_object(argv):
    out = json_object(cli("cost", *argv, "--hardware", "h100", "--json"))
    assert out


def test_segment_json_is_one_object():
    out = json_object(cli("segment", *TINY, "--json"))
    assert out["segments"]


@pytest.mark.slow
def test_run_json_is_one_object_and_stderr_stays_empty():
    """The README's run: its FSDP gathers over both mesh dims are lowered through DTensor, which
    would warn on stderr that a flattened mesh could merge them (the plan prices them as run)."""
    proc = cli("run", *TINY, "--mesh", "2x2", "--mesh-names", "dp,tp", "--plan", "fsdp_tp_sp", "--passes",
               "sequence_parallel,collective_matmul", "--check", "--json", "--timeout", "240")
    out = json_object(proc)
    assert out["world_size"] == 4 and out["max_rel_err"] <= 1e-4
    assert proc.stderr == ""


BAD_INPUT = [
    ["plan", "--model", "no-such-model", "--json"],
    ["plan", *TINY, "--mesh", "2", "--json", "--constrain", "nothing.matches.*=R"],
    ["cost", "--collective", "all_reduce", "--bytes", "lots", "--ranks", "8", "--json"],
]


def test_bad_input_is_one_sentence_on_stderr_and_nothing_on_stdout():
    for argv, proc in zip(BAD_INPUT, cli_all(BAD_INPUT), strict=True):
        assert proc.returncode == 2, argv
        assert proc.stdout == ""
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "error:" in lines[0] and "Traceback" not in proc.stderr, proc.stderr
