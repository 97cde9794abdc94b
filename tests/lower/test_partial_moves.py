"""A move into a placement with a Partial dim: the lowering moves the other dims first, along
the path ``cost/reshard.reshard_path`` prices, then makes the Partial dims locally
(``lower/spmd._to_partial``). The price, the collectives lowered and the values agree."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard

from shardwise.cost.reshard import reshard_path
from shardwise.cost.topology import MeshTopology
from shardwise.ir.match import CollectiveKind as K
from shardwise.ir.match import all_collectives
from shardwise.ir.trace import trace
from shardwise.lower import lower
from shardwise.plan.plan import NodeSpec
from tests.lower.hand_plans import assert_runs_like_the_reference, hand_plan, lower_as_priced

R, P, S0, S1 = Replicate(), Partial(), Shard(0), Shard(1)
MESH = (2, 2)
SHAPE = (64, 64)  # small: over 2x2 H100s a gather and a slice beat DTensor's all_to_all


class Scale(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = x * 2
        return a * 3


def _plan():
    """``a`` made as (R, S(0)); ``a * 3`` reads it as (P, S(1))."""
    traced = trace(Scale(), torch.randn(SHAPE), train=False, model_name="scale")
    plan = hand_plan(traced, MESH, (R, R), (R, S0))
    a, b = (n for n in traced.gm.graph.nodes if n.op == "call_function")
    plan.nodes[a.name] = NodeSpec(((R, S0),), ((R, S0),))
    plan.nodes[b.name] = NodeSpec(((P, S1),), ((P, S1),))
    return traced, plan


def test_a_move_into_partial_is_priced_and_lowered_along_the_other_dims_path():
    hops, cost = reshard_path((R, S0), (P, S1), SHAPE, 4, MeshTopology(MESH, "h100"))
    assert hops == ((R, R), (R, S1), (P, S1))  # gathered over tp, sliced, then made Partial
    assert [(u.kind, u.mesh_dim) for u in cost.collectives] == [(K.ALL_GATHER, 1)]
    prog = lower_as_priced(*_plan())
    assert [c.kind for c in all_collectives(prog.gm.graph)] == [K.ALL_GATHER]


@pytest.mark.slow
def test_a_program_that_moves_into_partial_matches_the_reference():
    assert_runs_like_the_reference(lower(*_plan()))
