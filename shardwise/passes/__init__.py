"""Graph passes. Each module exposes ``apply(gm, **options) -> int`` (the number of rewrites).

``PASSES`` maps a pass's public name (as given to ``--passes``) to its module; modules are
imported on first use so a CLI call pays only for the passes it runs.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence

from torch import fx

from shardwise.errors import UserError

PASSES: dict[str, str] = {
    "einsum": "shardwise.passes.einsum",
    "norms": "shardwise.passes.norms",
    "square_grad": "shardwise.passes.square_grad",
    "sequence_parallel": "shardwise.passes.sequence_parallel",
    "collective_matmul": "shardwise.passes.collective_matmul",
    "bucket": "shardwise.passes.bucket",
    "remat": "shardwise.passes.remat",
    "simplify": "shardwise.passes.simplify",
    "early_loss_weight": "shardwise.passes.early_loss_weight",
    "sink_waits": "shardwise.passes.sink_waits",
    "inplace_all_reduce": "shardwise.passes.inplace_all_reduce",
    "exchange_all_reduce": "shardwise.passes.exchange_all_reduce",
    "all_gather_out": "shardwise.passes.all_gather_out",
    "loss_in_bucket": "shardwise.passes.loss_in_bucket",
    "global_mean_loss": "shardwise.passes.global_mean_loss",
}

# Passes that change values by rounding at most and only help a bound program run (fewer ops and
# collectives, collectives under compute, no copies), and ``global_mean_loss``, which reports a
# mean loss over split tokens as one process computes it: ``parallelize`` applies them to every
# program it binds, after the user's passes. ``loss_in_bucket`` needs ``simplify`` to have moved
# the backward's seed off the reduced loss. ``inplace_all_reduce`` and ``all_gather_out`` make the
# graph write buffers in place, so they come last (``all_gather_out`` keeps overlapped gathers off
# a gloo bug: its docstring). ``exchange_all_reduce`` is not among them: it is faster than gloo's
# all_reduce alone (``benchmarks/exchange.py``) but made llama-tiny's whole ddp step ~10% slower
# on two ranks of a 2-core machine (its isend/irecv keep gloo's transport thread busy beside the
# compute); a user may still ask for it with ``passes``.
RUNTIME_PASSES = ("early_loss_weight", "simplify", "loss_in_bucket", "global_mean_loss", "sink_waits",
                  "inplace_all_reduce", "all_gather_out")
# Before torch.compile: the ones that keep the graph functional (Dynamo traces functional
# collectives only); the waits are sunk so that the graph Inductor starts from overlaps them.
COMPILED_RUNTIME_PASSES = ("early_loss_weight", "simplify", "global_mean_loss", "sink_waits")


def parse_passes(names: str | Sequence[str]) -> tuple[str, ...]:
    """Pass names from ``"a,b"`` or a sequence; an unknown name is one clear error."""
    items = names.split(",") if isinstance(names, str) else names
    out = tuple(n.strip() for n in items if n.strip())
    for name in out:
        if name not in PASSES:
            raise UserError(f"unknown pass {name!r}; known passes: {', '.join(PASSES)}.")
    return out


def get_pass(name: str) -> Callable[..., int]:
    if name not in PASSES:
        raise UserError(f"unknown pass {name!r}; known passes: {', '.join(PASSES)}.")
    return importlib.import_module(PASSES[name]).apply


def run_passes(gm: fx.GraphModule, names: list[str], **options) -> dict[str, int]:
    """Run the named passes in order; returns rewrites per pass."""
    return {name: get_pass(name)(gm, **options.get(name, {})) for name in names}
