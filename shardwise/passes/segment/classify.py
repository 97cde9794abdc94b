"""Per-op tables: which kernel class a node belongs to, and which ops are factories, unary
pointwise ops or absorbable broadcasts (the forwarding rules read these).

A table lookup, not an if-chain: matmul-class and reduction-class ops are listed by overload
packet; everything in ``_c10d_functional`` is a collective; metadata-only views (``ir.flops``'s
``VIEW_OPS``, ``getitem``, the ``segment_set`` hint) are free; every other op is pointwise or
injective (``cat``, ``index``, ``embedding``, ``where``, casts...), which a fusing compiler emits
as one loop over its output.
"""

from __future__ import annotations

import enum
import math
import operator
from collections.abc import Iterable

import torch
from torch import fx

import shardwise.ir.ops  # noqa: F401  (registers torch.ops.shardwise.*)
from shardwise.ir.flops import VIEW_OPS
from shardwise.ir.meta import flat_tensors

aten = torch.ops.aten
C10D_NAMESPACE = "_c10d_functional"
SEGMENT_SET = torch.ops.shardwise.segment_set.default


class SegClass(enum.StrEnum):
    """One schedulable kernel class; a segment holds nodes of one class (plus free views)."""

    MATMUL = "matmul"
    REDUCTION = "reduction"
    POINTWISE = "pointwise"
    COLLECTIVE = "collective"
    VIEW = "view"


def _packets(*names: str) -> frozenset[object]:
    """The aten overload packets named, skipping names this torch build lacks."""
    return frozenset(p for name in names if (p := getattr(aten, name, None)) is not None)


# Matmul-class: tensor-core work priced by FLOPs (GEMMs, attention, convolutions).
MATMUL_PACKETS = _packets(
    "mm", "bmm", "addmm", "baddbmm", "matmul", "einsum", "linear", "convolution", "convolution_backward",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward",
    "_flash_attention_forward", "_flash_attention_backward", "scaled_dot_product_attention",
)
# Reduction and normalisation: one loop nest that reduces some dims of its input.
REDUCTION_PACKETS = _packets(
    "sum", "mean", "amax", "amin", "prod", "var", "var_mean", "std", "std_mean", "argmax", "argmin",
    "logsumexp", "any", "all", "norm", "linalg_vector_norm", "cumsum", "cumprod",
    "_softmax", "_log_softmax", "_softmax_backward_data", "_log_softmax_backward_data",
    "native_layer_norm", "native_layer_norm_backward", "_fused_rms_norm", "_fused_rms_norm_backward",
    "native_group_norm", "native_group_norm_backward", "native_batch_norm",
    "nll_loss_forward", "nll_loss2d_forward", "embedding_dense_backward",
    "scatter_add", "scatter_reduce", "index_add",
)
# ``max``/``min`` are reductions only in their reducing overloads (``max.other`` is pointwise).
REDUCTION_OVERLOADS = frozenset({aten.max.default, aten.max.dim, aten.min.default, aten.min.dim})
# shardwise's own ops, by name inside the namespace (norms reduce; fused collective-matmuls are GEMMs).
SHARDWISE_CLASS_BY_WORD: tuple[tuple[str, SegClass], ...] = (
    ("matmul", SegClass.MATMUL), ("norm", SegClass.REDUCTION),
)

# Factory ops (forwarding rule (b)): they make a tensor from scalars or another tensor's metadata.
# ``empty`` is left out on purpose: its values are undefined, so two copies need not agree.
FACTORY_PACKETS = _packets(
    "full", "zeros", "ones", "arange", "eye", "scalar_tensor", "linspace", "logspace",
    "full_like", "zeros_like", "ones_like", "new_zeros", "new_ones", "new_full",
)
# Unary ops without the ``pointwise`` tag that still map each element to one element.
UNARY_EXTRA_PACKETS = _packets("_to_copy", "clone", "to", "_conj", "alias_copy")
# Broadcasts and views that forwarding rule (c) re-applies inside a segment.
BROADCAST_PACKETS = _packets("unsqueeze", "expand", "view", "_unsafe_view", "reshape", "permute",
                             "transpose", "t")
# A view that drops a size-1 dim: what a reduction over a broadcast dim becomes.
SQUEEZE_PACKETS = _packets("squeeze")
# Reductions that are metadata-only when every reduced dim has size 1.
DEGENERATE_REDUCE_PACKETS = _packets("sum", "mean", "amax", "amin")
# Ops that re-create a dim (the "broadcast back" half of reduce-then-broadcast).
EXPANDING_PACKETS = _packets("unsqueeze", "expand")


def packet(node: fx.Node) -> object | None:
    return getattr(node.target, "overloadpacket", None) if node.op == "call_function" else None


