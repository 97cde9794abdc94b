"""``shardwise trace``: the JSON summary matches the graph, human output, and bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import pytest

from shardwise.cli import main
from shardwise.ir.flops import graph_flops
from shardwise.ir.trace import trace_model
from shardwise.models import get_model
from shardwise.passes.pipeline import canonicalize

JSON_KEYS = {"model", "nodes", "params", "flops", "ops", "rewrites", "trace_s"}


def run_json(capsys, *argv: str) -> dict:
    assert main(["trace", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_summary_describes_the_canonical_graph(capsys):
    out = run_json(capsys, "--model", "llama-tiny", "--layers", "1")
    assert set(out) == JSON_KEYS
    traced = trace_model("llama-tiny", layers=1)
    rewrites = canonicalize(traced)
    gm = traced.gm
    assert out["model"] == "llama-tiny"
    assert out["nodes"] == len(gm.graph.nodes)
    assert out["ops"] == dict(Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function"))
    assert out["flops"] == graph_flops(gm) > 0
    assert out["rewrites"] == rewrites and out["rewrites"]["einsum"] > 0
    assert "aten.mm.default" not in out["ops"]
    assert out["ops"]["aten.einsum.default"] == out["rewrites"]["einsum"]
    spec = get_model("llama-tiny", layers=1)
    assert out["params"] == sum(p.numel() for p in spec.build_module().parameters())
    assert out["trace_s"] > 0


def test_no_canonicalize_keeps_the_matmuls_and_inference_is_smaller(capsys):
    raw = run_json(capsys, "--model", "llama-tiny", "--layers", "1", "--no-canonicalize")
    assert raw["ops"]["aten.mm.default"] > 0 and "aten.einsum.default" not in raw["ops"]
    assert all(v == 0 for v in raw["rewrites"].values())
    fwd = run_json(capsys, "--model", "llama-tiny", "--layers", "1", "--no-canonicalize", "--inference",
                   "--batch", "2", "--seq", "8", "--dtype", "bf16")
    assert fwd["nodes"] < raw["nodes"] and fwd["flops"] < raw["flops"]
    assert fwd["params"] == raw["params"]


def test_human_report_names_the_facts(capsys):
    assert main(["trace", "--model", "llama-tiny", "--layers", "1"]) == 0
    text = capsys.readouterr().out
    for word in ("graph nodes", "parameters", "FLOPs", "einsum", "aten.einsum.default", "time"):
        assert word in text


def _bad_inputs(tmp_path) -> dict[str, list[str]]:
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{oops")
    unknown_arch = tmp_path / "arch.json"
    unknown_arch.write_text('{"model_type": "surely_not_an_architecture"}')
    return {
        "unknown model": ["--model", "llama9-1t"],
        "missing hf config": ["--model", f"hf:{tmp_path / 'missing.json'}"],
        "unreadable hf config": ["--model", f"hf:{tmp_path}"],
        "invalid hf config": ["--model", f"hf:{bad_json}"],
        "unknown architecture": ["--model", f"hf:{unknown_arch}"],
        "zero layers": ["--model", "llama-tiny", "--layers", "0"],
        "negative layers": ["--model", "llama-tiny", "--layers", "-3"],
    }


@pytest.mark.parametrize("case", ["unknown model", "missing hf config", "unreadable hf config",
                                  "invalid hf config", "unknown architecture", "zero layers",
                                  "negative layers"])
def test_bad_input_is_one_sentence_and_exit_2(tmp_path, capsys, case):
    argv = _bad_inputs(tmp_path)[case]
    assert main(["trace", *argv]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert captured.out == ""
    assert len(err.splitlines()) == 1 and err.endswith(".") and "Traceback" not in err
    if case == "unknown model":
        for name in ("llama-tiny", "llama3-8b", "llama3-70b", "llama3-405b", "hf:"):
            assert name in err


def test_console_entry_point_exits_2_without_traceback():
    proc = subprocess.run([sys.executable, "-m", "shardwise", "trace", "--model", "nope", "--json"],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "known models" in proc.stderr
    assert proc.stdout == ""


def test_a_config_whose_forward_fails_on_fake_tensors_is_one_sentence(tmp_path):
    """A config transformers builds but whose shapes disagree (Helium's head_dim is 128 unless
    given: 4 heads of a 64-wide model project to 512) fails in an op's fake kernel, which torch
    logs on stderr with its traceback before raising: the command says it in one sentence."""
    config = tmp_path / "helium.json"
    config.write_text(json.dumps({"model_type": "helium", "hidden_size": 64, "intermediate_size": 128,
                                  "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1,
                                  "vocab_size": 256, "max_position_embeddings": 64}))
    argv = ["trace", "--model", f"hf:{config}", "--batch", "2", "--seq", "16", "--json"]
    proc = subprocess.run([sys.executable, "-m", "shardwise", *argv], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stdout == ""
    err = proc.stderr.strip()
    assert "cannot be traced on fake tensors" in err and "Traceback" not in err
    assert len(err.splitlines()) == 1, err
