"""``shardwise segment``: JSON keys, --no-forwarding, bad input."""

from __future__ import annotations

import json

from shardwise.cli import main

SMALL = ["--model", "llama-tiny", "--layers", "1", "--batch", "2", "--seq", "8"]
KEYS = {"segments", "by_class", "boundary_bytes", "boundary_bytes_no_forwarding", "forwarded"}


def run_json(capsys, *argv: str) -> dict:
    assert main(["segment", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_segment_json_reports_forwarding_savings(capsys):
    out = run_json(capsys, *SMALL)
    assert set(out) == KEYS
    assert set(out["forwarded"]) == {"unary", "factory", "broadcast"}
    assert sum(out["by_class"].values()) == out["segments"] > 0
    assert out["boundary_bytes"] < out["boundary_bytes_no_forwarding"]


def test_no_forwarding_reports_the_plain_segmentation(capsys):
    out = run_json(capsys, *SMALL, "--no-forwarding", "--inference")
    assert out["boundary_bytes"] == out["boundary_bytes_no_forwarding"]
    assert out["forwarded"] == {"unary": 0, "factory": 0, "broadcast": 0}


def test_unknown_model_is_one_sentence_and_exit_2(capsys):
    assert main(["segment", "--model", "no-such-model", "--json"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no-such-model" in err
