"""What a strategy costs: compute on local shapes, redistribution along edges, bytes per device.

The planner's view of the cost model (``shardwise.cost``): every figure is per device, on the
local (sharded) shape a placement gives. Results are cached: identical layers ask the same
questions.
"""

from __future__ import annotations

import math
import operator
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import torch
from torch import fx
from torch.distributed.tensor import Partial, Shard

from shardwise.cost.compute import roofline_time
from shardwise.cost.hardware import Hardware
from shardwise.cost.reshard import (
    ReshardCost,
    makes_partial,
    move_hops,
    normalise,
    reshard_cost,
    reshard_path,
)
from shardwise.cost.reshard import (
    move_times as reshard_move_times,
)
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


@dataclass(frozen=True)
class MoveNetwork:
    """One edge's moves as paths over hops they share (``cost/reshard.move_hops``): a move from
    source i to destination j runs the arcs ``paths[(i, j)]``; ``arcs`` join node indices, each
    taking ``seconds``. Where the moves are shortest paths over hops (``reshard_path``), a
    flow of one unit from the producer's placement to the consumer's over these arcs costs that
    move's time, with fewer columns and rows than one variable per (source, destination)."""

    nodes: int
    src_node: list[int]  # node of each source placement
    dst_node: list[int]  # node of each destination placement
    arcs: list[tuple[int, int]]
    seconds: np.ndarray
    paths: dict[tuple[int, int], list[int]]
    # Each arc's hop, (from, to), the placements (normalised) or ("source", i) for source i's
    # own node: the same hop in another network of the same value has the same label.
    labels: list[tuple]

    def prices(self, times: np.ndarray) -> bool:
        """Whether the cheapest path between each source and destination over the arcs is the
        move's own time (``times``, inf where there is no move)."""
        dist = np.full((self.nodes, self.nodes), np.inf)
        np.fill_diagonal(dist, 0.0)
        for (a, b), t in zip(self.arcs, self.seconds, strict=True):
            dist[a, b] = min(dist[a, b], t)
        for k in range(self.nodes):
            np.minimum(dist, dist[:, k:k + 1] + dist[k:k + 1, :], out=dist)
        got = dist[np.ix_(self.src_node, self.dst_node)]
        finite = np.isfinite(times)
        return bool(np.array_equal(finite, np.isfinite(got))
                    and np.allclose(got[finite], times[finite], rtol=1e-9, atol=1e-15))


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
        self._network_cache: dict[tuple, tuple[list, list, MoveNetwork | None]] = {}
        self._hops_cache: dict[tuple, tuple] = {}

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
            times = reshard_move_times(srcs, dsts, tuple(val.shape), val.element_size(), self.topology)
            hit = self._matrix_cache[key] = (srcs, dsts, times)  # srcs/dsts keep their ids theirs
        return hit[2]

    def move_shares(self, srcs: list[Placements], dsts: list[Placements], val: torch.Tensor,
                    pipelined: bool = True) -> np.ndarray:
        """Each move's time (``move_times``) split in two, shape (srcs, dsts, 2): the share of
        the collectives that run as soon as the move is issued, and of those that queue on the
        innermost mesh dim's stream behind an earlier collective of the move (a move through
        several mesh dims is a chain: each collective starts when the one before ends). With
        ``pipelined`` (issued under the block before its readers'), the first is the larger of its
        mesh dims' parts, not their sum: a block's gathers pipeline over the dims' streams (one's
        tp collective beside the one before's dp collective), so each stream is busy for its own
        part; the first block's readers wait for their chains whole. 0 for a free or impossible
        move."""
        key = (tuple(map(id, srcs)), tuple(map(id, dsts)), val.shape, val.dtype, pipelined)
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
                    later = [k > 0 and u.mesh_dim == inner for k, u in enumerate(uses)]
                    queued = sum(t for t, q in zip(times, later, strict=True) if q)
                    per_dim: dict[int, float] = defaultdict(float)
                    for t, u, q in zip(times, uses, later, strict=True):
                        if not q:
                            per_dim[u.mesh_dim] += t
                    shares[i, j] = (max(per_dim.values()) if pipelined else sum(per_dim.values()), queued)
                    shares[i, j] /= sum(times)
            hit = self._shares_cache[key] = (srcs, dsts, shares)
        return hit[2]

    def move_network(self, srcs: list[Placements], dsts: list[Placements],
                     val: torch.Tensor) -> MoveNetwork | None:
        """The moves of ``val`` from each of ``srcs`` to each of ``dsts`` as paths over shared
        hops (``MoveNetwork``), or None where that network would make some move cheaper than
        ``move_times`` or possible where it is not (a hop of one move's path shortcutting
        another's), so that a flow over it prices every move exactly."""
        key = (tuple(map(id, srcs)), tuple(map(id, dsts)), val.shape, val.dtype)
        if key in self._network_cache:
            return self._network_cache[key][2]
        times = self.move_times(srcs, dsts, val)
        ndim = val.dim()
        node: dict[object, int] = {}
        seen: dict[int, tuple[Placements, int]] = {}  # by the placements' id: hashing them is slow

        def at(p: Placements) -> int:
            hit = seen.get(id(p))
            if hit is None:
                hit = seen[id(p)] = (p, node.setdefault(normalise(p, ndim) or p, len(node)))
            return hit[1]

        arc: dict[tuple[int, int], int] = {}
        seconds: list[float] = []

        def hop(a: int, b: int, t: float) -> int:
            k = arc.setdefault((a, b), len(seconds))
            if k == len(seconds):
                seconds.append(t)
            return k

        finite = list(zip(*np.nonzero(np.isfinite(times)), strict=True))
        # A move that makes a dim Partial runs from the value as made and leaves no copies
        # (``lower/spmd._to_partial``), so it is one arc at its time from the source's own node,
        # which no other move passes through: the source's flow enters there, and a free arc
        # takes it on to the shared node of its placement.
        to_partial = {(i, j) for i, j in finite if makes_partial(srcs[i], dsts[j])}
        local = {i for i, _ in to_partial}
        dst_node = [at(q) for q in dsts]
        src_node = [node.setdefault(("source", i), len(node)) if i in local else at(p)
                    for i, p in enumerate(srcs)]
        paths: dict[tuple[int, int], list[int]] = {}
        for i, j in finite:
            if src_node[i] == dst_node[j]:
                continue
            if (i, j) in to_partial:  # one arc: its path's placements are no other move's
                paths[(int(i), int(j))] = [hop(src_node[i], dst_node[j], float(times[i, j]))]
                continue
            path = [hop(src_node[i], at(srcs[i]), 0.0)] if i in local else []
            if at(srcs[i]) != dst_node[j]:
                hops = self._hops(srcs[i], dsts[j], val)
                path += [hop(at(a), at(b), t) for a, b, t in hops]
            paths[(int(i), int(j))] = path
        names = {i: k for k, i in node.items()}
        labels = [(names[a], names[b]) for a, b in arc]
        net = MoveNetwork(len(node), src_node, dst_node, list(arc), np.array(seconds), paths, labels)
        if not net.prices(times):
            net = None
        self._network_cache[key] = (srcs, dsts, net)
        return net

    def _hops(self, src: Placements, dst: Placements,
              val: torch.Tensor) -> list[tuple[Placements, Placements, float]]:
        """``cost/reshard.move_hops``, keyed on the placements' identity as ``reshard`` is."""
        key = (id(src), id(dst), val.shape, val.dtype)
        hit = self._hops_cache.get(key)
        if hit is None:
            hops = move_hops(src, dst, tuple(val.shape), val.element_size(), self.topology)
            hit = self._hops_cache[key] = (src, dst, hops)  # src/dst keep their ids theirs
        return hit[2]

    def reshard_hops(self, src: Placements, dst: Placements, val: torch.Tensor) -> tuple[Placements, ...]:
        """The placements a move passes through (``cost/reshard.reshard_path``), ``dst`` last."""
        return reshard_path(tuple(src), tuple(dst), tuple(val.shape), val.element_size(), self.topology)[0]

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
