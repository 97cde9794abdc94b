"""Planning time and ILP size of the big built-in models on an 8x8 H100 mesh.

Each case runs in its own Python process (its peak RSS is its own): trace + canonicalise, then
the auto plan. ``cpu_s`` is the process's CPU time for all of it: on a machine shared with
other work, compare that when the wall times are noisy.

Targets (issue 15, on a 2-core machine), total wall time with tracing included: 2-layer 8B
<= 5 s; 32-layer 8B a plan within 1% of the optimum (by the solver's bound) in <= 15 s and the
optimum in <= 60 s; 80-layer 70B within 1% in <= 30 s; peak RSS <= 2 GiB. The table prints the
gap to the solver's bound and whether each target holds (``ok``: "yes", or the ones missed), and
PyTorch autoparallel's 62-69 s (2 layers) and 153-171 s (32 layers) on such a machine
(figures.md) with our speed-up over it (``faster_x``).

Each case runs cold (the auto ILP alone) and warm (the hand plans priced first and the solver
started from the cheapest, as ``shardwise plan`` does; its total includes the baselines).
``--no-pricing`` hands HiGHS the whole model at once instead of the restricted LP and pricing
of ``plan/solver.py`` (to compare the two).

    .venv/bin/python benchmarks/plan.py [--json] [--cases llama3-8b:2,llama3-8b:32,llama3-70b:80]
        [--modes cold,warm] [--time-limit 60] [--repeat N] [--no-pricing]

What each change to the model did (issue 15 item 4; llama3-8b over 8x8 h100, b16 x 8192, HiGHS
1.16 on one thread, a 2-core machine shared with other work; CPU seconds of the solve alone, two
interleaved runs each, by ``ilp.solve`` on the same strategies):

| model (rows: 15.6k / 15.9k throughout) | columns solved, 2 / 32 layers | CPU s, 2 L | 32 L     |
| -------------------------------------- | ----------------------------- | ---------- | -------- |
| whole model, HiGHS MIP (before)        | 105,457 / 106,850             | 7.2, 6.6   | 4.3, 4.4 |
| LP first, no column left out           | 105,457 / 106,850             | -          | 4.7, 5.4 |
| restricted LP + pricing, 3 per line    | - / 43,549 (9,128 priced in)  | -          | 3.4      |
| restricted LP + pricing, 6 per line    | 57,154 / 58,083 (2.5k priced) | 2.4, 3.4   | 2.5, 2.0 |
| restricted LP + pricing, 8 per line    | 69,621 / 70,407 (1.2k priced) | 3.7, 3.3   | 2.1, 2.5 |
| restricted LP + pricing, 10 per line   | 80,473 / 81,490 (0.8k priced) | 6.6, 7.0   | 2.1, 2.1 |

All reach the same optimum (0.058626 s and 0.437301 s per step), from an integral LP optimum.
End to end (``--modes warm``, interleaved runs on the shared machine): 2 layers 8.7-10.6 s
total (solve 4.8-5.3 s, 5.9-6.5 CPU s) against 12.3-13.6 s (solve 8.2-9.2 s, 8.2-9.1 CPU s)
with ``--no-pricing``; 32 layers 10.7-11.3 s (solve 3.6-5.1 s) against 13.9-14.5 s (solve
6.7-7.4 s); peak RSS 0.47-0.49 GiB against 0.75-0.78 GiB (HiGHS's MIP presolve is skipped).
70B (fractional LP: the memory row binds) is unchanged: feasible at 60 s, 2.1339 s, gap 1.5%.
The rows do not shrink (one per transport marginal), and the dual simplex's iterations follow
the rows: the restricted LP still takes ~11k of the whole MIP's ~14-16k iterations.
Exact reductions measured and not kept: merging transport rows or columns that are equal up to
a constant (LP-equivalent) leaves 98,257 of 99,543 pairs; a two-stage flow through the
intermediate placement of DTensor's per-mesh-dim steps would keep ~370 of 576 pairs of a 24x24
edge at the price of ~50 more rows per edge.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

# (model, layers, batch, seq, target total seconds for a plan within TARGET_GAP, target total
# seconds for the proven optimum (None: not asked), autoparallel's total seconds on a 2-core
# machine like this one (figures.md; None where it was not measured)); issue 15's figures.
CASES = {
    "llama3-8b:2": ("llama3-8b", 2, 16, 8192, 5.0, None, (62.0, 69.0)),
    "llama3-8b:32": ("llama3-8b", 32, 16, 8192, 15.0, 60.0, (153.0, 171.0)),
    "llama3-70b:80": ("llama3-70b", 80, 16, 4096, 30.0, None, None),
}
# "Within 1% of the optimum by the solver's bound" (issue 15).
TARGET_GAP = 0.01
RSS_TARGET_GIB = 2.0
GIB = 2**30
RSS_UNIT = 1024  # ru_maxrss is in KiB on Linux


def measure_one(model: str, layers: int, batch: int, seq: int, mode: str, time_limit_s: float,
                pricing: bool = True, rel_gap: float | None = None) -> dict:
    """One case in one mode: ``cold`` solves the auto ILP alone; ``warm`` first prices the hand
    plans and starts the solver from the cheapest (what ``shardwise plan`` does), its wall time
    including the baselines."""
    import torch._dynamo  # noqa: F401  (one-time import cost, kept out of the timings)

    from shardwise.ir.trace import trace_model
    from shardwise.mesh import Mesh
    from shardwise.passes.pipeline import canonicalize
    from shardwise.plan import make_plan
    from shardwise.plan.planner import plan_with_baselines

    t0, cpu0 = time.perf_counter(), time.process_time()
    traced = trace_model(model, layers=layers, batch=batch, seq=seq)
    canonicalize(traced)
    trace_s = time.perf_counter() - t0
    mesh = Mesh((8, 8), ("dp", "tp"), "h100")
    t1 = time.perf_counter()
    if not pricing:  # the whole model at once, for comparison
        import functools

        import shardwise.plan.planner as planner

        planner.solve = functools.partial(planner.solve, pricing=False)
    gap = {} if rel_gap is None else {"rel_gap": rel_gap}
    if mode == "warm":
        plan, _ = plan_with_baselines(traced, mesh, time_limit_s=time_limit_s, **gap)
    else:
        plan = make_plan(traced, mesh, time_limit_s=time_limit_s, **gap)
    plan_s = time.perf_counter() - t1
    t = plan.info["timings"]
    return {
        "model": model, "layers": layers, "mode": mode, "trace_s": trace_s,
        "strategies_s": t["strategies_s"], "ilp_build_s": t["ilp_build_s"], "solve_s": t["solve_s"],
        "baselines_s": plan_s - t["total_s"], "total_s": trace_s + plan_s,
        "cpu_s": time.process_time() - cpu0,
        "variables": plan.info["ilp"]["variables"], "constraints": plan.info["ilp"]["constraints"],
        "status": plan.status, "step_s": plan.estimate.total_s, "gap": plan.mip_gap,
        "bound_s": plan.info["bound_s"], "columns_solved": plan.info["ilp"].get("columns_solved", "-"),
        "start": plan.info.get("started_from") or "-",
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * RSS_UNIT / GIB,
    }


def _targets(key: str, row: dict) -> str:
    """Which of the case's targets the run meets: "yes", or the ones it misses."""
    _, _, _, _, within_s, optimum_s, _ = CASES[key]
    missed = []
    if not (row["total_s"] <= within_s and row["gap"] <= TARGET_GAP):
        missed.append(f"{TARGET_GAP:.0%}@{within_s:g}s")
    if optimum_s is not None and not (row["status"] == "optimal" and row["total_s"] <= optimum_s):
        missed.append(f"opt@{optimum_s:g}s")
    if row["peak_rss_gib"] > RSS_TARGET_GIB:
        missed.append(f"rss{RSS_TARGET_GIB:g}")
    return "yes" if not missed else "NO:" + "+".join(missed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--modes", default="cold,warm",
                    help="cold (the auto ILP alone), warm (started from the best hand plan)")
    ap.add_argument("--time-limit", type=float, default=60.0, help="solver time limit per solve, seconds")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each case (timings are noisy)")
    ap.add_argument("--no-pricing", action="store_true", help="hand HiGHS the whole model at once")
    ap.add_argument("--gap", type=float, default=None,
                    help="stop at a plan within this relative gap of the bound (default: the optimum)")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="cold", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure_one(*CASES[args.one][:4], args.mode, args.time_limit,
                                     pricing=not args.no_pricing, rel_gap=args.gap)))
        return
    rows = []
    for key in args.cases.split(","):
        for mode in args.modes.split(","):
            for _ in range(args.repeat):
                cmd = [sys.executable, __file__, "--one", key, "--mode", mode,
                       "--time-limit", str(args.time_limit)]
                cmd += ["--no-pricing"] if args.no_pricing else []
                cmd += ["--gap", str(args.gap)] if args.gap is not None else []
                out = subprocess.run(cmd, capture_output=True, text=True)
                if out.returncode != 0:
                    print(f"{key} {mode}: failed\n{out.stderr[-2000:]}", file=sys.stderr)
                    continue
                row = json.loads(out.stdout.strip().splitlines()[-1])
                row["target_s"] = CASES[key][4]
                ref = CASES[key][6]
                row["autoparallel_s"] = f"{ref[0]:.0f}-{ref[1]:.0f}" if ref else "-"
                total = row["total_s"]
                row["faster_x"] = f"{ref[0] / total:.1f}-{ref[1] / total:.1f}" if ref else "-"
                row["ok"] = _targets(key, row)
                rows.append(row)
                if args.json:
                    print(json.dumps(row))
    if args.json:
        return
    cols = ("model", "layers", "mode", "trace_s", "strategies_s", "ilp_build_s", "solve_s", "baselines_s",
            "total_s", "cpu_s", "target_s", "autoparallel_s", "faster_x", "variables", "columns_solved",
            "constraints", "status", "step_s", "bound_s", "gap", "start", "peak_rss_gib", "ok")
    print(" ".join(f"{c:>12}" for c in cols))
    for r in rows:
        print(" ".join(f"{r[c]:>12.4f}" if isinstance(r[c], float) else f"{r[c]!s:>12}" for c in cols))


if __name__ == "__main__":
    main()
