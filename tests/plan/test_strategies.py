"""Strategy enumeration: asking DTensor once per distinct question changes nothing."""

from __future__ import annotations

import pytest

from shardwise.ir.trace import trace_model
from shardwise.mesh import Mesh
from shardwise.passes.pipeline import canonicalize
from shardwise.plan import strategies


@pytest.mark.parametrize("train", [True, False])
def test_one_question_per_distinct_node_gives_every_node_its_own_answer(monkeypatch, train):
    tr = trace_model("llama-tiny", layers=2, batch=4, seq=32, train=train)
    canonicalize(tr)
    mesh = Mesh((2, 2), ("dp", "tp")).device_mesh()
    shared = strategies.enumerate_strategies(tr.gm, mesh)
    asked_once = {n for n in shared if n.op == "call_function"}
    # Every node asked afresh: a key no other node has.
    monkeypatch.setattr(strategies, "_question", lambda node, choices: node)
    fresh = strategies.enumerate_strategies(tr.gm, mesh)
    assert shared.keys() == fresh.keys()
    for n in shared:
        assert shared[n].strategies == fresh[n].strategies, n.format_node()
        assert (shared[n].follows, shared[n].fallback) == (fresh[n].follows, fresh[n].fallback)
    # The cache did answer some questions for more than one node (else it tests nothing).
    calls = []
    monkeypatch.undo()
    real_ask = strategies._ask
    monkeypatch.setattr(strategies, "_ask", lambda *a: calls.append(a[0]) or real_ask(*a))
    strategies.enumerate_strategies(tr.gm, mesh)
    assert len(calls) < len([n for n in asked_once if n.target is not strategies.operator.getitem])
