"""How a device mesh lands on hosts, and what each mesh dim's groups cost to talk over.

Ranks are numbered row-major over the mesh (the last dim is innermost, its ranks adjacent), and
ranks ``[k*g, (k+1)*g)`` share node ``k`` (``g = gpus_per_node``). So the innermost dims fill a
node first: on an 8x8 mesh of H100s the ``tp`` groups (dim 1) sit inside one node each and the
``dp`` groups (dim 0) take one device from each of 8 nodes.

For each mesh dim, every group of that dim (the ranks that differ only in that coordinate) spans
some nodes; ``MeshDimLink`` keeps the group size and the most nodes any of its groups spans.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from shardwise.cost.comm import CollectiveEstimate, collective_time
from shardwise.cost.hardware import Hardware, get_hardware
from shardwise.ir.match import CollectiveKind


@dataclass(frozen=True)
class MeshDimLink:
    size: int    # ranks in one group of this mesh dim
    nodes: int   # nodes one group spans (the most over all groups of the dim)

    @property
    def intra_node(self) -> bool:
        return self.nodes == 1


def _dim_links(mesh_shape: tuple[int, ...], gpus_per_node: int) -> tuple[MeshDimLink, ...]:
    links = []
    for d, size in enumerate(mesh_shape):
        stride = math.prod(mesh_shape[d + 1:])
        # Groups of dim d: fix every other coordinate. Group starts are the ranks whose dim-d
        # coordinate is 0; scan them all (meshes are small) and keep the widest span.
        widest = 1
        total = math.prod(mesh_shape)
        for start in range(total):
            if (start // stride) % size != 0:
                continue
            span = len({(start + k * stride) // gpus_per_node for k in range(size)})
            widest = max(widest, span)
        links.append(MeshDimLink(size, widest))
    return tuple(links)


@dataclass(frozen=True)
class MeshTopology:
    """A mesh shape on a hardware spec: per mesh dim, its group size and the nodes a group spans."""

    mesh_shape: tuple[int, ...]
    hw: Hardware
    dims: tuple[MeshDimLink, ...] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        shape = tuple(int(d) for d in self.mesh_shape)
        object.__setattr__(self, "mesh_shape", shape)
        object.__setattr__(self, "hw", get_hardware(self.hw))
        object.__setattr__(self, "dims", _dim_links(shape, self.hw.gpus_per_node))
        # cost functions are cached on the topology: hash it once, not on every lookup
        object.__setattr__(self, "_hash", hash((shape, self.hw)))

    def __hash__(self) -> int:
        return self._hash

    @classmethod
    def from_mesh(cls, mesh, hw: Hardware | str | None = None) -> MeshTopology:
        """From a ``shardwise.mesh.Mesh`` (its own hardware name unless ``hw`` is given)."""
        return cls(tuple(mesh.shape), get_hardware(hw if hw is not None else mesh.hardware))

    @property
    def ndim(self) -> int:
        return len(self.mesh_shape)

    @property
    def nodes(self) -> int:
        return math.ceil(math.prod(self.mesh_shape) / self.hw.gpus_per_node)

    def collective(self, kind: CollectiveKind, nbytes: int, mesh_dim: int) -> CollectiveEstimate:
        """One collective over the groups of ``mesh_dim`` (all groups run at once, each alike)."""
        link = self.dims[mesh_dim]
        return collective_time(kind, int(nbytes), link.size, self.hw, link.nodes)

    def collective_time(self, kind: CollectiveKind, nbytes: int, mesh_dim: int) -> float:
        return self.collective(kind, nbytes, mesh_dim).time_s
