"""Planning time and ILP size of the big built-in models on an 8x8 H100 mesh.

Each case runs in its own Python process (its peak RSS is its own): trace + canonicalise, then
the auto plan. Targets (issue 4, on a 2-core machine): 2-layer 8B <= 3 s, 32-layer 8B <= 10 s,
80-layer 70B <= 20 s in total, peak RSS <= 4 GiB. The figure to beat side by side is PyTorch
autoparallel's 62-69 s (2 layers) and 153-171 s (32 layers) on such a machine (figures.md), which
the table prints next to ours with the speed-up (``faster_x``).

    .venv/bin/python benchmarks/plan.py [--json] [--cases llama3-8b:2,llama3-8b:32,llama3-70b:80]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

# (model, layers, batch, seq, target total seconds, autoparallel's total seconds on a 2-core
# machine like this one (figures.md; None where it was not measured))
CASES = {
    "llama3-8b:2": ("llama3-8b", 2, 16, 8192, 3.0, (62.0, 69.0)),
    "llama3-8b:32": ("llama3-8b", 32, 16, 8192, 10.0, (153.0, 171.0)),
    "llama3-70b:80": ("llama3-70b", 80, 16, 4096, 20.0, None),
}
RSS_TARGET_GIB = 4.0
GIB = 2**30
RSS_UNIT = 1024  # ru_maxrss is in KiB on Linux


def measure_one(model: str, layers: int, batch: int, seq: int) -> dict:
    import torch._dynamo  # noqa: F401  (one-time import cost, kept out of the timings)

    from shardwise.ir.trace import trace_model
    from shardwise.mesh import Mesh
    from shardwise.passes.pipeline import canonicalize
    from shardwise.plan import make_plan

    t0 = time.perf_counter()
    traced = trace_model(model, layers=layers, batch=batch, seq=seq)
    canonicalize(traced)
    trace_s = time.perf_counter() - t0
    plan = make_plan(traced, Mesh((8, 8), ("dp", "tp"), "h100"))
    t = plan.info["timings"]
    return {
        "model": model, "layers": layers, "trace_s": trace_s, "strategies_s": t["strategies_s"],
        "ilp_build_s": t["ilp_build_s"], "solve_s": t["solve_s"], "total_s": trace_s + t["total_s"],
        "variables": plan.info["ilp"]["variables"], "constraints": plan.info["ilp"]["constraints"],
        "status": plan.status, "step_s": plan.estimate.total_s,
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * RSS_UNIT / GIB,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure_one(*CASES[args.one][:4])))
        return
    rows = []
    for key in args.cases.split(","):
        out = subprocess.run([sys.executable, __file__, "--one", key], capture_output=True, text=True)
        if out.returncode != 0:
            print(f"{key}: failed\n{out.stderr[-2000:]}", file=sys.stderr)
            continue
        row = json.loads(out.stdout.strip().splitlines()[-1])
        row["target_s"] = CASES[key][4]
        ref = CASES[key][5]
        row["autoparallel_s"] = f"{ref[0]:.0f}-{ref[1]:.0f}" if ref else "-"
        row["faster_x"] = f"{ref[0] / row['total_s']:.1f}-{ref[1] / row['total_s']:.1f}" if ref else "-"
        rows.append(row)
        if args.json:
            print(json.dumps(row))
    if args.json:
        return
    cols = ("model", "layers", "trace_s", "strategies_s", "ilp_build_s", "solve_s", "total_s", "target_s",
            "autoparallel_s", "faster_x", "variables", "constraints", "status", "step_s", "peak_rss_gib")
    print(" ".join(f"{c:>12}" for c in cols))
    for r in rows:
        print(" ".join(f"{r[c]:>12.2f}" if isinstance(r[c], float) else f"{r[c]!s:>12}" for c in cols))


if __name__ == "__main__":
    main()
