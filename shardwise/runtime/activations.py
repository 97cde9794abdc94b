"""Measure, while a step runs, the activations its forward leaves for its backward.

``run_measured(gm, args)`` runs ``gm`` with an ``fx.Interpreter`` that frees every value after
its last use (as the generated code does). Just before the backward's first node (the seed of
autograd, ``ir/regions.backward_start``) it sums the bytes of the distinct storages still
held by values the forward region computed: the saved activations. Storages of the step's
placeholders (parameters, inputs) and constants are not counted, nor counted twice when a view
of them is alive: they live for the whole step anyway. Comparing the figure for a program with
and without rematerialisation is the memory the policy saves, measured on real tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import fx

from shardwise.ir.regions import backward_start


def _storages(value: object) -> list[torch.UntypedStorage]:
    vals = value if isinstance(value, (tuple, list)) else (value,)
    return [t.untyped_storage() for t in vals if isinstance(t, torch.Tensor)]


class SavedActivationMeter(fx.Interpreter):
    """Runs a graph and records ``saved_bytes`` (see the module docstring; None when the graph
    has no backward). ``start`` names the backward's first node when the graph lost the fake
    values that find it (a graph shipped to a rank: ``backward_start_name`` on the sender)."""

    def __init__(self, gm: fx.GraphModule, start: str | None = None) -> None:
        super().__init__(gm, garbage_collect_values=True)
        if start is None:
            self.start = backward_start(gm)
        else:
            self.start = next(n for n in gm.graph.nodes if n.name == start)
        self.forward: set[fx.Node] = set()
        if self.start is not None:
            for n in gm.graph.nodes:
                if n is self.start:
                    break
                self.forward.add(n)
        self.owned: set[int] = set()  # data pointers of placeholder and constant storages
        self.saved_bytes: int | None = None

    def run_node(self, n: fx.Node) -> object:
        if n is self.start:
            self.saved_bytes = self._alive_bytes()
        out = super().run_node(n)
        if n.op in ("placeholder", "get_attr"):
            self.owned.update(s.data_ptr() for s in _storages(out))
        return out

    def _alive_bytes(self) -> int:
        seen: dict[int, int] = {}
        for node, value in self.env.items():
            if node not in self.forward or node.op in ("placeholder", "get_attr"):
                continue
            for s in _storages(value):
                if s.data_ptr() not in self.owned:
                    seen[s.data_ptr()] = s.nbytes()
        return sum(seen.values())


def backward_start_name(gm: fx.GraphModule) -> str | None:
    """The name of the backward's first node (names survive shipping a graph; fake values do not)."""
    start = backward_start(gm)
    return start.name if start is not None else None


def run_measured(gm: fx.GraphModule, args: Sequence[torch.Tensor],
                 start: str | None = None) -> tuple[object, int | None]:
    """``gm(*args)`` and the bytes of forward activations alive when the backward starts."""
    meter = SavedActivationMeter(gm, start)
    out = meter.run(*args)
    return out, meter.saved_bytes
