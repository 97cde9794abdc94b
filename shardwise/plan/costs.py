"""What a strategy costs: compute on local shapes, redistribution along edges, bytes per device.

The planner's view of the cost model (``shardwise.cost``): every figure is per device, on the
local (sharded) shape a placement gives. Results are cached: identical layers ask the same
questions.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import numpy as np
import torch
from torch import fx
from torch.distributed.tensor import Partial, Shard

from shardwise.cost.compute import roofline_time
from shardwise.cost.hardware import Hardware
from shardwise.cost.reshard import ReshardCost, reshard_cost
from shardwise.cost.topology import MeshTopology
from shardwise.ir.flops import NodeCost, is_view, node_cost
from shardwise.plan.placement import Placements
from shardwise.plan.plan import tensor_args
from shardwise.plan.strategies import Strategy, flat_tensor_vals


def shard_factor(placements: Placements, mesh_shape: tuple[int, ...]) -> int:
    """How many pieces a tensor is cut into (product of the mesh dims that shard it)."""
    return math.prod(m for p, m in zip(placements, mesh_shape, strict=True) if isinstance(p, Shard))


def work_factor(placements: Placements, mesh_shape: tuple[int, ...]) -> int:
    """How many ways an op's work is split: mesh dims where its output is sharded or partial."""
    return math.prod(m for p, m in zip(placements, mesh_shape, strict=True)
                     if isinstance(p, (Shard, Partial)))


def local_bytes(t: torch.Tensor, placements: Placements, mesh_shape: tuple[int, ...]) -> int:
    return t.numel() * t.element_size() // shard_factor(placements, mesh_shape)


@dataclass
class PlannerCosts:
    """Costs for one mesh on one hardware spec."""

    mesh_shape: tuple[int, ...]
    hw: Hardware

    def __post_init__(self) -> None:
        self.topology = MeshTopology(self.mesh_shape, self.hw)
        self._node_cache: dict[tuple, float] = {}
        self._node_facts: dict[fx.Node, tuple] = {}
        self._reshard_cache: dict[tuple, tuple[Placements, Placements, ReshardCost]] = {}
        self._matrix_cache: dict[tuple, tuple[list, list, np.ndarray]] = {}
        self._shares_cache: dict[tuple, tuple[list, list, np.ndarray]] = {}

    def compute_time(self, node: fx.Node, s: Strategy) -> float:
        """Roofline time of ``node`` run with strategy ``s`` on local shapes."""
        if node.op != "call_function" or is_view(node) or node.target is operator.getitem:
            return 0.0  # no kernel: metadata only, or an element of a tuple another op computed
        facts = self._node_facts.get(node)
        if facts is None:
            outs = flat_tensor_vals(node)
            args = [a.meta["val"] for a in tensor_args(node)]
            glob = node_cost(node) if outs else None
            # Shapes alone do not fix the cost: two einsums of the same shapes may contract
            # different dims (a forward and a backward one), and the dtype sets the peak rate.
            key = (node.target, tuple(tuple(v.shape) for v in outs), tuple(tuple(a.shape) for a in args),
                   outs[0].dtype if outs else None, glob.flops if glob is not None else None)
            facts = self._node_facts[node] = (outs, args, key, glob)
        outs, args, key, glob = facts
        if not outs:
            return 0.0
        hit = self._node_cache.get((key, s))
        if hit is not None:
            return hit
        div = work_factor(s.output[0], self.mesh_shape)
        reads = sum(local_bytes(a, p, self.mesh_shape) for a, p in zip(args, s.inputs, strict=False))
        writes = sum(local_bytes(v, p, self.mesh_shape) for v, p in zip(outs, s.output, strict=False))
        t = roofline_time(NodeCost(glob.flops // div, reads, writes), self.hw, outs[0].dtype)
        self._node_cache[(key, s)] = t
        return t

    def move_times(self, srcs: list[Placements], dsts: list[Placements], val: torch.Tensor) -> np.ndarray:
        """Seconds to move ``val`` from each of ``srcs`` to each of ``dsts`` (inf: impossible),
        one matrix per distinct question: identical layers ask the same ones."""
        key = (tuple(map(id, srcs)), tuple(map(id, dsts)), val.shape, val.dtype)
        hit = self._matrix_cache.get(key)
        if hit is None:
            times = np.array([[0.0 if p is q else self.reshard(p, q, val).time_s for q in dsts]
                              for p in srcs], dtype=np.float64).reshape(len(srcs), len(dsts))
            hit = self._matrix_cache[key] = (srcs, dsts, times)  # srcs/dsts keep their ids theirs
        return hit[2]

    def move_shares(self, srcs: list[Placements], dsts: list[Placements], val: torch.Tensor) -> np.ndarray:
        """Each move's time (``move_times``) split in two, shape (srcs, dsts, 2): the share of
        the collectives that run as soon as the move is issued, and of those that queue on the
        innermost mesh dim's stream behind an earlier collective of the move (a move through
        several mesh dims is a chain: each collective starts when the one before ends). 0 for a
        free or impossible move."""
        key = (tuple(map(id, srcs)), tuple(map(id, dsts)), val.shape, val.dtype)
        hit = self._shares_cache.get(key)
        if hit is None:
            inner = len(self.mesh_shape) - 1
            shares = np.zeros((len(srcs), len(dsts), 2), dtype=np.float64)
            for i, p in enumerate(srcs):
                for j, q in enumerate(dsts):
                    cost = self.reshard(p, q, val) if p is not q else None
                    if cost is None or not cost.possible or cost.time_s <= 0.0:
                        continue
                    uses = cost.collectives
                    times = [self.topology.collective_time(u.kind, u.bytes, u.mesh_dim) for u in uses]
                    queued = sum(t for t, u in zip(times[1:], uses[1:], strict=True) if u.mesh_dim == inner)
                    shares[i, j] = (sum(times) - queued, queued)
                    shares[i, j] /= sum(times)
            hit = self._shares_cache[key] = (srcs, dsts, shares)
        return hit[2]

    def reshard(self, src: Placements, dst: Placements, val: torch.Tensor) -> ReshardCost:
        """Redistribution cost; keyed on object identity (strategies hold interned placements,
        see ``strategies.intern``) because hashing placement objects dominates the ILP build."""
        key = (id(src), id(dst), val.shape, val.dtype)
        hit = self._reshard_cache.get(key)
        if hit is None:
            cost = reshard_cost(src, dst, tuple(val.shape), val.element_size(), self.topology)
            # Keeping src and dst in the entry keeps them alive, so their ids stay theirs.
            hit = self._reshard_cache[key] = (src, dst, cost)
        return hit[2]
