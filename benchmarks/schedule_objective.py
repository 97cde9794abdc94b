"""The ILP's objective against the step schedule of the plan it chooses (issue 15, item 2).

Each case runs ``shardwise plan --json`` as a subprocess (tracing, the hand plans and the auto
solve included) and reports, for the auto plan: the ILP's objective (``plan/objective.py``, the
schedule linearised), the step schedule's estimate of the same plan (what ``shardwise estimate``
prints) and their ratio (target: within 1%), and whether the auto plan's step is at most every
applicable hand plan's by the schedule. The Hugging Face configs (tests/data) are
``benchmarks/hf_families.py``'s, which prints the same ratio.

    .venv/bin/python benchmarks/schedule_objective.py [--json] [--cases llama3-8b:2,llama3-8b:32]
        [--time-limit 60]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from rows import print_rows

# name -> (model, layers, mesh, batch, seq): the everyday workload of DESIGN.md.
CASES = {
    "llama3-8b:2": ("llama3-8b", 2, "8x8", 16, 8192),
    "llama3-8b:32": ("llama3-8b", 32, "8x8", 16, 8192),
}
TARGET_RATIO_TOL = 0.01
# Relative slack when comparing step times (the sums are rounded differently).
TIE = 1e-9


def measure(key: str, time_limit_s: float) -> dict:
    model, layers, mesh, batch, seq = CASES[key]
    argv = [sys.executable, "-m", "shardwise", "plan", "--model", model, "--layers", str(layers),
            "--mesh", mesh, "--mesh-names", "dp,tp", "--batch", str(batch), "--seq", str(seq),
            "--time-limit", str(time_limit_s), "--json"]
    t0 = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        return {"case": key, "status": "error: " + proc.stderr.strip().splitlines()[-1][:80]}
    out = json.loads(proc.stdout)
    auto = out["plans"]["auto"]
    hand = {k: v for k, v in out["baselines"].items() if v is not None}
    best = min(hand, key=hand.get) if hand else None
    ratio = auto["objective_s"] / auto["step_s"]
    return {
        "case": key, "mesh": mesh, "status": out["status"], "chosen": out["chosen_from"],
        "objective_ms": auto["objective_s"] * 1e3, "step_ms": auto["step_s"] * 1e3, "ratio": ratio,
        "within_1pct": abs(ratio - 1.0) <= TARGET_RATIO_TOL, "exposed_ms": auto["exposed_comm_s"] * 1e3,
        "best_hand": best or "-", "best_hand_ms": hand[best] * 1e3 if best else float("nan"),
        "auto_le_hand": best is None or auto["step_s"] <= hand[best] * (1 + TIE), "gap": out["mip_gap"],
        "wall_s": wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--time-limit", type=float, default=60.0, help="each solve's time limit, seconds")
    args = ap.parse_args()
    rows = [measure(key, args.time_limit) for key in args.cases.split(",")]
    if args.json:
        print(json.dumps({"rows": rows}))  # one object on stdout, as every --json
        return
    cols = ("case", "mesh", "status", "chosen", "objective_ms", "step_ms", "ratio", "within_1pct",
            "exposed_ms", "best_hand", "best_hand_ms", "auto_le_hand", "gap", "wall_s")
    print_rows(rows, cols)


if __name__ == "__main__":
    main()
