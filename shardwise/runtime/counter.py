"""Count collectives, in a graph (predicted from the lowered program) and as they execute.

Byte convention, shared with the planner and the cost model (one collective call, one rank):
``all_reduce`` and ``broadcast``: the tensor's bytes; ``all_gather``: the gathered OUTPUT's bytes;
``reduce_scatter``: the full INPUT's bytes; ``all_to_all``: the input's bytes.

``CollectiveCounter`` is a ``TorchDispatchMode``: every ``_c10d_functional`` collective that
runs while it is active is recorded with the same convention, so what ran can be compared with
what the graph (and the plan) says, exactly.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import fx
from torch.utils._python_dispatch import TorchDispatchMode

from shardwise.ir.match import C10D_KINDS, CollectiveKind, all_collectives
from shardwise.plan.plan import CollectiveCount

# Which tensor a kind's bytes are counted on: its output for all_gather, its input otherwise.
_COUNTS_OUTPUT = frozenset({CollectiveKind.ALL_GATHER})


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def collective_bytes(kind: CollectiveKind, inp: torch.Tensor, out: torch.Tensor) -> int:
    return tensor_bytes(out if kind in _COUNTS_OUTPUT else inp)


def _add(acc: dict[str, CollectiveCount], kind: CollectiveKind, nbytes: int) -> None:
    acc[kind.value] = acc.get(kind.value, CollectiveCount()) + CollectiveCount(1, nbytes)


def count_graph(gm: fx.GraphModule) -> dict[str, CollectiveCount]:
    """Collectives in ``gm`` per kind (each op node once), from the nodes' fake values."""
    acc: dict[str, CollectiveCount] = {}
    for c in all_collectives(gm.graph):
        inp, out = c.input.meta.get("val"), c.op.meta.get("val")
        if not isinstance(inp, torch.Tensor) or not isinstance(out, torch.Tensor):
            raise ValueError(f"collective {c.op.format_node()} has no tensor values in its meta")
        _add(acc, c.kind, collective_bytes(c.kind, inp, out))
    return acc


class CollectiveCounter(TorchDispatchMode):
    """Records every c10d functional collective executed while active (``counts`` per kind)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, CollectiveCount] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        kind = C10D_KINDS.get(func)
        if kind is not None:
            _add(self.counts, kind, collective_bytes(kind, args[0], out))
        return out


def as_json(counts: Mapping[str, CollectiveCount]) -> dict[str, dict[str, int]]:
    return {k: {"count": v.count, "bytes": v.bytes} for k, v in sorted(counts.items()) if v.count}


def same_counts(a: Mapping[str, CollectiveCount], b: Mapping[str, CollectiveCount]) -> bool:
    """Equal per kind, ignoring kinds with no calls."""
    return as_json(a) == as_json(b)
