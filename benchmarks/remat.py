"""Activation checkpointing: what each policy recomputes and what the backward still keeps.

    .venv/bin/python benchmarks/remat.py [--models llama-tiny,llama3-8b,llama3-70b]

For each model (its built-in batch and sequence, bf16 for the large ones; traced on fake tensors)
and each policy (``none``, ``selective``, ``full``): the forward nodes the remat pass copies into
the backward, the FLOPs they cost as a share of the step's, and the activation bytes alive when
the backward starts (the rematerialisation plan, from fake values). For ``llama-tiny`` the
rewritten step also runs on real tensors: the measured bytes (``runtime/activations.py``) and the
largest relative difference of loss and gradients from the original step.
No target: this is the table the step-time estimate prices activation checkpointing from.
"""

from __future__ import annotations

import argparse
import copy

import torch
from rich.console import Console
from rich.table import Table
from torch import fx

from shardwise.cost.units import format_bytes
from shardwise.ir.flops import graph_flops, node_flops
from shardwise.ir.trace import trace_model
from shardwise.models import get_model
from shardwise.passes import remat
from shardwise.passes.pipeline import canonicalize
from shardwise.runtime.activations import run_measured
from shardwise.runtime.launch import real_constants

# The model small enough to run here on real tensors.
RUNNABLE = "llama-tiny"
# Scale of random parameters for the run (keeps a few tiny layers well conditioned).
PARAM_SCALE = 0.1
# Wide enough for the table on any terminal (rich would wrap every cell in a narrow one).
RICH_WIDTH = 140


def _real_args(model: str, gm: fx.GraphModule) -> list[torch.Tensor]:
    module = get_model(model).build_module()
    for name, value in real_constants(gm, module).items():
        setattr(gm, name, value)
    g = torch.Generator().manual_seed(0)
    vocab = module.config.vocab_size if hasattr(module, "config") else 2
    out = []
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            v = n.meta["val"]
            out.append(PARAM_SCALE * torch.randn(tuple(v.shape), generator=g, dtype=v.dtype)
                       if v.dtype.is_floating_point else torch.randint(0, vocab, tuple(v.shape), generator=g))
    return out


def _max_rel_err(a: list, b: list) -> float:
    pairs = [(x, y) for x, y in zip(a, b, strict=True) if isinstance(x, torch.Tensor)]
    return max(((x - y).abs().max() / y.abs().max().clamp_min(1e-30)).item() for x, y in pairs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="llama-tiny,llama3-8b,llama3-70b")
    args = ap.parse_args()
    table = Table(title="activation checkpointing (remat pass)")
    for col in ("model", "policy", "recomputed nodes", "recompute FLOPs", "saved activations",
                "measured", "max rel err"):
        table.add_column(col, justify="left" if col in ("model", "policy") else "right")
    for model in args.models.split(","):
        traced = trace_model(model)
        canonicalize(traced)
        gm = traced.gm
        step_flops = graph_flops(gm)
        real = _real_args(model, gm) if model == RUNNABLE else None
        ref = gm(*real) if real is not None else None
        for policy in remat.ACPolicy:
            plan = remat.recompute_plan(gm, policy)
            flops = sum(node_flops(n) for n in plan.recompute)
            measured = err = "-"
            if real is not None:
                rewritten = fx.GraphModule(gm, copy.deepcopy(gm.graph))
                remat.apply(rewritten, policy)
                out, nbytes = run_measured(rewritten, real)
                measured, err = format_bytes(nbytes), f"{_max_rel_err(list(out), list(ref)):.1e}"
            table.add_row(model, policy.value, str(len(plan.recompute)),
                          f"{flops / 1e12:.2f} TF ({100 * flops / step_flops:.1f}%)",
                          format_bytes(remat.saved_bytes(gm, plan.saved)), measured, err)
    Console(width=RICH_WIDTH).print(table)


if __name__ == "__main__":
    main()
