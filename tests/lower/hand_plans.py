"""Plans built by hand for lowering tests (no planner needed): fix where parameters and inputs
live, leave every other node to DTensor's propagation, deliver gradients like their parameters."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from shardwise.ir.trace import Traced, trace
from shardwise.lower import SPMDProgram, lower
from shardwise.plan.placement import Placements
from shardwise.plan.plan import NodeSpec, Plan, graph_fingerprint
from shardwise.plan.planner import estimate
from shardwise.runtime import run
from shardwise.runtime.counter import as_json, count_graph


def hand_plan(traced: Traced, mesh_shape: tuple[int, ...], params: Placements, inputs: Placements,
              name: str = "hand", mesh_names: tuple[str, ...] | None = None) -> Plan:
    """Every parameter in ``params``, every input in ``inputs``; other nodes unconstrained."""
    names = mesh_names or {1: ("dp",), 2: ("dp", "tp")}[len(mesh_shape)]
    plan = Plan(name=name, model=traced.model_name, mesh_shape=mesh_shape, mesh_names=names,
                hardware="h100", train=traced.train, fingerprint=graph_fingerprint(traced.gm), nodes={},
                params={p: tuple(params) for p in traced.params})
    for i in traced.inputs:
        plan.nodes[i] = NodeSpec((tuple(inputs),))
    return plan


def lower_as_priced(traced: Traced, plan: Plan) -> SPMDProgram:
    """``plan`` lowered, checked to run exactly the collectives the planner prices for it."""
    prog = lower(traced, plan)
    estimate(traced, plan)
    assert as_json(plan.collectives) == as_json(count_graph(prog.gm))
    return prog


def assert_runs_like_the_reference(prog: SPMDProgram) -> None:
    """``prog`` on gloo ranks computes what the graph computes in one process."""
    res = run(prog, check=True, timeout_s=120)
    assert res.max_rel_err is not None and res.max_rel_err <= 1e-6, res.worst


R, S0, S1 = Replicate(), Shard(0), Shard(1)


class TinyMLP(nn.Module):
    """``mse(w2(relu(w1(x))), y)``: a graph small enough to lower and run in a second."""

    def __init__(self, dim: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.w2(torch.relu(self.w1(x))), y)


def tiny_mlp_traced(batch: int = 8, dim: int = 8) -> Traced:
    torch.manual_seed(0)
    return trace(TinyMLP(dim), torch.randn(batch, dim), torch.randn(batch, dim), model_name="tiny-mlp")


class Double(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


def transpose_plan(rows: int = 4, cols: int = 6) -> tuple[Traced, Plan]:
    """``x * 2`` with ``x`` held as S(1) and the product computed on S(0): an S(1) -> S(0) move."""
    traced = trace(Double(), torch.randn(rows, cols), train=False, model_name="double")
    (x,) = traced.inputs
    (out,) = traced.outputs
    plan = hand_plan(traced, (2,), (R,), (S1,))
    plan.nodes[out] = NodeSpec(((S0,),), ((S0,),))
    del x
    return traced, plan
