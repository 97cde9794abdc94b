"""Kernel segmentation: partition a graph into the kernels a fusing compiler would emit, and
price the bytes they pass to each other through device memory.

``segment(gm, forwarding=True) -> Segmentation``. The pieces:

- ``classify``: per-op tables (matmul/einsum/attention, reduction and normalisation, pointwise
  and injective, collectives, free views; factories, unary ops, broadcasts);
- ``forwarding``: rules (a) unary chains from inputs, (b) factory ops, (c) broadcasts of inputs
  -- values each segment recomputes instead of reading;
- ``merge``: greedy producer-consumer merging into an acyclic graph of one-class segments, with
  ``shardwise::segment_set`` forcing a boundary.

The graph is not changed (an analysis: ``apply`` returns the number of segments). A segment's
inputs are the values it reads that it does not compute (graph inputs, other segments' results),
its outputs the values it computes that something outside reads (other segments, the graph
output). ``boundary_bytes`` sums, over segments, the bytes of their inputs and outputs at their
logical shapes: a forwarded broadcast is read at its input's size, a materialised one at its own.
Each segment builds into an ``fx.GraphModule``; ``Segmentation.run`` runs them in order and
gives what the graph gives.

Refused input (``UnsupportedGraph``): in-place ops (the boundaries would hide the writes) and
nodes without fake values (bytes come from them).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

import torch
from torch import fx
from torch.fx.node import map_arg

from shardwise.errors import UnsupportedGraph
from shardwise.ir.flops import node_flops
from shardwise.ir.match import input_closure
from shardwise.passes.segment.classify import SegClass, boundary_bytes_of, is_mutating
from shardwise.passes.segment.forwarding import Forwarding, ForwardKind, find_forwarded
from shardwise.passes.segment.merge import Group, initial_groups, merge_groups

__all__ = ["ForwardKind", "SegClass", "Segment", "Segmentation", "apply", "segment"]

_VAL = "val"


@dataclass(frozen=True, eq=False)
class Segment:
    """One kernel: the nodes it owns, the forwarded nodes it recomputes, what it reads and writes."""

    index: int
    cls: SegClass
    nodes: tuple[fx.Node, ...]
    forwarded: tuple[fx.Node, ...]
    inputs: tuple[fx.Node, ...]
    outputs: tuple[fx.Node, ...]

    @property
    def bytes_in(self) -> int:
        return boundary_bytes_of(self.inputs)

    @property
    def bytes_out(self) -> int:
        return boundary_bytes_of(self.outputs)

    @property
    def boundary_bytes(self) -> int:
        return self.bytes_in + self.bytes_out

    @property
    def flops(self) -> int:
        return sum(node_flops(n) for n in (*self.forwarded, *self.nodes))

    @property
    def dtype(self) -> torch.dtype | None:
        """The dtype of the segment's first tensor result (what its matmuls run in)."""
        for n in self.nodes:
            v = n.meta.get(_VAL)
            if isinstance(v, torch.Tensor):
                return v.dtype
        return None


