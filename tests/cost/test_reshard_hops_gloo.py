"""Moves through a placement that is neither end (``cost/reshard.hop_tree``), run on four gloo
ranks the way the lowering runs them (one ``redistribute`` per hop): every rank ends with its
piece of the tensor the source held."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor, placement_types

from shardwise.cost.reshard import reshard_path
from shardwise.cost.topology import MeshTopology
from shardwise.lower.spmd import shard_dim_all_to_all
from tests.helpers import spawn

R, P, S0, S1 = Replicate(), Partial(), Shard(0), Shard(1)
MESH = (2, 2)
SHAPE = (2048, 2048)  # large enough that h100's costs take the detours over 2 x 2
# (source, destination): each path passes a placement that is neither end
MOVES = [((P, P), (R, R)), ((P, S0), (S0, R))]


def _hops(src, dst):
    return reshard_path(src, dst, SHAPE, 4, MeshTopology(MESH, "h100"))[0]


def _run(rank: int, world: int) -> list[float]:
    dm = init_device_mesh("cpu", MESH, mesh_dim_names=("dp", "tp"))
    errors = []
    for k, (src, dst) in enumerate(MOVES):
        full = torch.randn(SHAPE, generator=torch.Generator().manual_seed(k))
        if any(isinstance(p, Partial) for p in src):
            # each rank holds a share of the sum: the global value is ``full``
            at = distribute_tensor(full, dm, [R if isinstance(p, Partial) else p for p in src])
            v = DTensor.from_local(at.to_local() / 2 ** sum(isinstance(p, Partial) for p in src), dm,
                                   list(src), run_check=False)
        else:
            v = distribute_tensor(full, dm, list(src))
        with mock.patch.object(placement_types, "shard_dim_alltoall", shard_dim_all_to_all):
            for hop in _hops(src, dst):
                v = v.redistribute(dm, list(hop))
        want = distribute_tensor(full, dm, list(dst)).to_local()
        same = tuple(v.placements) == dst
        errors.append(float((v.to_local() - want).abs().max()) if same else float("inf"))
    return errors


def test_the_moves_take_a_detour():
    for src, dst in MOVES:
        hops = _hops(src, dst)
        assert len(hops) > 1 and any(any(h[i] not in (src[i], dst[i]) for i in range(2)) for h in hops)


@pytest.mark.slow
def test_a_move_through_other_placements_delivers_the_same_tensor():
    for errors in spawn(_run, 4):
        assert max(errors) < 1e-5, errors
