"""Compute time of one node by roofline, on the local (sharded) shapes in its fake values.

    time = max(flops / (peak(dtype) * compute_eff), bytes / (mem_bw * mem_eff)) + launch_s

A node that moves no bytes and does no FLOPs (views, ``getitem``, shape queries) costs zero, and
so do collectives and their waits: their time is communication, priced by ``cost/comm.py``.
FLOPs and bytes come from ``shardwise.ir.flops.node_cost``.
"""

from __future__ import annotations

import enum
import operator
from dataclasses import dataclass

import torch
from torch import fx

from shardwise.cost.hardware import Hardware
from shardwise.ir.flops import NodeCost, is_view, node_cost
from shardwise.ir.match import C10D_KINDS, is_wait

aten = torch.ops.aten

# Ops that only read metadata or assert; they launch no kernel.
METADATA_OPS = frozenset({
    operator.getitem, aten.sym_size.int, aten.sym_numel.default, aten.sym_stride.int,
    aten.sym_storage_offset.default, aten._assert_scalar.default, aten._assert_tensor_metadata.default,
})


class Bound(enum.Enum):
    COMPUTE = "compute"
    MEMORY = "memory"


@dataclass(frozen=True)
class RooflineEstimate:
    time_s: float
    flops: int
    bytes: int
    bound: Bound


def roofline(cost: NodeCost, hw: Hardware, dtype: torch.dtype | str) -> RooflineEstimate:
    """Roofline time of ``cost`` and which side of the roofline binds it."""
    if cost.flops == 0 and cost.bytes == 0:
        return RooflineEstimate(0.0, 0, 0, Bound.MEMORY)
    t_flops = hw.flops_time(cost.flops, dtype)
    t_mem = hw.memory_time(cost.bytes)
    bound = Bound.COMPUTE if t_flops > t_mem else Bound.MEMORY
    return RooflineEstimate(max(t_flops, t_mem) + hw.launch_s, cost.flops, cost.bytes, bound)


def roofline_time(cost: NodeCost, hw: Hardware, dtype: torch.dtype | str) -> float:
    """Seconds for a kernel with ``cost`` on ``hw``: the slower of compute and memory, plus the
    launch floor; zero when it moves nothing and computes nothing."""
    return roofline(cost, hw, dtype).time_s


def is_free(node: fx.Node) -> bool:
    """The node launches no compute kernel: a placeholder/output, a view, a metadata query, or a
    collective (priced as communication)."""
    if node.op != "call_function":
        return True
    return (is_view(node) or node.target in METADATA_OPS or node.target in C10D_KINDS or is_wait(node))


def node_dtype(node: fx.Node) -> torch.dtype:
    """The dtype a node computes in: its (first) output's, else its first tensor input's."""
    val = node.meta.get("val")
    vals = val if isinstance(val, list | tuple) else [val]
    for v in vals:
        if isinstance(v, torch.Tensor) and v.dtype.is_floating_point:
            return v.dtype
    for a in node.all_input_nodes:
        v = a.meta.get("val")
        if isinstance(v, torch.Tensor) and v.dtype.is_floating_point:
            return v.dtype
    return torch.float32


def node_time(node: fx.Node, hw: Hardware) -> float:
    """Roofline seconds of one node on the shapes of its fake values (0 for free nodes)."""
    if is_free(node):
        return 0.0
    return roofline_time(node_cost(node), hw, node_dtype(node))


def graph_compute_time(gm: fx.GraphModule, hw: Hardware) -> float:
    """Sum of ``node_time`` over a graph: its compute time with no overlap between kernels."""
    return sum(node_time(n, hw) for n in gm.graph.nodes)


def matmul_estimate(m: int, k: int, n: int, dtype: torch.dtype | str, hw: Hardware) -> RooflineEstimate:
    """A ``[m, k] @ [k, n]`` matmul: 2mkn FLOPs, reads both operands and writes the product once."""
    itemsize = _itemsize(dtype)
    cost = NodeCost(2 * m * k * n, (m * k + k * n) * itemsize, m * n * itemsize)
    return roofline(cost, hw, dtype)


def elementwise_estimate(numel: int, n_inputs: int, dtype: torch.dtype | str,
                         hw: Hardware) -> RooflineEstimate:
    """A pointwise op over ``numel`` elements reading ``n_inputs`` tensors and writing one."""
    itemsize = _itemsize(dtype)
    return roofline(NodeCost(0, n_inputs * numel * itemsize, numel * itemsize), hw, dtype)


_DTYPE_NAMES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}


def to_dtype(dtype: torch.dtype | str) -> torch.dtype:
    return dtype if isinstance(dtype, torch.dtype) else _DTYPE_NAMES[dtype]


def _itemsize(dtype: torch.dtype | str) -> int:
    return torch.empty((), dtype=to_dtype(dtype)).element_size()
