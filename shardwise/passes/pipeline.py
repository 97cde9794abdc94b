"""The canonicalisation pipeline: the passes that turn a traced graph into the canonical graph.

Steps, in order (one screen, by name):

1. ``einsum``  view -> mm -> view (and the weight-gradient mm) -> einsum with the batch dims kept;
2. ``norms``   decomposed RMSNorm (and its residual add) -> ``shardwise.rms_norm`` ops;
3. ``square_grad`` the scalars of a square's backward (an RMSNorm's, in training) -> the small operand.

A step whose module is not part of this checkout is skipped (the registry names passes before
they all exist); a module that exists but fails to import is an error, never silently skipped.
"""

from __future__ import annotations

import importlib.util

from torch import fx

from shardwise.ir.trace import Traced
from shardwise.passes import PASSES, run_passes

CANONICALIZE: tuple[str, ...] = ("einsum", "norms", "square_grad")


def available(names: tuple[str, ...] = CANONICALIZE) -> list[str]:
    """The passes of ``names`` that are registered and whose module exists in this checkout."""
    return [n for n in names if n in PASSES and importlib.util.find_spec(PASSES[n]) is not None]


def canonicalize(traced: Traced) -> dict[str, int]:
    """Run the canonicalisation passes on ``traced.gm`` in place; returns rewrites per pass.

    Forward/backward marks are recomputed afterwards (new nodes have new names).
    """
    counts = run_passes(traced.gm, available())
    rebind_results(traced)
    traced.refresh_phases()
    return counts


def rebind_results(traced: Traced) -> None:
    """Re-read the loss, gradient and output node names from the graph's output node.

    A pass may replace a returned node (a weight gradient that is itself an mm becomes an
    einsum); the output's positions do not change, so names are re-read by position.
    """
    out = next(n for n in reversed(traced.gm.graph.nodes) if n.op == "output")
    results = list(out.args[0])
    if not traced.train:
        traced.outputs = [r.name for r in results if isinstance(r, fx.Node)]
        return
    traced.loss = results[0].name
    grads = zip(traced.params, results[1:], strict=True)
    traced.grads = {k: g.name for k, g in grads if isinstance(g, fx.Node)}
