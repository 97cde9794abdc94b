"""TEMPORARY stand-in for ``shardwise/passes/remat.py`` (branch ``remat``), with its API.

The step schedule (``cost/schedule.py``) needs to know which forward nodes an activation
checkpointing policy recomputes in the backward and which values stay saved, exactly as the
rematerialisation pass will execute them. Until that pass lands, this module implements the same
contract; when it lands, ``cost/schedule.py`` imports it instead and this file is deleted (there
must not be two policies).

Policies (torchtitan's, ``torchtitan/models/llama3/infra/parallelize.py``):

- ``NONE``: nothing recomputed; every forward value the backward reads is saved.
- ``SELECTIVE`` (per-op SAC): inside each decoder layer keep matmul outputs, except every second
  matmul of the layer, attention outputs, reduce_scatter outputs and ``max``; recompute the rest.
- ``FULL``: recompute each decoder layer's forward in its backward; only its inputs are saved.

Nodes outside the decoder layers (embedding, final norm, output head, loss) are never
recomputed: torchtitan wraps only the transformer blocks in checkpoints.
"""

from __future__ import annotations

import enum
import operator
from dataclasses import dataclass

import torch
from torch import fx

from shardwise.ir.flops import is_view

aten = torch.ops.aten


class ACPolicy(enum.Enum):
    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"


@dataclass
class RematPlan:
    recompute: list[fx.Node]
    saved: list[fx.Node]


# torchtitan's per-op SAC save list (its ``_save_list``): matmuls, attention, reduce_scatter, max.
_MATMULS = frozenset({aten.mm.default, aten.einsum.default, aten.bmm.default, aten.addmm.default})
_SAVED_OPS = frozenset({
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
    aten.max.default, aten.max.dim,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
})


def _forward_nodes(gm: fx.GraphModule) -> set[fx.Node]:
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    fwd: set[fx.Node] = set()
    stack = [out.args[0][0]]
    while stack:
        n = stack.pop()
        if n not in fwd:
            fwd.add(n)
            stack.extend(n.all_input_nodes)
    for n in gm.graph.nodes:
        if n.target is operator.getitem and n.args[0] in fwd:
            fwd.add(n)
    return fwd


def _kept_by_policy(node: fx.Node, policy: ACPolicy, mm_index: dict[fx.Node, int]) -> bool:
    if policy is ACPolicy.FULL:
        return False
    if node.target in _MATMULS:
        # torchtitan counts a layer's matmuls from 1 and recomputes the even ones (every second)
        return mm_index[node] % 2 == 1
    if node.target is operator.getitem:
        return node.args[0].target in _SAVED_OPS
    return node.target in _SAVED_OPS


def recompute_plan(gm: fx.GraphModule, policy: ACPolicy, regions: dict[fx.Node, int]) -> RematPlan:
    """Which forward nodes ``policy`` recomputes in the backward, and which values stay saved.
    ``regions`` gives each node's decoder layer (``plan.cluster.regions``; anything else is
    outside the layers)."""
    fwd = _forward_nodes(gm)
    layer_nodes = [n for n in gm.graph.nodes if n in fwd and n.op == "call_function"
                   and isinstance(regions.get(n), int) and 0 <= regions[n] < (1 << 30)]
    in_layer = set(layer_nodes)
    # Forward values the backward reads (views resolve to what they view: a view is free).
    read_by_bwd = [n for n in gm.graph.nodes if n in fwd and any(u not in fwd for u in n.users)]
    if policy is ACPolicy.NONE:
        return RematPlan([], [n for n in read_by_bwd if not is_view(n)])
    counts: dict[int, int] = {}
    mm_index: dict[fx.Node, int] = {}
    for n in layer_nodes:
        if n.target in _MATMULS:
            k = regions[n]
            counts[k] = counts.get(k, 0) + 1
            mm_index[n] = counts[k]
    recompute: set[fx.Node] = set()
    stack = [n for n in read_by_bwd if n in in_layer and not _kept_by_policy(n, policy, mm_index)]
    while stack:
        n = stack.pop()
        if n in recompute:
            continue
        recompute.add(n)
        stack.extend(a for a in n.all_input_nodes
                     if a in in_layer and not _kept_by_policy(a, policy, mm_index))
    saved = {n for n in read_by_bwd if n not in recompute}
    saved |= {a for n in recompute for a in n.all_input_nodes if a not in recompute}
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    return RematPlan(sorted(recompute, key=order.__getitem__),
                     sorted((n for n in saved if not is_view(n)), key=order.__getitem__))


def saved_bytes(gm: fx.GraphModule, nodes: list[fx.Node]) -> int:
    """Global bytes of the values in ``nodes``."""
    total = 0
    for n in nodes:
        v = n.meta.get("val")
        for t in v if isinstance(v, list | tuple) else [v]:
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total
