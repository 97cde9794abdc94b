"""reshard_cost predicts the collectives DTensor's redistribute emits along the path the move
takes (``reshard_path``: one redistribute, or one per mesh dim): traced with make_fx under a fake
process group, counted with ``all_collectives``, bytes by the nccl-tests convention."""

import itertools
import math
import random
from unittest import mock

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard, placement_types
from torch.fx.experimental.proxy_tensor import make_fx

from shardwise.cost.reshard import local_shape, move_hops, move_times, plan_steps, reshard_cost, reshard_path
from shardwise.cost.topology import MeshTopology
from shardwise.ir.match import CollectiveKind as K
from shardwise.ir.match import all_collectives
from shardwise.lower.spmd import shard_dim_all_to_all
from shardwise.mesh import Mesh

R, P, S0, S1, S2 = Replicate(), Partial(), Shard(0), Shard(1), Shard(2)
GLOBAL = (8, 16)
FLOAT_BYTES = 4


def emitted(mesh_shape, src, dst, global_shape, hops=None):
    """(kind, bytes) of every collective DTensor emits for src -> dst (through the placements
    ``hops``, one redistribute each; by default straight to ``dst``), or None if it refuses."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._redistribute import redistribute_local_tensor

    dm = Mesh(mesh_shape, tuple(f"m{i}" for i in range(len(mesh_shape))), "cpu").device_mesh()
    meta = TensorMeta(torch.Size(global_shape), torch.empty(global_shape).stride(), torch.float32)

    def f(x):  # the internal entry point: it also takes R -> P, which only ops ask for
        at = src
        for hop in hops or (dst,):
            x = redistribute_local_tensor(x, DTensorSpec(dm, at, tensor_meta=meta),
                                          DTensorSpec(dm, hop, tensor_meta=meta))
            at = hop
        return x

    try:  # S(i) -> S(j) as the lowering runs it: one all_to_all (DTensor's CPU path all-gathers)
        with mock.patch.object(placement_types, "shard_dim_alltoall", shard_dim_all_to_all):
            gm = make_fx(f, tracing_mode="fake")(torch.randn(local_shape(src, global_shape, mesh_shape)))
    except (RuntimeError, AssertionError, ValueError):
        return None
    out = []
    for c in all_collectives(gm.graph):
        t = c.op.meta["val"] if c.kind is K.ALL_GATHER else c.input.meta["val"]
        out.append((c.kind, t.numel() * t.element_size()))
    return out


def _pairs(mesh_ndim, k, seed):
    everything = list(itertools.product(itertools.product([R, P, S0, S1], repeat=mesh_ndim), repeat=2))
    return random.Random(seed).sample(everything, k)


# nested and misaligned shardings, where the local shape of each step depends on the other dim
HAND_PICKED = [
    ((S0, S0), (R, S0)), ((S0, S1), (S1, S0)), ((S0, S0), (S1, S1)), ((P, P), (R, R)),
    ((P, S0), (S0, R)), ((S1, P), (R, S1)), ((S0, R), (R, S0)), ((P, R), (S0, S0)),
    ((S0, S0), (R, R)), ((R, S1), (P, S0)), ((S0, P), (S0, R)), ((P, S1), (P, R)),
]


@pytest.mark.parametrize("mesh_shape", [(2, 2), (2, 4)])
@pytest.mark.parametrize("src, dst", HAND_PICKED + _pairs(2, 10, seed=3))
def test_predicted_collectives_match_dtensor(mesh_shape, src, dst):
    topo = MeshTopology(mesh_shape, "cpu")
    hops, cost = reshard_path(src, dst, GLOBAL, FLOAT_BYTES, topo)
    got = emitted(mesh_shape, src, dst, GLOBAL, hops)
    if got is None:
        assert cost.time_s == math.inf
        return
    assert [(u.kind, u.bytes) for u in cost.collectives] == got
    assert cost.time_s == pytest.approx(sum(topo.collective_time(u.kind, u.bytes, u.mesh_dim)
                                            for u in cost.collectives))


@pytest.mark.parametrize("src, dst", [((S0,), (R,)), ((P,), (S1,)), ((S1,), (S0,)), ((P,), (R,))])
def test_one_dim_mesh_matches_dtensor(src, dst):
    topo = MeshTopology((4,), "cpu")
    hops, cost = reshard_path(src, dst, GLOBAL, FLOAT_BYTES, topo)
    assert [(u.kind, u.bytes) for u in cost.collectives] == emitted((4,), src, dst, GLOBAL, hops)


def test_three_dim_mesh_matches_dtensor():
    shape = (8, 16, 4)
    for src, dst in [((S0, S1, S0), (R, S0, S2)), ((P, S2, S0), (S1, R, R)), ((S0, S0, S0), (S1, S1, S1))]:
        hops, cost = reshard_path(src, dst, shape, FLOAT_BYTES, MeshTopology((2, 2, 2), "cpu"))
        got = emitted((2, 2, 2), src, dst, shape, hops)
        assert [(u.kind, u.bytes) for u in cost.collectives] == got


def test_transitions_and_bytes_on_gpus():
    topo = MeshTopology((8,), "h100")
    full = 8 * 16 * 2
    cases = {
        ((S0,), (R,)): [(K.ALL_GATHER, full)],          # gathered output
        ((P,), (R,)): [(K.ALL_REDUCE, full)],
        ((P,), (S1,)): [(K.REDUCE_SCATTER, full)],      # full input
        ((R,), (S0,)): [],                              # local slice
        ((R,), (P,)): [],                               # zeros on the other ranks
        ((S1,), (S1,)): [],
    }
    for (src, dst), want in cases.items():
        cost = reshard_cost(src, dst, GLOBAL, 2, topo)
        assert [(u.kind, u.bytes) for u in cost.collectives] == want
        assert (cost.time_s > 0) == bool(want)
    # S(0) -> S(1) all_to_alls the local input; on a tensor this small, all_gathering it and
    # slicing is cheaper (the all_to_all's latency: NCCL runs it with the Simple protocol only)
    big = (4096, 4096)
    assert [(u.kind, u.bytes) for u in reshard_cost((S0,), (S1,), big, 2, topo).collectives] == [
        (K.ALL_TO_ALL, 4096 * 4096 * 2 // 8)]
    hops, cost = reshard_path((S0,), (S1,), GLOBAL, 2, topo)
    assert hops == ((R,), (S1,)) and [(u.kind, u.bytes) for u in cost.collectives] == [(K.ALL_GATHER, full)]


def test_impossible_transitions_are_infinite():
    topo = MeshTopology((2, 4), "h100")
    assert reshard_cost((S0, R), (P, R), GLOBAL, 2, topo).time_s == math.inf      # S -> P
    assert reshard_cost((P, R), (Partial("max"), R), GLOBAL, 2, topo).time_s == math.inf
    assert reshard_cost((P, Partial("max")), (R, R), GLOBAL, 2, topo).time_s == math.inf  # mixed
    assert reshard_cost((S0, R), (R, R), (7, 16), 2, topo).time_s == math.inf    # 7 rows over 2
    assert reshard_cost((R, S1), (R, R), (8, 6), 2, topo).time_s == math.inf     # 6 cols over 4
    assert not reshard_cost((S0, S0), (R, R), (4, 16), 2, topo).possible          # 4 rows over 8
    # a size-1 mesh dim never communicates, whatever the placements
    assert reshard_cost((S0, R), (P, R), GLOBAL, 2, MeshTopology((1, 4), "h100")).time_s == 0.0


def test_cross_node_dim_costs_more_and_calls_are_cached():
    """A gather over dp (across nodes) goes through tp: sliced over tp, the slow link carries an
    eighth of the bytes, then the fast one gathers the whole; still dearer than a gather over tp."""
    topo = MeshTopology((8, 8), "h100")
    shape = (4096, 4096)
    hops, dp = reshard_path((S0, R), (R, R), shape, 2, topo)
    tp = reshard_cost((R, S0), (R, R), shape, 2, topo)
    assert hops == ((S0, S1), (R, S1), (R, R))
    assert [(u.kind, u.mesh_dim, u.bytes * 8 // math.prod(shape) // 2) for u in dp.collectives] == [
        (K.ALL_GATHER, 0, 1), (K.ALL_GATHER, 1, 8)]
    assert dp.time_s < topo.collective_time(K.ALL_GATHER, math.prod(shape) * 2, 0)  # DTensor's one
    assert dp.time_s > tp.time_s
    hits = reshard_path.cache_info().hits
    reshard_cost((S0, R), (R, R), shape, 2, MeshTopology((8, 8), "h100"))
    assert reshard_path.cache_info().hits == hits + 1


def test_a_gradient_partial_over_both_dims_is_reduced_over_the_fast_dim_first():
    """(P, P) -> (R, S(0)) over (dp across nodes, tp within one): DTensor's one redistribute
    all-reduces the whole tensor over dp, then reduce-scatters over tp; reduce-scattered over tp
    first, dp carries 1/8 of the bytes. A move DTensor already does best keeps its one hop."""
    topo = MeshTopology((8, 8), "h100")
    shape = (4096, 14336)
    hops, cost = reshard_path((P, P), (R, S0), shape, 2, topo)
    assert hops == ((P, S0), (R, S0))
    assert [(u.kind, u.mesh_dim) for u in cost.collectives] == [(K.REDUCE_SCATTER, 1), (K.ALL_REDUCE, 0)]
    assert cost.collectives[1].bytes * 8 == cost.collectives[0].bytes
    full = math.prod(shape) * 2
    straight = topo.collective_time(K.ALL_REDUCE, full, 0) + topo.collective_time(K.REDUCE_SCATTER, full, 1)
    assert cost.time_s < straight / 3
    assert reshard_path((R, S0), (R, R), shape, 2, topo)[0] == ((R, R),)
    # a dim made Partial is the lowering's last step, a local one, after the other dims' path
    hops, cost = reshard_path((S0, R), (R, P), shape, 2, topo)
    other_hops, other = reshard_path((S0, R), (R, R), shape, 2, topo)
    assert len(other_hops) > 1 and hops == (*other_hops, (R, P)) and cost == other


@pytest.mark.parametrize("mesh_shape, shape", [((8, 8), (16, 64, 32)), ((2, 4), (8, 6)), ((2, 2, 2), (8, 8))])
def test_the_time_matrix_and_the_hops_are_reshard_paths(mesh_shape, shape):
    """``move_times`` (one matrix of moves) and ``move_hops`` (one move, hop by hop) answer as
    ``reshard_path`` does for every pair, impossible moves and negative Shard dims too."""
    topo = MeshTopology(mesh_shape, "h100")
    kinds = [R, P, Partial("max"), S0, S1, Shard(-1)]
    places = random.Random(7).sample(list(itertools.product(kinds, repeat=len(mesh_shape))), 24)
    times = move_times(places, places, shape, 2, topo)
    for (i, src), (j, dst) in itertools.product(enumerate(places), repeat=2):
        hops, cost = reshard_path(src, dst, shape, 2, topo)
        assert times[i, j] == (0.0 if i == j else cost.time_s)
        if not cost.possible:
            with pytest.raises(ValueError):
                move_hops(src, dst, shape, 2, topo)
            continue
        got = move_hops(src, dst, shape, 2, topo)
        assert [b for _, b, _ in got][:-1] == list(hops[:-1]) and got[-1][1] == dst
        assert math.isclose(sum(t for _, _, t in got), cost.time_s, rel_tol=1e-12)
    with pytest.raises(ValueError, match="do not match"):
        move_times([(R,)], places, shape, 2, topo)


def test_plan_replicates_misaligned_nested_shards_first():
    steps = plan_steps((S0, S0), (R, S0), (2, 2))
    assert [(s.mesh_dim, s.src, s.dst) for s in steps] == [(1, S0, R), (0, S0, R), (1, R, S0)]
