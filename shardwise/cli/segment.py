"""``shardwise segment``: trace a model and partition its graph into kernels.

Reports the segments per class, the bytes they pass through device memory with and without
forwarding, and how many nodes each forwarding rule recomputed. ``--json`` keys: ``segments``,
``by_class``, ``boundary_bytes``, ``boundary_bytes_no_forwarding``, ``forwarded``.
"""

from __future__ import annotations

import argparse

from shardwise.cli import add_model_options

DEFAULT_MODEL = "llama-tiny"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("segment", help="partition a traced step into kernels and price their memory traffic")
    add_model_options(p, default_model=DEFAULT_MODEL)
    p.add_argument("--no-forwarding", action="store_true",
                   help="do not recompute cheap ops in each segment (report bytes without forwarding)")
    p.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> dict:
    from shardwise.ir.trace import trace_model
    from shardwise.passes.segment import ForwardKind, segment

    traced = trace_model(args.model, train=not args.inference, layers=args.layers, batch=args.batch,
                         seq=args.seq, dtype=args.dtype)
    plain = segment(traced.gm, forwarding=False)
    chosen = plain if args.no_forwarding else segment(traced.gm, forwarding=True)
    result = {
        "segments": len(chosen.segments),
        "by_class": chosen.by_class(),
        "boundary_bytes": chosen.boundary_bytes,
        "boundary_bytes_no_forwarding": plain.boundary_bytes,
        "forwarded": chosen.forwarded if not args.no_forwarding else {k.value: 0 for k in ForwardKind},
    }
    if not args.json:
        _report(args, result)
    return result


def _report(args: argparse.Namespace, result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    step = "inference" if args.inference else "training"
    table = Table(title=f"{args.model} {step} step: {result['segments']} segments")
    table.add_column("class")
    table.add_column("segments", justify="right")
    for cls, n in sorted(result["by_class"].items()):
        table.add_row(cls, str(n))
    console = Console()
    console.print(table)
    fwd = ", ".join(f"{k} {v}" for k, v in result["forwarded"].items())
    console.print(f"boundary bytes: {result['boundary_bytes']:,} "
                  f"(without forwarding: {result['boundary_bytes_no_forwarding']:,}); forwarded nodes: {fwd}")
