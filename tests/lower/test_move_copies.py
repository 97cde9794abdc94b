"""A move starts from the copy of its value cheapest to move (``cost/reshard.start_of_move``):
the value as made, or a placement an earlier move of it for a reader of the same phase reached or
passed through. The lowering, the node-by-node estimate and the step schedule move alike, and the
lowered program computes what the graph does."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from shardwise.cost.schedule import EventKind, StepOptions, schedule_step, stream_name
from shardwise.cost.topology import MeshTopology
from shardwise.ir.match import CollectiveKind as K
from shardwise.ir.match import all_collectives
from shardwise.ir.trace import trace
from shardwise.lower import lower
from shardwise.plan.plan import NodeSpec
from shardwise.plan.planner import estimate
from shardwise.runtime import run
from shardwise.runtime.counter import as_json, count_graph
from tests.lower.hand_plans import hand_plan

R, S0, S1 = Replicate(), Shard(0), Shard(1)
MESH, NAMES = (2, 2), ("dp", "tp")
SHAPE = (64, 64)


class Fan(nn.Module):
    """One activation read by two consumers in two placements."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = x * 2
        return a + 1, a * 3


def _fan(first: tuple, second: tuple):
    """``a`` made as (S(0), S(1)); ``a + 1`` reads it in ``first``, ``a * 3`` in ``second``."""
    traced = trace(Fan(), torch.randn(SHAPE), train=False, model_name="fan")
    plan = hand_plan(traced, MESH, (R, R), (S0, S1))
    a, b, c = (n for n in traced.gm.graph.nodes if n.op == "call_function")
    plan.nodes[a.name] = NodeSpec(((S0, S1),), ((S0, S1),))
    plan.nodes[b.name] = NodeSpec((first,), (first,))
    plan.nodes[c.name] = NodeSpec((second,), (second,))
    return traced, plan


@pytest.mark.parametrize(("first", "second"), [((R, S1), (R, R)), ((R, R), (R, S1))])
def test_a_move_starts_from_the_cheapest_copy(first, second):
    """(S(0), S(1)) -> (R, S(1)) gathers over dp; (R, R) is then a gather over tp of that copy.
    Read in the other order, (R, S(1)) is a local slice of the (R, R) copy: no collective."""
    traced, plan = _fan(first, second)
    prog = lower(traced, plan)
    colls = all_collectives(prog.gm.graph)
    assert [c.kind for c in colls] == [K.ALL_GATHER] * 2
    assert sorted(prog.group_dims[c.group_name] for c in colls) == [0, 1]
    estimate(traced, plan)
    assert as_json(plan.collectives) == as_json(count_graph(prog.gm))
    sched = schedule_step(traced, plan, MeshTopology(MESH, "h100"), StepOptions())
    moves = [e for e in sched.events if e.kind == EventKind.COLLECTIVE]
    assert sorted(e.stream for e in moves) == [stream_name(NAMES, 0), stream_name(NAMES, 1)]


@pytest.mark.slow
def test_a_program_that_moves_from_copies_matches_the_reference():
    for prog in (lower(*_fan((R, S1), (R, R))), lower(*_fan((R, R), (R, S1)))):
        res = run(prog, check=True, timeout_s=120)
        assert res.max_rel_err is not None and res.max_rel_err <= 1e-6, res.worst
        assert as_json(res.measured) == as_json(count_graph(prog.gm))
