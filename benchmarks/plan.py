"""Planning time and ILP size of the big built-in models on an 8x8 H100 mesh.

Each case runs in its own Python process (its peak RSS is its own): trace + canonicalise, then
the auto plan. Targets (issue 15, on a 2-core machine): 2-layer 8B <= 5 s; 32-layer 8B within 1%
of the optimum (the ``gap`` column, by the solver's bound) in <= 15 s; 80-layer 70B within 1% in
<= 30 s, all in total wall; peak RSS <= 2 GiB. The figure to beat side by side is PyTorch
autoparallel's 62-69 s (2 layers) and 153-171 s (32 layers) on such a machine (figures.md), which
the table prints next to ours with the speed-up (``faster_x``).

Each case runs cold (the auto ILP alone) and warm (the hand plans priced first and the solver
started from the cheapest, as ``shardwise plan`` does; its total includes the baselines).

    .venv/bin/python benchmarks/plan.py [--json] [--cases llama3-8b:2,llama3-8b:32,llama3-70b:80]
        [--modes cold,warm] [--time-limit 60]
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
    "llama3-8b:2": ("llama3-8b", 2, 16, 8192, 5.0, (62.0, 69.0)),
    "llama3-8b:32": ("llama3-8b", 32, 16, 8192, 15.0, (153.0, 171.0)),
    "llama3-70b:80": ("llama3-70b", 80, 16, 4096, 30.0, None),
}
RSS_TARGET_GIB = 2.0
GIB = 2**30
RSS_UNIT = 1024  # ru_maxrss is in KiB on Linux


def measure_one(model: str, layers: int, batch: int, seq: int, mode: str, time_limit_s: float) -> dict:
    """One case in one mode: ``cold`` solves the auto ILP alone; ``warm`` first prices the hand
    plans and starts the solver from the cheapest (what ``shardwise plan`` does), its wall time
    including the baselines."""
    import torch._dynamo  # noqa: F401  (one-time import cost, kept out of the timings)

    from shardwise.ir.trace import trace_model
    from shardwise.mesh import Mesh
    from shardwise.passes.pipeline import canonicalize
    from shardwise.plan import make_plan
    from shardwise.plan.planner import plan_with_baselines

    t0 = time.perf_counter()
    traced = trace_model(model, layers=layers, batch=batch, seq=seq)
    canonicalize(traced)
    trace_s = time.perf_counter() - t0
    mesh = Mesh((8, 8), ("dp", "tp"), "h100")
    t1 = time.perf_counter()
    if mode == "warm":
        plan, _ = plan_with_baselines(traced, mesh, time_limit_s=time_limit_s)
    else:
        plan = make_plan(traced, mesh, time_limit_s=time_limit_s)
    plan_s = time.perf_counter() - t1
    t = plan.info["timings"]
    return {
        "model": model, "layers": layers, "mode": mode, "trace_s": trace_s,
        "strategies_s": t["strategies_s"], "ilp_build_s": t["ilp_build_s"], "solve_s": t["solve_s"],
        "baselines_s": plan_s - t["total_s"], "total_s": trace_s + plan_s,
        "variables": plan.info["ilp"]["variables"], "constraints": plan.info["ilp"]["constraints"],
        "status": plan.status, "step_s": plan.estimate.total_s, "gap": plan.mip_gap,
        "start": plan.info.get("started_from") or "-",
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * RSS_UNIT / GIB,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--modes", default="cold,warm",
                    help="cold (the auto ILP alone), warm (started from the best hand plan)")
    ap.add_argument("--time-limit", type=float, default=60.0, help="solver time limit per solve, seconds")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="cold", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure_one(*CASES[args.one][:4], args.mode, args.time_limit)))
        return
    rows = []
    for key in args.cases.split(","):
        for mode in args.modes.split(","):
            out = subprocess.run([sys.executable, __file__, "--one", key, "--mode", mode,
                                  "--time-limit", str(args.time_limit)], capture_output=True, text=True)
            if out.returncode != 0:
                print(f"{key} {mode}: failed\n{out.stderr[-2000:]}", file=sys.stderr)
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
    cols = ("model", "layers", "mode", "trace_s", "strategies_s", "ilp_build_s", "solve_s", "baselines_s",
            "total_s", "target_s", "autoparallel_s", "faster_x", "variables", "constraints", "status",
            "step_s", "gap", "start", "peak_rss_gib")
    print(" ".join(f"{c:>12}" for c in cols))
    for r in rows:
        print(" ".join(f"{r[c]:>12.4f}" if isinstance(r[c], float) else f"{r[c]!s:>12}" for c in cols))


if __name__ == "__main__":
    main()
