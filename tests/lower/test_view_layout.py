"""A view reads its input's strides: where a move's collective has laid the value out otherwise
than the trace did, the lowering lays it out as traced first (``_Lowerer._laid_out_as``). An
attention output is the case: made ``(b, h, s, d)`` with ``(b, s, h, d)`` in memory, gathered
over its heads it came back contiguous, and its transpose could not be viewed as ``(b, s, h*d)``
(EXAONE-4's auto plan over 2x2 at batch 8 x 1024: the lowering stopped with a ValueError)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from shardwise.ir.match import CollectiveKind as K
from shardwise.ir.match import all_collectives
from shardwise.ir.trace import trace
from shardwise.lower import lower
from shardwise.plan.plan import NodeSpec
from tests.lower.hand_plans import assert_runs_like_the_reference, hand_plan, lower_as_priced

R, S1 = Replicate(), Shard(1)
MESH = (2,)
B, S, H, D = 2, 4, 4, 8


class Heads(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.transpose(1, 2) * 2  # (b, h, s, d), laid out (b, s, h, d) as its input
        return y.transpose(1, 2).view(B, S, H * D)


def _plan():
    """``y`` made sharded on its heads; its transpose reads it whole: an all_gather."""
    traced = trace(Heads(), torch.randn(B, S, H, D), train=False, model_name="heads")
    plan = hand_plan(traced, MESH, (R,), (R,))
    t1, mul, t2, view = (n for n in traced.gm.graph.nodes if n.op == "call_function")
    assert not mul.meta["val"].is_contiguous()  # the trace's layout, which the view relies on
    plan.nodes[t1.name] = NodeSpec(((R,),), ((R,),))
    plan.nodes[mul.name] = NodeSpec(((S1,),), ((S1,),))
    plan.nodes[t2.name] = NodeSpec(((R,),), ((R,),))
    plan.nodes[view.name] = NodeSpec(((R,),), ((R,),))
    return traced, plan


def test_a_view_after_a_gather_reads_the_traced_layout():
    prog = lower_as_priced(*_plan())
    assert [c.kind for c in all_collectives(prog.gm.graph)] == [K.ALL_GATHER]


@pytest.mark.slow
def test_a_program_whose_view_follows_a_gather_matches_the_reference():
    assert_runs_like_the_reference(lower(*_plan()))
