"""Does the planner, choosing activation checkpointing itself, match torchtitan's hand plans?

    .venv/bin/python benchmarks/ac_plan.py [--rows 8b-8,8b-64,70b-256] [--time-limit 60]

Issue 15's acceptance line: the torchtitan configurations of issue 10 (``benchmarks/fidelity.py``:
Llama 3.1 8B on 8 GPUs FSDP local batch 2, eager and compiled; 8B on 64 GPUs FSDP 8 x TP 8 local
batch 12, compiled, with and without async TP; 70B on 256 GPUs FSDP 32 x TP 8 local batch 16,
compiled, with and without async TP; sequence 8192, bf16) on their 96 GB H100 (``h100-96gb``):
the auto plan fits, with activation checkpointing chosen by the ILP (``plan/checkpointing.py``),
and is estimated at least as fast as the faithful hand plan.

Each row prints

- the faithful hand plan as torchtitan runs it (``fsdp`` or ``fsdp_tp_sp``, its AC: selective for
  8B, full for 70B), priced as ``benchmarks/fidelity.py`` prices it: tokens/s per GPU, peak
  memory (the caching allocator's reserved peak), whether it fits 96 GB;
- the auto plan (``shardwise plan`` without ``--ac``: the planner decides the AC per cluster of
  identical layers; the hand plans it compares with run the first of none/selective/full that
  fits), priced by the same step schedule: tokens/s, memory, fits, the AC chosen;
- auto / hand tokens/s, and the wall time of planning (tracing excluded).

``--size`` prints instead what the AC decision adds to the ILP: variables, rows, build and solve
time of one solve of the auto plan (no baselines, no start) without it (``--ac none``: no
checkpointing columns) and with it (decided), with the budget lifted (without checkpointing
nothing fits), and decided within the default budget.

Every model is traced at its full depth (the AC choice names every layer), unlike
``fidelity.py``'s 70B rows, which extrapolate from 3 and 5 layers.

Measured (acdecide branch, a loaded 2-core machine, ``--time-limit 60``): every auto plan fits
96 GB with a mixed AC chosen by the ILP, auto / hand 1.008 (8B 8 GPU eager: none x 2, selective
x 30), 1.036 (compiled: none x 16, selective x 15, full x 1), 1.462 and 1.239 (8B 64 GPU, without
and with async TP: none x 27, selective x 4, full x 1), 1.355 and 1.175 (70B 256 GPU: selective
x 5, full x 75); planning 15-19 s (8B 8 GPU), 174-177 s (8B 64 GPU), 386-424 s (70B 256 GPU),
each the baselines' three policies, the auto solve and up to four re-solves of its budget.

Stop 27 (moves one mesh dim at a time where cheaper, ``cost/reshard.reshard_path``; a quiet
2-core machine): every row fits and is >= its hand plan; 8B 64 GPU 1.429 and 1.208 (the hand
plan 4,353 tokens/s, 4,291 before; the auto plan 6,222, 6,444 before: its plans hold more of
the allocator's cache by the schedule, and the budget fit ran out of rounds at 91.3 GiB and
handed back the hand plan until it also stepped along the line through its last two peaks),
70B 256 GPU 1.364 and 1.182 (selective x 12, full x 68); planning 7.5-8.3 s, 86 s, 168-172 s.
Stop 28 (a gather's later collective on the inner mesh dim charged exposed,
``PlannerCosts.move_shares``; ``--rows 8b-64``): 1.397 and 1.179, the auto plan 6,080 tokens/s
(none x 7, selective x 24, full x 1; 85.6 GiB) against 6,215 and 6,222 (none x 3, selective x
29; 83.2 GiB) on the tree before, measured the same hour.
Stop 39 (the fsdp_tp_sp hand plan gathers a column-parallel weight's tp shard over dp, as FSDP2's
strided shard does, not the whole weight; a quiet 2-core machine): every row fits and is >= its
hand plan; auto / hand 1.000, 1.036, 1.312 and 1.101 (8B 64 GPU: the hand plan 4,487.0 and
5,354.9 tokens/s, the auto plan 5,887.4 and 5,893.4), 1.302 and 1.120 (70B 256 GPU: the hand plan
609.5 and 708.0, the auto plan 793.3); planning 9.5 s, 81-82 s, 145-147 s.
Stop 48 (the budget fit solves the same ILP again with the memory row's new bound, its
interior-point LP kept: ``PreparedPlan.finish_again``; a quiet 2-core machine, ``--rows 8b-64``
before and after the same hour): planning 80.6 -> 37.6 s and 83.1 -> 47.3 s, the auto plan 5,968.1
-> 5,991.5 tokens/s (auto / hand 1.326 -> 1.331). The whole table after: every row fits and is >=
its hand plan; auto / hand 1.009, 1.036, 1.331, 1.116, 1.300, 1.118; planning 10.5-10.6 s, 40-52
s, 140-145 s (before, with other work on the machine: 10.8-13.2 s, 78-88 s, 159-163 s).
Stop 49 (gradient clipping priced in the step's tail, ``cost/schedule.optimizer_bytes``;
``h100-96gb`` has no ``attention_eff``, so attention is priced as before): the same AC choices;
auto / hand 1.009, 1.036, 1.331, 1.116, 1.300, 1.118; planning 11.2, 10.9, 37.0, 39.6, 142.9 and
129.5 s.
Stop 50 (moves as shortest paths of one-mesh-dim hops; flow edges in the ILP): every row fits and
is >= its hand plan; auto / hand 1.009, 1.036, 1.391, 1.166, 1.306, 1.123 (8B 64 GPU: 6,259.5 and
6,266.3 tokens/s); planning 11.1, 10.1, 50.6, 50.4, 149.8, 137.3 s (with ``solver.restrict_flows``
after: 8B 64 GPU 1.388 and 1.164, 52.2 and 45.2 s; 70B 1.306 and 1.123, 159.4 and 152.0 s). The
8B 64-GPU rows plan
longer: the budget fit solves five times in both versions (at other budgets), and its MIPs take
longer with flow columns: the neighbourhood MIPs 0.55-0.69 s before, 0.69-3.16 s after, the last
ones 0.25-1.06 s before, 0.6-2.7 s after (one run of the first row each, debug log).
Stop 51 (the other plans of each solve priced by the schedule; a compiled step's segmentation
computed once per graph, ``Traced.analysis``): every row fits and is >= its hand plan; auto / hand
1.009, 1.036, 1.400, 1.173, 1.306, 1.123 (8B 64 GPU: 6,300.0 and 6,306.9 tokens/s); planning 15.2,
4.8, 66.1, 55.6, 49.2, 50.1 s (the 8B rows beside the test suite). The 70B rows priced each plan
by the compiled schedule in 9-15 s, 12 of them in the budget fit of one row, all but 0.2 s of
each the segmentation pass (``passes/segment/merge.py``, whose acyclicity checks grow with the
square of the layers: 0.09 s at 10 layers, 0.50 s at 20, 7.9 s at 80); once per graph, a later
plan is priced in 1.75 s. With the alternatives but not yet the cached segmentation they had
planned in 196.9 and 205.7 s. The checks since search the successors nearest the consumer
first: 80 layers segmented in 5.0 s, the same segments.

Stop 52 (shared edges as flows paying each hop once, moves from the copy cheapest to move, the
pay-once rows one fewer per group; ``benchmarks/plan.py``): every row fits and is >= its hand plan;
auto / hand 1.009, 1.036, 1.389, 1.164, 1.304, 1.122; planning 15.1, 5.1, 42.1, 40.3, 55.1, 61.1 s.
The 8B 64 GPU rows' auto plans are 0.8% slower than stop 51's (6,252.2 against 6,300.0 tokens/s):
6,273.6 with the flows alone (d802f12) and with the copies (868ebde), 6,252.2 since the pay-once
rows, an LP of the same optimum whose interior point takes another path, so its rounding and the
budget fit's re-solves land on other plans.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

from fidelity import C8, C64, C256, SEQ, Config
from rich.console import Console
from rich.table import Table

from shardwise.cost.hardware import get_hardware
from shardwise.cost.step import estimate_prepared, plan_for, price_plan, regions_layers, tokens_per_step
from shardwise.ir.trace import trace_model
from shardwise.mesh import parse_mesh
from shardwise.passes.pipeline import canonicalize
from shardwise.passes.remat import ACPolicy
from shardwise.plan.planner import plan_with_baselines

HARDWARE = "h100-96gb"
GIB = 2**30
TABLE_WIDTH = 190
NO_BUDGET = 2.0**60  # bytes: a memory row nothing reaches


@dataclass(frozen=True)
class Row:
    label: str
    config: Config
    ac: ACPolicy  # torchtitan's
    compile: bool
    async_tp: bool


GROUPS = {
    "8b-8": [Row("8B 8 GPU FSDP lb2 eager", C8, ACPolicy.SELECTIVE, False, False),
             Row("8B 8 GPU FSDP lb2 compiled", C8, ACPolicy.SELECTIVE, True, False)],
    "8b-64": [Row("8B 64 GPU FSDP8xTP8 lb12 compiled", C64, ACPolicy.SELECTIVE, True, False),
              Row("8B 64 GPU FSDP8xTP8 lb12 compiled async TP", C64, ACPolicy.SELECTIVE, True, True)],
    "70b-256": [Row("70B 256 GPU FSDP32xTP8 lb16 compiled", C256, ACPolicy.FULL, True, False),
                Row("70B 256 GPU FSDP32xTP8 lb16 compiled async TP", C256, ACPolicy.FULL, True, True)],
}


def measure(row: Row, traced, mesh, time_limit_s: float) -> dict:
    cfg = row.config
    hw = get_hardware(HARDWARE)
    opts = {"compile": row.compile, "async_tp": row.async_tp}
    hand = plan_for(traced, mesh, cfg.plan)
    h = estimate_prepared([(traced, hand)], cfg.layers, tokens_per_step(traced), mesh, hw,
                          {**opts, "ac": row.ac})
    t0 = time.perf_counter()
    auto, _ = plan_with_baselines(traced, mesh, step_options=opts, time_limit_s=time_limit_s)
    plan_s = time.perf_counter() - t0
    a = price_plan(traced, auto, mesh, opts)
    return {"hand": h, "auto": a, "plan": auto, "plan_s": plan_s}


def size(group: str, time_limit_s: float) -> list[dict]:
    """One auto solve without and with the AC decision (see the module docstring)."""
    from shardwise.plan import make_plan

    row = GROUPS[group][0]
    cfg = row.config
    mesh = parse_mesh(cfg.mesh, cfg.names, HARDWARE)
    traced = trace_model(cfg.model, layers=cfg.layers, batch=cfg.batch, seq=SEQ, dtype="bf16")
    canonicalize(traced)
    out = []
    # Without checkpointing these configurations fit no budget: the first two rows lift it.
    for label, ac, budget in (("no AC columns", ACPolicy.NONE, NO_BUDGET), ("AC decided", None, NO_BUDGET),
                              ("AC decided, 96 GB", None, None)):
        so = {"compile": row.compile, "async_tp": row.async_tp, "ac": ac}
        plan = make_plan(traced, mesh, time_limit_s=time_limit_s, step_options=so, memory_budget=budget)
        ilp, tm = plan.info["ilp"], plan.info["timings"]
        out.append({"config": group, "ILP": label, "variables": ilp["variables"], "rows": ilp["constraints"],
                    "build_s": round(tm["ilp_build_s"], 2), "solve_s": round(tm["solve_s"], 2),
                    "status": plan.status, "AC": plan.ac.describe() if plan.ac else "none"})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default=",".join(GROUPS), help="comma-separated: " + ", ".join(GROUPS))
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--size", action="store_true", help="print what the AC decision adds to the ILP")
    args = ap.parse_args()
    con = Console(width=TABLE_WIDTH)
    if args.size:
        from rows import print_rows

        rows = [r for g in args.rows.split(",") for r in size(g, args.time_limit)]
        print_rows(rows, ("config", "ILP", "variables", "rows", "build_s", "solve_s", "status", "AC"))
        return
    t = Table(title=f"auto plans with activation checkpointing chosen vs torchtitan's hand plans "
                    f"({HARDWARE}, tokens/s per GPU by the step schedule)")
    for col in ("configuration", "hand plan (AC)", "hand tok/s", "hand GiB", "hand fits",
                "auto AC (chosen from)", "auto tok/s", "auto GiB", "auto fits", "auto / hand", "plan s",
                ">= hand and fits"):
        t.add_column(col)
    for group in args.rows.split(","):
        rows = GROUPS[group]
        cfg = rows[0].config
        mesh = parse_mesh(cfg.mesh, cfg.names, HARDWARE)
        traced = trace_model(cfg.model, layers=cfg.layers, batch=cfg.batch, seq=SEQ, dtype="bf16")
        canonicalize(traced)
        assert len(regions_layers(traced)) == cfg.layers
        for row in rows:
            r = measure(row, traced, mesh, args.time_limit)
            h, a, plan = r["hand"], r["auto"], r["plan"]
            ratio = a.tokens_per_s_per_device / h.tokens_per_s_per_device
            ok = a.fits and ratio >= 1.0 - 1e-9
            t.add_row(row.label, f"{cfg.plan} ({row.ac.value})", f"{h.tokens_per_s_per_device:,.1f}",
                      f"{h.memory_per_device_bytes / GIB:.1f}", "yes" if h.fits else "no",
                      f"{a.ac} ({plan.info.get('chosen_from', 'ilp')})", f"{a.tokens_per_s_per_device:,.1f}",
                      f"{a.memory_per_device_bytes / GIB:.1f}", "yes" if a.fits else "no", f"{ratio:.3f}",
                      f"{r['plan_s']:.1f}", "yes" if ok else "[red]NO[/]")
            con.print(f"{row.label}: done ({r['plan_s']:.1f} s)")
    con.print(t)


if __name__ == "__main__":
    main()
