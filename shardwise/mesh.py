"""An abstract device mesh for planning, backed by a fake process group (no devices needed)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from shardwise.errors import UserError

DEFAULT_NAMES = {1: ("dp",), 2: ("dp", "tp"), 3: ("pp", "dp", "tp")}


@dataclass(frozen=True)
class Mesh:
    """A mesh shape with a name per dim, on a named hardware spec.

    ``Mesh((8, 8), ("dp", "tp"))``: 64 devices; the last dim is innermost (its ranks are
    adjacent, so it fills a node first).
    """

    shape: tuple[int, ...]
    names: tuple[str, ...] = ()
    hardware: str = "h100"

    def __post_init__(self) -> None:
        shape = tuple(int(d) for d in self.shape)
        if not shape or any(d < 1 for d in shape):
            raise UserError(f"mesh shape {self.shape} is malformed; every dim must be a positive integer.")
        names = tuple(self.names) or DEFAULT_NAMES.get(len(shape), ())
        if len(names) != len(shape):
            raise UserError(f"mesh names {list(names)} do not match the mesh's {len(shape)} dims; "
                            "give one name per dim, e.g. --mesh-names dp,tp.")
        if len(set(names)) != len(names):
            raise UserError(f"mesh names {list(names)} repeat a name; each dim needs its own.")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "names", names)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def dim(self, name: str) -> int | None:
        return self.names.index(name) if name in self.names else None

    def device_mesh(self, device_type: str = "cpu") -> DeviceMesh:
        """A DeviceMesh over a fake process group of this size (re-initialised if needed). Inside
        a job whose real group is running (``parallelize`` planning on rank 0), a mesh of this
        shape with no groups: sharding propagation needs only the shape, and creating groups on
        one rank alone would hang the others."""
        if dist.is_initialized() and dist.get_backend() != "fake":
            return DeviceMesh(device_type, torch.arange(self.size).view(self.shape),
                              mesh_dim_names=self.names, _init_backend=False)
        ensure_fake_world(self.size)
        return DeviceMesh(device_type, torch.arange(self.size).view(self.shape), mesh_dim_names=self.names)

    def __str__(self) -> str:
        return "x".join(map(str, self.shape)) + f" ({','.join(self.names)})"


def ensure_fake_world(world_size: int) -> None:
    """Make the default process group a fake one of ``world_size`` ranks (rank 0)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        if dist.get_backend() == "fake" and dist.get_world_size() == world_size:
            return
        if dist.get_backend() != "fake":
            raise RuntimeError("a real process group is active; planning needs the fake one.")
        destroy_world()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)


def destroy_world() -> None:
    """Destroy the default process group and forget every DTensor decision cached on its meshes.

    DTensor caches sharding propagation (in C++ and Python) and redistribution plans keyed by
    meshes that compare equal by shape and names alone; a cached result then hands a new mesh's
    tensors the old mesh object, whose groups died with the world ("could not resolve the
    process group registered under the name 7" the next time the same mesh layout is lowered).
    """
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._redistribute import clear_redistribute_planner_cache

    dist.destroy_process_group()
    torch._C._clear_DTensor_sharding_propagator_cache()
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    clear_redistribute_planner_cache()


def parse_mesh(text: str, names: str | None = None, hardware: str = "h100") -> Mesh:
    """Parse ``"8x8"`` / ``"4"`` and ``"dp,tp"`` into a Mesh; one clear error on bad input."""
    if not re.fullmatch(r"\d+(x\d+)*", text.strip()):
        raise UserError(f"mesh {text!r} is malformed; write dims joined by 'x', e.g. 8x8 or 4.")
    shape = tuple(int(d) for d in text.strip().split("x"))
    if any(d < 1 for d in shape):
        raise UserError(f"mesh {text!r} has a dim of size 0; every dim must be at least 1.")
    name_t = tuple(s.strip() for s in names.split(",")) if names else ()
    if len(shape) > len(DEFAULT_NAMES) and not name_t:
        raise UserError(f"mesh {text!r} has {len(shape)} dims; name them with --mesh-names.")
    return Mesh(shape, name_t, hardware)
