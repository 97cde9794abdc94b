"""Lowering: layouts cut and reassemble exactly, the per-rank graph holds real collectives whose
count and bytes equal the plan's, one graph serves every rank, and plans for other graphs are refused."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from shardwise.errors import UserError
from shardwise.ir.match import all_collectives
from shardwise.ir.trace import Traced, trace_model
from shardwise.lower import Layout, lower
from shardwise.lower.spmd import mesh_coordinate
from shardwise.mesh import Mesh
from shardwise.passes.pipeline import canonicalize
from shardwise.plan.planner import make_plan
from shardwise.runtime.counter import as_json, count_graph
from tests.lower.hand_plans import S0, R, hand_plan, tiny_mlp_traced, transpose_plan


@pytest.mark.parametrize("placements,mesh_shape", [
    ((Shard(0),), (4,)),
    ((Shard(1), Shard(0)), (2, 2)),
    ((Shard(0), Shard(0)), (2, 2)),
    ((Replicate(), Shard(1)), (2, 2)),
    ((Shard(1), Replicate()), (2, 2)),
])
def test_layout_shard_then_assemble_is_identity(placements, mesh_shape):
    full = torch.randn(8, 12)
    lay = Layout("x", (8, 12), full.dtype, placements, mesh_shape)
    coords = [mesh_coordinate(r, mesh_shape) for r in range(4)]
    pieces = {c: lay.shard(full, c) for c in coords}
    assert all(p.shape == lay.local_shape() for p in pieces.values())
    torch.testing.assert_close(lay.assemble(pieces), full, rtol=0, atol=0)


def test_layout_nested_shards_follow_dtensor_order():
    """S(0),S(0) on 2x2: mesh dim 0 cuts first, so rank (0, 1) holds rows 2..3 of 8."""
    full = torch.arange(8.0).view(8, 1)
    lay = Layout("x", (8, 1), full.dtype, (Shard(0), Shard(0)), (2, 2))
    assert lay.shard(full, (0, 1)).flatten().tolist() == [2.0, 3.0]
    assert lay.shard(full, (1, 0)).flatten().tolist() == [4.0, 5.0]


def test_layout_partial_sums_pieces():
    full = torch.randn(4, 4)
    lay = Layout("g", (4, 4), full.dtype, (Partial(), Replicate()), (2, 2))
    pieces = {(i, j): lay.shard(full, (i, j)) for i in range(2) for j in range(2)}
    assert torch.count_nonzero(pieces[(1, 0)]) == 0
    torch.testing.assert_close(lay.assemble(pieces), full)


def test_mesh_coordinate_is_row_major():
    assert [mesh_coordinate(r, (2, 3)) for r in (0, 2, 3, 5)] == [(0, 0), (0, 2), (1, 0), (1, 2)]


def test_lowered_graph_holds_waited_collectives_counted_by_kind():
    traced = tiny_mlp_traced()
    prog = lower(traced, hand_plan(traced, (2,), (R,), (S0,)))
    colls = all_collectives(prog.gm.graph)
    kinds = {c.kind.value for c in colls}
    # DDP: gradients of replicated parameters computed on half the batch each are all-reduced.
    assert "all_reduce" in kinds and kinds <= {"all_reduce", "all_gather"}
    assert all(c.wait is not None and c.group_size == 2 for c in colls)
    # The byte convention, computed independently: all_gather counts its gathered output.
    want: dict[str, int] = {}
    for c in colls:
        v = c.input.meta["val"]
        per = v.numel() * v.element_size() * (c.group_size if c.kind.value == "all_gather" else 1)
        want[c.kind.value] = want.get(c.kind.value, 0) + per
    assert {k: v.bytes for k, v in prog.collectives().items()} == want
    assert prog.unplanned == []


def test_one_graph_serves_every_rank():
    """Redistributing a replicated value to a shard reads the coordinate at run time."""
    traced = tiny_mlp_traced()
    plan = hand_plan(traced, (2,), (S0,), (R,))
    gm0, gm1 = lower(traced, plan, rank=0).gm, lower(traced, plan, rank=1).gm
    assert _signature(gm0) == _signature(gm1)
    assert "_runtime_compute_coordinate_on_dim" in gm0.code


def _signature(gm) -> list[tuple]:
    """The graph's ops and their non-node arguments, in order (node names left out)."""
    import torch.fx as fx

    def arg(a):
        return "node" if isinstance(a, fx.Node) else a

    return [(n.op, str(n.target), str(fx.node.map_aggregate(n.args, arg))) for n in gm.graph.nodes
            if n.op != "get_attr"]


def test_shard_to_shard_is_one_all_to_all():
    """S(1) -> S(0) is an all_to_all_single (DTensor's CPU path would all_gather instead); on a
    tensor too small for that to pay (its latency), an all_gather and a local slice."""
    traced, plan = transpose_plan(1024, 1024)
    prog = lower(traced, plan)
    # The all_to_all sends this rank's whole [1024, 512] piece of fp32.
    assert as_json(count_graph(prog.gm)) == {"all_to_all": {"count": 1, "bytes": 1024 * 512 * 4}}
    assert prog.outputs[0].placements == (S0,) and prog.unplanned == []
    traced, plan = transpose_plan(4, 6)
    prog = lower(traced, plan)
    assert as_json(count_graph(prog.gm)) == {"all_gather": {"count": 1, "bytes": 4 * 6 * 4}}
    assert prog.outputs[0].placements == (S0,) and prog.unplanned == []


