"""Planning Hugging Face families against the hand-written plans (issue 15, items 1 and 5).

Each case runs ``shardwise plan --json`` on a config written by hand from the family's published
hyper-parameters (tests/data), as a subprocess timed from outside (tracing, the four baselines
and the auto solve included). Targets: no fallback ops, the auto plan's step time <= the best
applicable hand plan's, in <= 60 s wall on a 2-core machine.

    .venv/bin/python benchmarks/hf_families.py [--json] [--cases phi3:2,qwen2-7b:28,...] [--time-limit 30]

Stop 27, a 2-core machine: every case's auto plan <= its best hand plan, no fallback ops, in
7.9-32.2 s. Qwen2-7B (28 layers over 8x8): 2548.9 ms, gap 5.7%, 50.5 s before moves went one
mesh dim at a time where cheaper (``cost/reshard.reshard_path``: its MLP weights' gradients,
partial over dp and tp, were all-reduced over dp whole, then reduce-scattered over tp, and the
tp collectives behind them waited); 1892.5 ms, optimal, 25.3 s after (fsdp_tp 2573.4 -> 2472.6);
1898.4 ms, optimal, 24.2 s with ``objective.RECOMPUTE_TIE``.
Stop 28 (a gather's later collective on the inner mesh dim charged exposed,
``PlannerCosts.move_shares``): every case optimal, <= its best hand plan, 9.2-30.1 s; phi3 2
layers 44.336 ms (44.122 before), 32 layers 499.448 (499.548), Qwen2-7B 1891.4 (1898.4), gemma
664.978 (664.934), gpt2 23.419 (23.488); objective / step 0.995-1.007 but Qwen2's 0.950.
Stop 38 (the last layer's parameter ends planned apart, ``plan/cluster.py``): every case optimal,
<= its best hand plan, no fallback ops, 8.5-25.0 s; phi3 2 layers 44.336 ms, 32 layers 499.698
(499.837 with them tied to their cluster), Qwen2-7B 1927.1 (1955.7), gemma 664.964 (664.939),
gpt2 23.419.
Stop 39 (the fsdp_tp baselines gather a column-parallel weight's tp shard over dp, as FSDP2
does, not the whole weight): the same auto plans; Qwen2-7B's best hand plan is fsdp_tp_sp at
1968.9 ms (fsdp_tp 2472.6 before), so auto's 1927.1 ms is 2.1% under it, not 22%.
Stop 44 (Gemma-2-2B added: transformers has no SDPA path for its soft-capped attention, so it
traces its eager attention, matmuls and a softmax, whose [b, h, s, s] scores make activation
checkpointing necessary at seq 4096): no fallback ops, auto 1686.1 ms against ddp's 1892.2
(-10.9%), gap 0.4%, but 73.9 s on a quiet machine (112.4 s beside a test run; its layers
alternate sliding and full attention, so the whole model is traced, 8.1 s, and its ILP has
152,566 columns). The others, the same hour:
phi3 2 layers 44.000 ms in 34.7 s, 32 layers 497.194 in 33.9 s, Qwen2-7B 1890.3 (optimal) in
31.5 s, gemma 663.315 in 21.8 s, gpt2 23.419 in 10.0 s; every auto plan <= its best hand plan.
Stop 45 (the tensor-parallel hand plans find each family's projections by its own module names,
the split dim read off the graph, and shard LayerNorm outputs on the sequence): Pythia-1.4B (24
layers) and Bloom-560m (24 layers) added, both optimal, no fallback ops, auto <= every hand plan:
pythia 378.683 ms (fsdp 379.248) in 36.3 s, bloom 205.712 ms (fsdp 208.304) in 17.0 s. Their
fsdp_tp and fsdp_tp_sp had run no tensor parallelism at all (Bloom's 208.436 ms both, the same
as FSDP over the mesh); now Megatron's layout, 238.4 and 239.6 ms (Pythia: 406.2 and 409.5): at
these widths 4-way tensor parallelism costs more than it saves. gpt2 23.419 ms in 9.7 s.
Stop 47 (the schedule queues a forward block's prefetched gathers behind the block before it, as
FSDP2 issues them): every auto plan <= its best hand plan, no fallback ops; phi3 2 layers 43.408
ms (44.000), 32 layers 496.521 (497.194), Qwen2-7B 1868.078 (1890.272), gemma 663.315, Gemma-2
1686.142 in 77.1 s (two interior-point LPs of 22 s: its first plan's schedule peak, 81 GiB, is
17.7 GiB over its memory row, so the budget fit solves again; at the plan returned, the peak
is in the loss's backward, with two gradients of the 256k-vocabulary logits, 3.9 GiB each, and
the gathered embedding, 2.5 GiB, beyond the row), gpt2 23.290 (23.419), pythia 378.282
(378.683), bloom 205.587 (205.712); the others in 11.8-40.1 s. With the MIP no longer handed its
start (``solver._run_mip``): the same, but phi3 2 layers 43.383 ms and gemma 663.249, the others
in 9.9-33.1 s, Gemma-2 75.9 s.
Stop 48 (the budget fit solves the same ILP again, its interior-point LP kept,
``PreparedPlan.finish_again``): the same plans; Gemma-2 73.95 s on main against 72.10 s, back to
back: its second 22-s LP is gone, but the first LP's duals bound the tighter budget at 1.6421 s
(a new LP's: 1.6824 s), its MIP then runs to the stall guard (25 s), and the fit's bisection
solves a third time; the others in 12.9-42.0 s.
Stop 49 (gradient clipping priced; ``h100``'s ``attention_eff`` 0.25 for bf16/fp16 flash
attention, measured on a lent H100; these configs trace in fp32, so only clipping moves them):
every auto plan <= its best hand plan, no fallback ops; phi3 2 layers 43.428 ms (44.490), 32
layers 498.522 (499.626), Qwen2-7B 1907.139 (1967.949), gemma 664.475 (666.142), Gemma-2
1687.444 (gap 0.4%, 75.6 s), gpt2 23.372 (24.073), pythia 378.988 (379.952), bloom 205.866
(208.582); the others in 11.3-37.4 s. (Before attention's rate was limited to half precision,
it doubled Qwen2-7B's fp32 attention on no evidence: 3842.424 ms.)
Stop 50 (moves as shortest paths of one-mesh-dim hops; flow edges in the ILP): every auto plan <=
its best hand plan, no fallback ops; Qwen2-7B 1907.139 -> 1833.441 ms (37.4 -> 25.5 s); phi3 2
layers 43.428 (22.1 s), 32 layers 498.423 (32.2 s), gemma 664.555 (21.8 s), gpt2 23.372 (10.4 s),
pythia 378.988, bloom 205.866; Gemma-2 1687.444 (gap 0.3%, 74.1 s). With ``solver.restrict_flows``
after (the machine slower by then): Qwen2-7B 1838.967 ms (29.0 s), the others the same plans in
11.8-37.4 s, Gemma-2 81.9 s.
Stop 53 (the LP first without the memory row, moves priced on codes, the heap frozen while
planning): every auto plan <= its best hand plan, no fallback ops, 10.2-27.5 s (Qwen2-7B 18.4 s,
19.7 s with stop 52's main the same hour), Gemma-2 75.7 s. Qwen2-7B 1844.828 ms against 1838.967:
the same ILP optimum (1798.249 ms), another of its tied plans, reached from the other interior
point of the LP without the memory row (with the whole LP forced: 1838.967 again).
Stop 56: every auto plan the same and <= its best hand plan, no fallback ops, 8.5-20.4 s; Gemma-2
62.2 s, gap 0.3% -> 0.1%. Its budget fit's re-solve needs the whole LP (the first one's point,
without the memory row, breaks the tighter budget), which got only what was left of the first
LP's time, 6.4 of 27 s: it stopped, and the MIP over all 108,670 columns ran to its stall guard.
It now gets the re-solve's own time (13.7 s to the optimum). With ``--gap 0.01`` (in-process
timeline, the same hour): 61.8 s and a 1.912-s plan (selective AC on every layer, the MIP's) ->
47.5 s and 1.679 s (none x 22, selective x 4).
Stop 57 (a gather chained over both mesh dims hidden at its larger stream's part,
``PlannerCosts.move_shares``; hand plans whose free choices the serial objective made priced by
the auto ILP's): every auto plan <= its best hand plan, no fallback ops, 10.8-24.1 s, Gemma-2
65.1 s (stop 56's code took 72.9 s by the CLI at this session's start: the machine was slower
than at stop 56).
Faster plans: phi3 2 layers 43.428 -> 43.397 ms, Qwen2-7B 1844.828 -> 1838.967, gemma 664.618 ->
658.662, Gemma-2 1687.444 -> 1681.168; the same: phi3 32 layers 498.423, gpt2 23.373 (23.372);
slower: pythia 378.988 -> 379.048, bloom 205.866 -> 206.292 (one large chain's fill, unpriced:
``plan/objective.py``).

Stop 58 (a decoder layer's gradient reductions through both dims of a one-node mesh priced at
their larger stream's part, ``ScheduleObjective.pipelined_reduction``; the 2x4 cases only, the
8x8 model is unchanged): the same plans but bloom 206.292 -> 206.256 and gemma 658.662 ->
658.643 ms; 9.5-29.8 s, Gemma-2 69.6 s. Alternated with the code before it, the same hour: bloom
16.4 -> 17.9 s (38,495 -> 38,834 columns), phi3 32 layers 28.2 -> 28.8 s.

Stop 59 (a move into a Partial dim priced along the path the lowering runs, ``cost/reshard.py``;
a getitem or follower whose representative's producer is represented otherwise keeps its own
variables, ``plan/cluster.py``; no integer or boolean tensor pending a sum,
``plan/strategies.py``). The final code: every auto plan <= its best hand plan, no fallback ops,
7.0-18.8 s, Gemma-2 54.8 s (66.8 s before the last change); the same plans but gemma 658.643 ->
658.662 ms and Gemma-2 1681.168 -> 1681.140 ms; Qwen2-7B 1838.967 ms as before. Columns, a run
with the first change alone -> the final code: phi3 2 layers 65,611 -> 64,997, 32 layers
95,441 -> 94,827, Qwen2-7B 74,279 -> 74,004, gemma 82,295 -> 81,928, Gemma-2 108,566 ->
107,585, gpt2 39,307 -> 40,330, pythia 80,076 -> 85,209 and bloom 38,786 -> 41,785 (their
getitems of a LayerNorm backward keep their own variables). Bloom's plan was 206.292 ms between
the second change and the third, 206.256 ms before and after.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from rows import print_rows

DATA = Path(__file__).resolve().parent.parent / "tests" / "data"
# name -> (config, layers, mesh, batch, seq). Phi-3 and Qwen2-7B are the cases of issue 15.
CASES = {
    "phi3:2": ("phi3.json", 2, "2x4", 8, 1024),
    "phi3:32": ("phi3.json", 32, "2x4", 8, 1024),
    "qwen2-7b:28": ("qwen2_7b.json", 28, "8x8", 16, 4096),
    "gemma-2b:18": ("gemma_2b.json", 18, "2x4", 8, 2048),
    "gemma2-2b:26": ("gemma2_2b.json", 26, "2x4", 8, 4096),
    "gpt2:12": ("gpt2.json", 12, "2x4", 8, 1024),
    "pythia-1.4b:24": ("pythia_1b4.json", 24, "2x4", 8, 2048),
    "bloom-560m:24": ("bloom_560m.json", 24, "2x4", 8, 2048),
}
TARGET_WALL_S = 60.0
# Relative slack when comparing step times (the sums are rounded differently).
TIE = 1e-9


def measure(key: str, time_limit_s: float) -> dict:
    config, layers, mesh, batch, seq = CASES[key]
    argv = [sys.executable, "-m", "shardwise", "plan", "--model", f"hf:{DATA / config}",
            "--layers", str(layers), "--mesh", mesh, "--mesh-names", "dp,tp", "--batch", str(batch),
            "--seq", str(seq), "--time-limit", str(time_limit_s), "--json"]
    t0 = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        return {"case": key, "status": "error: " + proc.stderr.strip().splitlines()[-1][:80]}
    out = json.loads(proc.stdout)
    hand = {k: v for k, v in out["baselines"].items() if v is not None}
    best = min(hand, key=hand.get) if hand else None
    auto = out["step_s"]  # the step schedule, as the baselines are priced
    return {
        "case": key, "mesh": mesh, "status": out["status"], "auto_ms": auto * 1e3,
        # the ILP's objective (the schedule linearised, plan/objective.py) over the schedule's step
        "obj_ratio": out["plans"]["auto"]["objective_s"] / auto,
        "best_hand": best or "-", "best_hand_ms": hand[best] * 1e3 if best else float("nan"),
        "auto_le_hand": best is None or auto <= hand[best] * (1 + TIE), "gap": out["mip_gap"],
        "start": out["started_from"] or "-", "fallback_ops": len(out["fallback_ops"]),
        "variables": out["ilp"]["variables"], "wall_s": wall, "target_s": TARGET_WALL_S,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--time-limit", type=float, default=30.0,
                    help="the auto solve's (and each baseline's) time limit")
    args = ap.parse_args()
    rows = [measure(key, args.time_limit) for key in args.cases.split(",")]
    if args.json:
        print(json.dumps({"rows": rows}))  # one object on stdout, as every --json
        return
    cols = ("case", "mesh", "status", "auto_ms", "obj_ratio", "best_hand", "best_hand_ms", "auto_le_hand",
            "gap", "start", "fallback_ops", "variables", "wall_s", "target_s")
    print_rows(rows, cols)


if __name__ == "__main__":
    main()
