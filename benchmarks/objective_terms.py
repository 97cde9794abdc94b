"""Where the ILP's schedule objective and the step schedule part, block by block (issue 15, item 2).

For each hand plan (its choices fixed; no activation checkpointing) and ``auto`` (the ILP's
solution, no memory budget), the plan's objective
(``plan/objective.py``: per block max(compute + exposed, hidden + exposed), plus the optimizer)
beside the step schedule's estimate of the same plan (``cost/step.price_plan``, what
``shardwise estimate`` prints), then per block the ILP's loads at the plan's point and what the
schedule ran in that block: its compute, its span on the compute stream, and the
collectives of the block on each stream.

    .venv/bin/python benchmarks/objective_terms.py [--model llama3-8b] [--layers 2] [--mesh 8x8]
        [--batch 16] [--seq 8192] [--plans auto,ddp,fsdp,fsdp_tp,fsdp_tp_sp] [--blocks]
"""

from __future__ import annotations

import argparse
import math
from collections import defaultdict

from rows import print_rows

import shardwise.plan.objective as objective_module
from shardwise.cost.schedule import COMPUTE_STREAM
from shardwise.cost.step import price_plan
from shardwise.ir.trace import trace_model
from shardwise.mesh import Mesh
from shardwise.passes.pipeline import canonicalize
from shardwise.passes.remat import ACPolicy
from shardwise.plan import BASELINES
from shardwise.plan.objective import Load, ScheduleObjective
from shardwise.plan.planner import make_plan

MS = 1e3


class _Recorded(ScheduleObjective):
    """The planner's objective, keeping the point it priced (make_plan builds its own)."""

    last: _Recorded | None = None

    def _exact(self, m, got):
        got = super()._exact(m, got)
        self.point = got.solution
        _Recorded.last = self
        return got


def block_rows(obj: ScheduleObjective, sched) -> list[dict]:
    val = obj.point
    ran: dict[tuple[str, int], dict[str, float]] = defaultdict(lambda: defaultdict(float))
    spans: dict[tuple[str, int], list[float]] = defaultdict(lambda: [math.inf, 0.0])
    for e in sched.events:
        b = (e.phase, e.region)
        ran[b][e.stream] += e.dur
        if e.stream == COMPUTE_STREAM:
            spans[b][0] = min(spans[b][0], e.start)
            spans[b][1] = max(spans[b][1], e.end)
    rows = []
    for b, loads in obj.terms.items():
        load = {k: sum(t * float(val[c]) for c, t in loads.get(k, {}).items())
                for k in (Load.COMPUTE, Load.EXPOSED, Load.HIDDEN)}
        members = [(p.value, r) for p, r in obj.members.get(b, [b])]
        streams = sorted({s for m in members for s in ran[m]} - {COMPUTE_STREAM})
        rows.append({
            "block": f"{b[0].value[:3]}:{b[1] if b[1] < 1 << 20 else 'tail'}x{len(members)}",
            "ilp_comp_ms": load[Load.COMPUTE] * MS, "ilp_exp_ms": load[Load.EXPOSED] * MS,
            "ilp_hid_ms": load[Load.HIDDEN] * MS,
            "ilp_T_ms": (load[Load.EXPOSED] + max(load[Load.COMPUTE], load[Load.HIDDEN])) * MS,
            "sch_comp_ms": sum(ran[m][COMPUTE_STREAM] for m in members) * MS,
            "sch_span_ms": sum(max(0.0, spans[m][1] - spans[m][0]) for m in members) * MS,
            **{f"sch_{s.split(':')[-1]}_ms": sum(ran[m][s] for m in members) * MS for s in streams},
        })
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--mesh", default="8x8")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--plans", default=",".join((*BASELINES, "auto")))
    ap.add_argument("--blocks", action="store_true", help="print each plan's per-block table")
    args = ap.parse_args()
    shape = tuple(int(x) for x in args.mesh.split("x"))
    mesh = Mesh(shape, ("dp", "tp")[:len(shape)])
    traced = trace_model(args.model, train=True, layers=args.layers, batch=args.batch, seq=args.seq)
    canonicalize(traced)
    opts = {"ac": ACPolicy.NONE}
    objective_module.ScheduleObjective = _Recorded  # make_plan imports it when it runs
    rows, blocks = [], {}
    for name in args.plans.split(","):
        _Recorded.last = None
        p = make_plan(traced, mesh, baseline=None if name == "auto" else name,
                      memory_budget=math.inf, step_options=opts)
        if p is None or _Recorded.last is None:
            rows.append({"plan": name, "ratio": "n/a"})
            continue
        est = price_plan(traced, p, mesh, opts)
        obj = p.info["objective_s"]
        rows.append({"plan": name, "objective_ms": obj * MS, "step_ms": est.step_s * MS,
                     "ratio": obj / est.step_s, "compute_ms": est.compute_s * MS,
                     "exposed_ms": est.exposed_comm_s * MS, "comm_ms": est.comm_s * MS})
        blocks[name] = block_rows(_Recorded.last, est.schedule)
    print_rows(rows, ("plan", "objective_ms", "step_ms", "ratio", "compute_ms", "exposed_ms", "comm_ms"))
    if args.blocks:
        for name, br in blocks.items():
            print(f"\n{name}")
            cols = list(dict.fromkeys(k for r in br for k in r))
            print_rows(br, tuple(cols))


if __name__ == "__main__":
    main()
