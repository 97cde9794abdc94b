import pytest

from shardwise.cost.comm import collective_time
from shardwise.cost.hardware import get_hardware
from shardwise.cost.topology import MeshDimLink, MeshTopology
from shardwise.ir.match import CollectiveKind as K
from shardwise.mesh import Mesh


@pytest.mark.parametrize("shape, links", [
    ((8, 8), [(8, 8), (8, 1)]),          # tp inside a node, dp one GPU per node
    ((2, 4), [(2, 1), (4, 1)]),          # fits one node
    ((16, 4), [(16, 8), (4, 1)]),        # 2 dp ranks share each node
    ((4, 2, 8), [(4, 4), (2, 2), (8, 1)]),
    ((64,), [(64, 8)]),
    ((2, 16), [(2, 2), (16, 2)]),        # the inner dim is wider than a node
])
def test_innermost_dims_fill_a_node_first(shape, links):
    topo = MeshTopology(shape, get_hardware("h100"))
    assert topo.dims == tuple(MeshDimLink(*x) for x in links)


def test_from_mesh_and_collectives_per_dim():
    topo = MeshTopology.from_mesh(Mesh((8, 8), ("dp", "tp"), "h100"))
    hw = get_hardware("h100")
    assert topo.hw == hw and topo.nodes == 8
    assert topo.collective(K.ALL_GATHER, 2**26, 1) == collective_time(K.ALL_GATHER, 2**26, 8, hw, 1)
    assert topo.collective(K.ALL_GATHER, 2**26, 0) == collective_time(K.ALL_GATHER, 2**26, 8, hw, 8)
    # the cross-node dim is the slow one
    assert topo.collective_time(K.ALL_REDUCE, 2**26, 0) > 3 * topo.collective_time(K.ALL_REDUCE, 2**26, 1)


def test_cpu_spec_keeps_a_small_world_on_one_host():
    topo = MeshTopology((2, 4), "cpu")
    assert all(d.intra_node for d in topo.dims)
    assert hash(topo) == hash(MeshTopology((2, 4), "cpu"))