def is_getitem(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is operator.getitem


def is_segment_set(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is SEGMENT_SET


def is_collective(node: fx.Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "namespace", None) == C10D_NAMESPACE


def is_random(node: fx.Node) -> bool:
    """The op draws random numbers: recomputing it would give other values (never forwarded)."""
    tags = getattr(node.target, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags


def is_mutating(node: fx.Node) -> bool:
    """An in-place or out= op (its schema writes one of its arguments)."""
    schema = getattr(node.target, "_schema", None)
    return node.op == "call_function" and schema is not None and schema.is_mutable


def node_class(node: fx.Node) -> SegClass:
    """The kernel class of a call_function node."""
    if is_getitem(node) or is_segment_set(node) or node.target in VIEW_OPS:
        return SegClass.VIEW
    if is_collective(node):
        return SegClass.COLLECTIVE
    p = packet(node)
    if p in MATMUL_PACKETS:
        return SegClass.MATMUL
    if p in REDUCTION_PACKETS or node.target in REDUCTION_OVERLOADS:
        return SegClass.REDUCTION
    if getattr(node.target, "namespace", None) == "shardwise":
        name = node.target.name()
        for word, cls in SHARDWISE_CLASS_BY_WORD:
            if word in name:
                return cls
    return SegClass.POINTWISE


def is_factory(node: fx.Node) -> bool:
    return packet(node) in FACTORY_PACKETS and not is_random(node)


def is_unary_pointwise(node: fx.Node) -> bool:
    """A pointwise op with exactly one tensor operand (``neg(x)``, ``x * 2.0``, ``x.to(f32)``)."""
    if node.op != "call_function" or is_random(node) or is_factory(node) or len(node.all_input_nodes) != 1:
        return False
    tags = getattr(node.target, "tags", ())
    return torch.Tag.pointwise in tags or packet(node) in UNARY_EXTRA_PACKETS


def is_broadcast_view(node: fx.Node) -> bool:
    return packet(node) in BROADCAST_PACKETS and len(node.all_input_nodes) == 1


def is_expanding(node: fx.Node) -> bool:
    return packet(node) in EXPANDING_PACKETS


def is_degenerate_reduce(node: fx.Node) -> bool:
    """A squeeze, or a sum/mean/amax/amin whose reduced dims all have size 1 (a reshape in effect)."""
    p = packet(node)
    if p in SQUEEZE_PACKETS:
        return True
    if p not in DEGENERATE_REDUCE_PACKETS or len(node.all_input_nodes) != 1:
        return False
    src = node.all_input_nodes[0].meta.get("val")
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if not isinstance(src, torch.Tensor) or dims is None:
        return False
    dims = [dims] if isinstance(dims, int) else list(dims)
    return bool(dims) and all(src.shape[d] == 1 for d in dims)


def value_bytes(node: fx.Node) -> int:
    """Bytes of the tensors a node holds, at their logical (possibly broadcast) shapes."""
    return sum(t.numel() * t.element_size() for t in flat_tensors(node.meta.get("val")))


def storage_root(node: fx.Node) -> fx.Node:
    """The node whose memory ``node`` views (itself unless it is a metadata-only view)."""
    while node.op == "call_function" and node.all_input_nodes and (
        node.target in VIEW_OPS or (is_getitem(node) and node.all_input_nodes[0].target in VIEW_OPS)
    ):
        node = node.all_input_nodes[0]
    return node


def boundary_bytes_of(values: Iterable[fx.Node]) -> int:
    """Bytes that ``values`` move across a segment boundary.

    Values viewing the same memory move it once: their bytes are summed but capped at the larger
    of the memory they view and the largest of them (a broadcast read at its own, larger, shape
    still counts at that shape; three reshapes of one tensor count once)."""
    by_root: dict[fx.Node, list[int]] = {}
    for v in values:
        by_root.setdefault(storage_root(v), []).append(value_bytes(v))
    return sum(min(sum(bs), max(value_bytes(r), *bs)) for r, bs in by_root.items())


def numel(node: fx.Node) -> int:
    """Elements of a node's (first) tensor value: its iteration space as a pointwise loop."""
    ts = flat_tensors(node.meta.get("val"))
    return math.prod(ts[0].shape) if ts else 1


def reduction_space(node: fx.Node) -> frozenset[int]:
    """A reduction's iteration space: the element counts of its input and of its results.

    Pointwise work fits the same loop nest when it runs over one of these counts (a prologue over
    the input, or an epilogue over the reduced or the re-broadcast values)."""
    ins = [t for a in node.all_input_nodes for t in flat_tensors(a.meta.get("val"))][:1]
    outs = flat_tensors(node.meta.get("val"))
    return frozenset(math.prod(t.shape) for t in ins + outs)
