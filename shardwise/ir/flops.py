"""Per-node cost facts: FLOPs, bytes read and bytes written, from fake values.

FLOPs follow ``torch.utils.flop_counter`` (matmul-class ops only; pointwise work is counted as
memory traffic, not FLOPs). We register formulas for the ops it lacks: ``aten.einsum`` (any batch
rank) and the CPU flash-attention kernels our CPU traces contain, so ``FlopCounterMode`` and this
module agree on every graph we produce. Bytes are the sizes of the tensor inputs and outputs;
ops that only reinterpret metadata (views) move no bytes.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch
from torch import fx
from torch.utils.flop_counter import (
    flop_registry,
    register_flop_formula,
    sdpa_backward_flop_count,
    sdpa_flop_count,
)

from shardwise.ir.meta import arg_values, flat_tensors

aten = torch.ops.aten

# Ops that never touch data: they alias their input or only describe it.
VIEW_OPS = frozenset({
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.t.default,
    aten.transpose.int, aten.permute.default, aten.expand.default, aten.unsqueeze.default,
    aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.slice.Tensor, aten.select.int,
    aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.alias.default,
    aten.detach.default, aten.narrow.default, aten.unbind.int, aten.as_strided.default,
    aten.view_as_real.default, aten.view_as_complex.default, aten.lift_fresh.default,
})


def einsum_flops(equation: str, operands: list[torch.Size], out_shape=None) -> int:
    """2 x (product of every index size) for a two-operand einsum (one multiply-add per point).

    Works for any batch rank: ``"bsk,kn->bsn"`` counts 2*b*s*k*n, ``"bsn,bsk->nk"`` 2*b*s*n*k.
    A one-operand einsum is a reduction or permutation and counts no FLOPs.
    """
    if len(operands) < 2:
        return 0
    lhs = equation.replace(" ", "").split("->")[0].split(",")
    sizes: dict[str, int] = {}
    for letters, shp in zip(lhs, operands, strict=True):
        if "..." in letters:
            raise ValueError(f"einsum_flops does not handle ellipses: {equation!r}")
        for c, d in zip(letters, shp, strict=True):
            sizes[c] = int(d)
    return 2 * math.prod(sizes.values()) * (len(operands) - 1)


@register_flop_formula(aten.einsum, get_raw=True)
def _einsum_flop(equation, tensors, *args, out_val=None, **kwargs) -> int:
    return einsum_flops(equation, [t.shape for t in tensors])


@register_flop_formula(aten._scaled_dot_product_flash_attention_for_cpu, get_raw=True)
def _sdpa_cpu_flop(query, key, value, *args, out_val=None, **kwargs) -> int:
    return sdpa_flop_count(query.shape, key.shape, value.shape)


@register_flop_formula(aten._scaled_dot_product_flash_attention_for_cpu_backward, get_raw=True)
def _sdpa_cpu_bwd_flop(grad_out, query, key, value, *args, out_val=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)


@dataclass(frozen=True)
class NodeCost:
    flops: int
    bytes_read: int
    bytes_written: int

    @property
    def bytes(self) -> int:
        return self.bytes_read + self.bytes_written


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def is_view(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in VIEW_OPS


def node_flops(node: fx.Node) -> int:
    """FLOPs of one node by the flop-counter formulas (0 for ops without a formula)."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return 0
    formula = flop_registry.get(node.target.overloadpacket)
    if formula is None:
        return 0
    args, kwargs = arg_values(node)
    return int(formula(*args, **kwargs, out_val=node.meta.get("val")))


def node_cost(node: fx.Node) -> NodeCost:
    """FLOPs and bytes of a node on the shapes in its fake values."""
    if node.op != "call_function" or is_view(node) or node.target is operator.getitem:
        return NodeCost(0, 0, 0)
    reads = sum(tensor_bytes(v) for v in flat_tensors(arg_values(node)))
    writes = sum(tensor_bytes(v) for v in flat_tensors(node.meta.get("val")))
    return NodeCost(node_flops(node), reads, writes)


def graph_flops(gm: fx.GraphModule) -> int:
    return sum(node_flops(n) for n in gm.graph.nodes)
