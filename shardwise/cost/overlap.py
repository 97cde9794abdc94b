"""Price of the fused collective-matmul ops, with communication overlapped by compute.

The ring decomposition (``runtime/collective_matmul.py``) runs W steps over a group of W ranks.
With ``c`` the time of one chunk's matmul and ``m`` the time of one hop (the collective's time
over its W - 1 ring steps)::

    all_gather_matmul:      step s multiplies chunk s while chunk s + 1 arrives;
                            W - 1 overlapped steps, then the last chunk's matmul alone
    matmul_reduce_scatter:  the first partial alone, then W - 1 steps each sending one
                            running sum while the next partial is computed

    time = (W - 1) * max(c, m) + c   ~  max(comm, compute) + one chunk

against ``comm + compute`` for the unfused program. A chunk's matmul is priced by roofline on its
own shape, so a chunk too small to keep the device busy (launch floor, memory-bound) shows up.
Communication uses the NCCL-like model of ``cost/comm.py`` (the ring moves the same bytes in the
same W - 1 hops as NCCL's ring all_gather / reduce_scatter).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import fx

from shardwise.cost.comm import collective_time
from shardwise.cost.compute import roofline_time
from shardwise.cost.hardware import Hardware
from shardwise.ir.flops import NodeCost
from shardwise.ir.match import CollectiveKind
from shardwise.ir.meta import fake_value


@dataclass(frozen=True)
class OverlapEstimate:
    """Times in seconds: the fused op (``time_s``), and its collective and matmuls run apart."""

    time_s: float
    comm_s: float
    compute_s: float
    chunk_compute_s: float
    ranks: int

    @property
    def unfused_s(self) -> float:
        return self.comm_s + self.compute_s

    @property
    def saved_s(self) -> float:
        return self.unfused_s - self.time_s


def overlapped_time(chunk_compute_s: float, comm_s: float, ranks: int) -> float:
    """``(W - 1) * max(chunk, hop) + chunk``: the ring's steps overlap one hop with one chunk's
    matmul; one chunk's matmul has no transfer to hide behind."""
    if ranks <= 1:
        return chunk_compute_s + comm_s
    hop = comm_s / (ranks - 1)
    return (ranks - 1) * max(chunk_compute_s, hop) + chunk_compute_s


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def all_gather_matmul_estimate(gathered: tuple[int, ...], ns: list[int], gather_dim: int, ranks: int,
                               dtype: torch.dtype, hw: Hardware, nodes: int = 1) -> OverlapEstimate:
    """``g = all_gather(a)`` of shape ``gathered`` along ``gather_dim``, then ``g @ b`` for b of
    shape ``[K, n]`` for each n in ``ns``."""
    size = _itemsize(dtype)
    rows, k = math.prod(gathered[:-1]), gathered[-1]
    contracting = gather_dim % len(gathered) == len(gathered) - 1
    # One chunk: a W-th of g against all of b (a batch dim) or against b's rows of that chunk (K).
    chunk_rows, chunk_k = (rows, k // ranks) if contracting else (rows // ranks, k)
    chunk = sum(roofline_time(NodeCost(2 * chunk_rows * chunk_k * n, (chunk_rows + n) * chunk_k * size,
                                       chunk_rows * n * size), hw, dtype) for n in ns)
    comm = collective_time(CollectiveKind.ALL_GATHER, rows * k * size, ranks, hw, nodes).time_s
    return OverlapEstimate(overlapped_time(chunk, comm, ranks), comm, chunk * ranks, chunk, ranks)


def matmul_reduce_scatter_estimate(a: tuple[int, ...], n: int, scatter_dim: int, ranks: int,
                                   dtype: torch.dtype, hw: Hardware, nodes: int = 1) -> OverlapEstimate:
    """``reduce_scatter(a @ b)`` along ``scatter_dim`` of the product, with b of shape ``[K, n]``."""
    size = _itemsize(dtype)
    rows, k = math.prod(a[:-1]), a[-1]
    on_columns = scatter_dim % len(a) == len(a) - 1
    chunk_rows, chunk_n = (rows, n // ranks) if on_columns else (rows // ranks, n)
    chunk = roofline_time(NodeCost(2 * chunk_rows * k * chunk_n, (chunk_rows + chunk_n) * k * size,
                                   chunk_rows * chunk_n * size), hw, dtype)
    comm = collective_time(CollectiveKind.REDUCE_SCATTER, rows * n * size, ranks, hw, nodes).time_s
    return OverlapEstimate(overlapped_time(chunk, comm, ranks), comm, chunk * ranks, chunk, ranks)


def _tensor_shape(a: object) -> tuple[int, ...]:
    v = fake_value(a) if isinstance(a, fx.Node) else None
    if v is None:
        raise ValueError(f"fused collective-matmul node input {a} has no fake value to price")
    return tuple(int(d) for d in v.shape)


def _dtype(node: fx.Node) -> torch.dtype:
    return fake_value(node.args[0]).dtype


def _all_gather_matmul_node(node: fx.Node, hw: Hardware, nodes: int) -> OverlapEstimate:
    a, bs, dim, _group, ranks = node.args[:5]
    shp = list(_tensor_shape(a))
    shp[dim % len(shp)] *= ranks
    ns = [_tensor_shape(b)[1] for b in bs]
    return all_gather_matmul_estimate(tuple(shp), ns, dim, ranks, _dtype(node), hw, nodes)


def _matmul_reduce_scatter_node(node: fx.Node, hw: Hardware, nodes: int) -> OverlapEstimate:
    a, b, dim, _op, _group, ranks = node.args[:6]
    return matmul_reduce_scatter_estimate(_tensor_shape(a), _tensor_shape(b)[1], dim, ranks, _dtype(node),
                                          hw, nodes)


def _fused_ops() -> dict[object, Callable[[fx.Node, Hardware, int], OverlapEstimate]]:
    import shardwise.ir.ops  # noqa: F401  (registers torch.ops.shardwise.*)

    return {
        torch.ops.shardwise.all_gather_matmul.default: _all_gather_matmul_node,
        torch.ops.shardwise.matmul_reduce_scatter.default: _matmul_reduce_scatter_node,
    }


def is_fused_collective_matmul(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in _fused_ops()


def fused_node_estimate(node: fx.Node, hw: Hardware, nodes: int = 1) -> OverlapEstimate | None:
    """The overlapped price of a fused collective-matmul node (None for any other node).
    ``nodes``: how many hosts the node's group spans."""
    rule = _fused_ops().get(node.target) if node.op == "call_function" else None
    return rule(node, hw, nodes) if rule is not None else None


def fused_node_time(node: fx.Node, hw: Hardware, nodes: int = 1) -> float | None:
    """Seconds of a fused collective-matmul node, communication included (None for other nodes)."""
    est = fused_node_estimate(node, hw, nodes)
    return est.time_s if est is not None else None
