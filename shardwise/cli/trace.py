"""``shardwise trace``: trace a model's training step (or forward) and canonicalise it.

Human output is a rich summary (nodes, parameters, FLOPs, rewrites, top ops, time); ``--json``
prints ``{"model", "nodes", "params", "flops", "ops", "rewrites", "trace_s"}`` with op keys
written as ``str(node.target)``.
"""

from __future__ import annotations

import argparse
import math
import time
from collections import Counter

from shardwise.cli import add_model_options

# How many of the most frequent ops the human report lists.
TOP_OPS = 12


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("trace", help="trace a model into a canonical ATen graph and summarise it")
    add_model_options(p)
    p.add_argument("--no-canonicalize", action="store_true", help="skip the canonicalisation passes")
    p.set_defaults(handler=run)


def summarize(traced, rewrites: dict[str, int], seconds: float) -> dict:
    """The JSON-able summary of a traced (and possibly canonicalised) graph."""
    from shardwise.ir.flops import graph_flops
    from shardwise.ir.meta import fake_value

    gm = traced.gm
    ops = Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
    params = 0
    for name in traced.params.values():
        v = fake_value(traced.node(name))
        params += v.numel() if v is not None else 0
    return {
        "model": traced.model_name,
        "nodes": len(gm.graph.nodes),
        "params": int(params),
        "flops": int(graph_flops(gm)),
        "ops": dict(ops.most_common()),
        "rewrites": rewrites,
        "trace_s": round(seconds, 3),
    }


def run(args: argparse.Namespace) -> dict:
    from shardwise.ir.trace import trace_model
    from shardwise.passes.pipeline import CANONICALIZE, available, canonicalize

    t0 = time.perf_counter()
    traced = trace_model(args.model, train=not args.inference, layers=args.layers, batch=args.batch,
                         seq=args.seq, dtype=args.dtype)
    t_trace = time.perf_counter() - t0
    if args.no_canonicalize:
        rewrites = {name: 0 for name in available(CANONICALIZE)}
    else:
        rewrites = canonicalize(traced)
    total = time.perf_counter() - t0
    result = summarize(traced, rewrites, total)
    if not args.json:
        _report(result, train=not args.inference, trace_s=t_trace, canon_s=total - t_trace,
                canonicalized=not args.no_canonicalize)
    return result


def _human(n: float, unit: str = "") -> str:
    """1234567 -> '1.23 M' (SI prefixes)."""
    if n == 0:
        return f"0 {unit}".strip()
    prefixes = ["", "K", "M", "G", "T", "P", "E"]
    i = min(int(math.log10(abs(n)) // 3), len(prefixes) - 1)
    return f"{n / 10 ** (3 * i):.3g} {prefixes[i]}{unit}".strip()


def _report(result: dict, *, train: bool, trace_s: float, canon_s: float, canonicalized: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    summary = Table(title=f"shardwise trace: {result['model']} ({'training step' if train else 'forward'})",
                    show_header=False)
    summary.add_column("what", style="bold")
    summary.add_column("value", justify="right")
    summary.add_row("graph nodes", f"{result['nodes']:,}")
    summary.add_row("parameters", f"{result['params']:,} ({_human(result['params'])})")
    summary.add_row("FLOPs", f"{result['flops']:,} ({_human(result['flops'], 'FLOP')})")
    rewrites = ", ".join(f"{k} {v}" for k, v in result["rewrites"].items()) if canonicalized else "skipped"
    summary.add_row("canonicalisation", rewrites or "none")
    timing = f"{result['trace_s']:.2f} s (trace {trace_s:.2f} s, canonicalise {canon_s:.2f} s)"
    summary.add_row("time", timing)
    console.print(summary)

    ops = Table(title=f"top {TOP_OPS} ops")
    ops.add_column("op")
    ops.add_column("count", justify="right")
    for op, n in list(result["ops"].items())[:TOP_OPS]:
        ops.add_row(op, str(n))
    console.print(ops)