@dataclass
class Segmentation:
    gm: fx.GraphModule
    segments: list[Segment]
    forwarding: Forwarding
    _modules: dict[int, fx.GraphModule] = field(default_factory=dict, repr=False)

    @property
    def boundary_bytes(self) -> int:
        return sum(s.boundary_bytes for s in self.segments)

    @property
    def forwarded(self) -> dict[str, int]:
        """Forwarded nodes per rule: ``{"unary", "factory", "broadcast"}``."""
        return self.forwarding.counts()

    def by_class(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in self.segments:
            out[s.cls.value] = out.get(s.cls.value, 0) + 1
        return out

    def segment_of(self, node: fx.Node) -> Segment | None:
        """The segment that owns ``node`` (None for inputs and forwarded nodes)."""
        return next((s for s in self.segments if node in s.nodes), None)

    def graph_module(self, seg: Segment) -> fx.GraphModule:
        """``seg`` as a module: placeholders for its inputs (in order), a tuple of its outputs."""
        if seg.index in self._modules:
            return self._modules[seg.index]
        g = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for x in seg.inputs:
            env[x] = g.placeholder(x.name)
            env[x].meta[_VAL] = x.meta.get(_VAL)
        order = _order(self.gm)
        for n in sorted((*seg.forwarded, *seg.nodes), key=order.__getitem__):
            env[n] = g.node_copy(n, env.__getitem__)
        g.output(tuple(env[o] for o in seg.outputs))
        mod = fx.GraphModule(torch.nn.Module(), g, class_name=f"Segment{seg.index}")
        self._modules[seg.index] = mod
        return mod

    def run(self, *args: object) -> object:
        """Run the segments in order on the graph's arguments; returns what ``gm(*args)`` returns."""
        env: dict[fx.Node, object] = {}
        nodes = list(self.gm.graph.nodes)
        for ph, a in zip((n for n in nodes if n.op == "placeholder"), args, strict=True):
            env[ph] = a
        for n in nodes:
            if n.op == "get_attr":
                env[n] = _fetch_attr(self.gm, n.target)
        for seg in self.segments:
            outs = self.graph_module(seg)(*(env[x] for x in seg.inputs))
            env.update(zip(seg.outputs, outs, strict=True))
        out = next(n for n in reversed(nodes) if n.op == "output")
        return map_arg(out.args[0], env.__getitem__)


def _order(gm: fx.GraphModule) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(gm.graph.nodes)}


def _fetch_attr(mod: torch.nn.Module, target: str) -> object:
    for part in target.split("."):
        mod = getattr(mod, part)
    return mod


def check_supported(gm: fx.GraphModule) -> None:
    """Raise ``UnsupportedGraph`` for in-place ops and for nodes without fake values."""
    for n in gm.graph.nodes:
        if is_mutating(n):
            raise UnsupportedGraph(f"segment: node {n.name} ({n.target}) writes its input in place; "
                                   "segment a functional graph (as shardwise.trace produces).")
        if n.op in ("placeholder", "get_attr", "call_function") and n.meta.get(_VAL) is None:
            raise UnsupportedGraph(f"segment: node {n.name} has no fake value in meta['val']; "
                                   "trace the graph on fake tensors (shardwise.trace or make_fx) first.")


def _to_segment(index: int, group: Group, forwarding: Forwarding, order: dict[fx.Node, int]) -> Segment:
    owned = set(group.nodes)
    fwd = input_closure(group.nodes, forwarding)  # the forwarded nodes the group reads
    members = owned | fwd
    inputs = {p for n in members for p in n.all_input_nodes if p not in members}
    outputs = [n for n in owned if any(u not in owned for u in n.users)]
    key = order.__getitem__
    return Segment(
        index=index, cls=group.state.cls, nodes=tuple(sorted(owned, key=key)),
        forwarded=tuple(sorted(fwd, key=key)), inputs=tuple(sorted(inputs, key=key)),
        outputs=tuple(sorted(outputs, key=key)),
    )


def segment(
    gm: fx.GraphModule, *, forwarding: bool = True, mutated_inputs: Collection[str] = ()
) -> Segmentation:
    """Partition ``gm`` into kernels. ``mutated_inputs`` names placeholders the caller writes back
    after the step (an exported program's mutated buffers): forwarding never starts from them."""
    check_supported(gm)
    fwd = find_forwarded(gm.graph, mutated_inputs=mutated_inputs) if forwarding else Forwarding()
    groups = merge_groups(initial_groups(gm.graph, fwd))
    order = _order(gm)
    segments = [_to_segment(i, g, fwd, order) for i, g in enumerate(groups)]
    return Segmentation(gm, segments, fwd)


def apply(gm: fx.GraphModule, *, forwarding: bool = True) -> int:
    """Pass-registry entry point. Segmentation is an analysis: the graph is left unchanged and the
    number of segments is returned."""
    return len(segment(gm, forwarding=forwarding).segments)
