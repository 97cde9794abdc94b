"""Trace + canonicalise time, node count and peak RSS of the big built-in models.

Each case runs in its own Python process so its peak RSS is its own. Targets (issue 2): 32-layer
LLaMA3-8B in <= 5 s, 80-layer LLaMA3-70B in <= 15 s, peak RSS <= 4 GiB.

    .venv/bin/python benchmarks/trace.py            # the table
    .venv/bin/python benchmarks/trace.py --json     # one JSON object per case
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

# (model, layers, target seconds for trace + canonicalise); None: no time target.
CASES: list[tuple[str, int, float | None]] = [
    ("llama3-8b", 2, None),
    ("llama3-8b", 32, 5.0),
    ("llama3-70b", 80, 15.0),
]
RSS_TARGET_GIB = 4.0
GIB = 2**30
# ru_maxrss is in KiB on Linux.
RSS_UNIT = 1024


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def measure_one(model: str, layers: int) -> dict:
    """Trace and canonicalise one model in this process; the numbers as a dict."""
    ti = time.perf_counter()
    # One-time imports the first trace in a process pays (torch._dynamo alone takes seconds);
    # reported in their own column, not in the trace time.
    import torch._dynamo  # noqa: F401
    import torch._inductor.config  # noqa: F401

    from shardwise.ir.trace import trace_model
    from shardwise.passes.pipeline import canonicalize

    import_s = time.perf_counter() - ti
    cpu0, t0 = _cpu_s(), time.perf_counter()
    traced = trace_model(model, layers=layers)
    t1 = time.perf_counter()
    rewrites = canonicalize(traced)
    t2 = time.perf_counter()
    return {
        "model": model,
        "layers": layers,
        "import_s": round(import_s, 2),
        "trace_s": round(t1 - t0, 2),
        "canonicalize_s": round(t2 - t1, 2),
        "total_s": round(t2 - t0, 2),
        "cpu_s": round(_cpu_s() - cpu0, 2),
        "nodes": len(traced.gm.graph.nodes),
        "rewrites": rewrites,
        "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * RSS_UNIT / GIB, 2),
    }


def run_case(model: str, layers: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--one", model, str(layers)],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--one", nargs=2, metavar=("MODEL", "LAYERS"), help=argparse.SUPPRESS)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure_one(args.one[0], int(args.one[1]))))
        return

    rows = []
    for model, layers, target in CASES:
        r = run_case(model, layers)
        r["target_s"] = target
        r["ok"] = (target is None or r["total_s"] <= target) and r["peak_rss_gib"] <= RSS_TARGET_GIB
        rows.append(r)
    if args.json:
        print(json.dumps({"rows": rows}))  # one object on stdout, as every --json
        return

    from rich.console import Console
    from rich.table import Table

    table = Table(title=(f"trace + canonicalise (targets: total s as listed, RSS <= {RSS_TARGET_GIB} GiB; "
                         "import s: one-time torch imports, not counted; "
                         "cpu s: CPU time of trace + canonicalise)"))
    for col in ("model", "layers", "import s", "trace s", "canon. s", "total s", "cpu s", "target s", "nodes",
                "einsums", "peak RSS GiB", "ok"):
        table.add_column(col, justify="left" if col == "model" else "right")
    for r in rows:
        table.add_row(r["model"], str(r["layers"]), f"{r['import_s']:.2f}", f"{r['trace_s']:.2f}",
                      f"{r['canonicalize_s']:.2f}",
                      f"{r['total_s']:.2f}", f"{r['cpu_s']:.2f}",
                      "-" if r["target_s"] is None else f"{r['target_s']:.0f}", f"{r['nodes']:,}",
                      str(r["rewrites"].get("einsum", 0)), f"{r['peak_rss_gib']:.2f}",
                      "yes" if r["ok"] else "NO")
    Console(width=130).print(table)


if __name__ == "__main__":
    main()