def test_plan_for_another_graph_is_refused():
    traced = tiny_mlp_traced()
    plan = hand_plan(traced, (2,), (R,), (S0,))
    other = tiny_mlp_traced(batch=4)
    with pytest.raises(UserError, match="another graph"):
        lower(other, plan)


def test_uneven_placeholder_shard_is_refused():
    traced = tiny_mlp_traced(batch=6)
    with pytest.raises(UserError, match="cannot be split 4 ways"):
        lower(traced, hand_plan(traced, (4,), (R,), (S0,)))


def test_shard_on_a_missing_dim_is_refused():
    traced = tiny_mlp_traced()
    with pytest.raises(UserError, match="cannot be sharded on dim 1"):
        lower(traced, hand_plan(traced, (2,), (Shard(1),), (R,)))



def test_a_move_cheaper_one_mesh_dim_at_a_time_is_lowered_through_its_hops():
    """``x * 2`` with ``x`` partial over both mesh dims, read as (R, S(0)): DTensor's one
    redistribute all-reduces the whole tensor over dp, then reduce-scatters over tp; the planner
    prices (and the lowering runs) the reduce-scatter over tp first, then an all-reduce of half
    the bytes over dp: the collectives run are the ones ``reshard_cost`` priced."""
    from shardwise.cost.reshard import reshard_cost
    from shardwise.cost.topology import MeshTopology
    from shardwise.ir.match import CollectiveKind as K
    from shardwise.ir.trace import trace
    from shardwise.plan.plan import NodeSpec
    from tests.lower.hand_plans import Double

    traced = trace(Double(), torch.randn(8, 8), train=False, model_name="double")
    plan = hand_plan(traced, (2, 2), (R, R), (Partial(), Partial()))
    plan.nodes[traced.outputs[0]] = NodeSpec(((R, S0),), ((R, S0),))
    prog = lower(traced, plan)
    colls = all_collectives(prog.gm.graph)
    assert [c.kind for c in colls] == [K.REDUCE_SCATTER, K.ALL_REDUCE]
    assert [prog.group_dims[c.group_name] for c in colls] == [1, 0]
    priced = reshard_cost((Partial(), Partial()), (R, S0), (8, 8), 4, MeshTopology((2, 2), "h100"))
    assert as_json(count_graph(prog.gm)) == {
        "reduce_scatter": {"count": 1, "bytes": priced.collectives[0].bytes},
        "all_reduce": {"count": 1, "bytes": priced.collectives[1].bytes}}
    assert priced.collectives[0].bytes == 2 * priced.collectives[1].bytes == 8 * 8 * 4


def test_the_coordinate_is_read_once_per_mesh_dim():
    """Every redistribution that cuts this rank's piece reads the coordinate; the program reads
    it once per mesh dim (it was one runtime op, and a constant, per redistribution)."""
    from shardwise.ir.trace import trace_model
    from shardwise.mesh import Mesh
    from shardwise.passes.pipeline import canonicalize
    from shardwise.plan.planner import make_plan

    traced = trace_model("llama-tiny", train=True, layers=1, batch=4, seq=16)
    canonicalize(traced)
    gm = lower(traced, make_plan(traced, Mesh((2, 2), ("dp", "tp")), baseline="fsdp_tp_sp")).gm
    reads = [n for n in gm.graph.nodes
             if n.target is torch.ops.device_mesh._runtime_compute_coordinate_on_dim.default]
    assert reads and len({n.args[1] for n in reads}) == len(reads) <= 2
    # The read serves every cut: each offset is coordinate * chunk (more cuts than reads).
    assert sum(len(r.users) for r in reads) > len(reads)



@pytest.fixture(scope="module")
def bf16_llama() -> Traced:
    traced = trace_model("llama-tiny", train=True, layers=1, batch=4, seq=16, dtype="bf16")
    canonicalize(traced)
    return traced


@pytest.mark.parametrize("baseline, kind", [("ddp", "all_reduce"), ("fsdp", "reduce_scatter")])
def test_gradients_are_reduced_in_the_reduce_dtype(bf16_llama, baseline, kind):
    """DDP's all_reduce and FSDP's reduce_scatter of a bf16 model's gradients run on fp32 values
    when asked (mixed precision's ``reduce_dtype``), and the program hands the gradients back in
    fp32; by default they are reduced, and handed back, in bf16."""
    traced = bf16_llama
    plan = make_plan(traced, Mesh((2,), ("dp",)), baseline=baseline)
    grads = set(traced.grads.values())
    for reduce_dtype, want in ((torch.float32, torch.float32), (None, torch.bfloat16)):
        prog = lower(traced, plan, reduce_dtype=reduce_dtype)
        colls = all_collectives(prog.gm.graph)
        reductions = {c.input.meta["val"].dtype for c in colls if c.kind.value == kind}
        assert want in reductions and (reduce_dtype is None or reductions == {want})
        out = {lay.name: lay.dtype for lay in prog.outputs if lay is not None}
        assert {out[g] for g in grads} == {want}
        assert out[traced.loss] == torch.float32  # the loss is the loss function's
