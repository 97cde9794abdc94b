"""Strategy enumeration: asking DTensor once per distinct question changes nothing."""

from __future__ import annotations

import operator

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
    asked = []
    real_ask = strategies._ask
    monkeypatch.setattr(strategies, "_ask", lambda *a: asked.append(a[0]) or real_ask(*a))
    shared = strategies.enumerate_strategies(tr.gm, mesh)
    ops = [n for n in shared if n.op == "call_function" and n.target is not operator.getitem]
    assert len(asked) < len(ops)  # some answers served several nodes (else this tests nothing)

    monkeypatch.setattr(strategies, "_question", lambda node, choices: node)  # every node afresh
    fresh = strategies.enumerate_strategies(tr.gm, mesh)
    assert shared.keys() == fresh.keys()
    for n in shared:
        assert shared[n].strategies == fresh[n].strategies, n.format_node()
        assert (shared[n].follows, shared[n].fallback) == (fresh[n].follows, fresh[n].fallback)
