"""``shardwise plan``: the auto plan for a model on a mesh, with the hand-written baselines.

    shardwise plan --model llama3-8b --mesh 8x8 [--mesh-names dp,tp] [--hardware h100]
        [--memory 80GiB] [--optimizer adam] [--batch B --seq S] [--inference] [--time-limit S]
        [--ac none|selective|full] [--compile] [--async-tp]
        [--save plan.json] [--save-all DIR] [--json] [--constrain NAME=PLACEMENTS ...]
        [--explain PARAM_OR_NODE ...]

A training step's auto plan and every hand plan are priced by the step schedule, as
``shardwise estimate`` prices them with the same ``--ac``/``--compile``/``--async-tp`` (async TP
where a plan is tensor-parallel), and the auto plan is the fastest by it of the ILP's solution
and the hand plans that fit: ``shardwise estimate --plan`` of a plan saved here gives the step
time printed here.
"""

from __future__ import annotations

import argparse
import fnmatch
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from shardwise.cli import (
    add_model_options,
    add_step_options,
    check_output_dir,
    check_output_file,
    step_options,
)
from shardwise.errors import UserError

# What makes a --constrain NAME a glob (fnmatch's wildcards).
GLOB_CHARS = "*?["


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="choose placements for every node by ILP; compare with hand plans")
    add_model_options(p)
    add_mesh_options(p)
    p.add_argument("--memory", default=None, help="memory budget per device, e.g. 80GiB (default: "
                   "the hardware's memory less a reserve)")
    p.add_argument("--optimizer", default="adam",
                   help="optimizer whose state counts in training memory: adam (default), adamw, "
                        "sgd-momentum or sgd")
    p.add_argument("--time-limit", type=float, default=180.0, help="solver time limit in seconds")
    p.add_argument("--gap", type=float, default=None,
                   help="stop at a plan within this relative gap of the solver's bound, e.g. 0.01 "
                        "(default: the optimum, within --time-limit)")
    p.add_argument("--save", default=None, help="write the plan as JSON to this path")
    p.add_argument("--save-all", default=None, metavar="DIR",
                   help="write the auto plan and every hand plan that applies as DIR/NAME.json")
    add_step_options(p)
    p.add_argument("--no-baselines", action="store_true",
                   help="skip planning the hand-written baselines (the solver then starts from nothing: "
                        "a time limit may leave no plan)")
    p.add_argument("--no-cluster", action="store_true", help="plan every layer separately")
    p.add_argument("--constrain", action="append", default=[], metavar="NAME=PLACEMENTS",
                   help="fix a parameter's, an input's or (inference) an output's placement, e.g. "
                        "output.weight=S(0),R or output:0=S(2),R; NAME may be a glob, e.g. "
                        "'layers.*.attention.wq.weight=S(0),R'; repeatable, later ones win")
    p.add_argument("--explain", action="append", default=[], metavar="PARAM_OR_NODE",
                   help="also show what each alternative placement of this parameter or node would "
                        "cost, the rest of the plan fixed; repeatable")
    p.set_defaults(handler=run)


def add_mesh_options(p: argparse.ArgumentParser, default: str = "8x8") -> None:
    p.add_argument("--mesh", default=default, help="mesh shape, e.g. 8x8 or 4")
    p.add_argument("--mesh-names", default=None, help="names of the mesh dims, e.g. dp,tp")
    p.add_argument("--hardware", default="h100", help="h100 | h200 | a100 | b200 | cpu | spec.toml")


def parse_constraints(items: list[str], traced, mesh_ndim: int):
    """``NAME=S(0),R`` pairs into planner Constraints: parameters by name, inputs by placeholder,
    outputs as ``output`` (the first) or ``output:K``. NAME may be a glob (``fnmatch``: ``*``,
    ``?``, ``[...]``) over those names, e.g. ``layers.*.attention.wq.weight``; a glob that
    matches nothing is an error, and a later item overrides an earlier one for the names both
    match (``'layers.*.weight=R' 'layers.0.*.weight=S(0)'``)."""
    from shardwise.plan import Constraints
    from shardwise.plan.placement import parse_placements

    params, inputs, outputs = {}, {}, {}
    for item in items:
        name, sep, rhs = item.partition("=")
        if not sep:
            raise UserError(f"constraint {item!r} is malformed; write NAME=PLACEMENTS, "
                            "e.g. output.weight=S(0),R.")
        ps = parse_placements(rhs.split(","))
        if len(ps) != mesh_ndim:
            raise UserError(f"constraint {item!r} gives {len(ps)} placements for a {mesh_ndim}-dim mesh.")
        for target in _constraint_targets(name, item, traced):
            if target in traced.inputs:
                inputs[target] = ps
            elif target == "output" or target.startswith("output:"):
                index = target.partition(":")[2] or "0"
                if not index.isdigit():
                    raise UserError(f"constraint {item!r} names no output; write output:K for the K-th "
                                    "(from 0).")
                outputs[int(index)] = ps
            else:
                params[target] = ps
    return Constraints(params, inputs, outputs)


def _constraint_targets(name: str, item: str, traced) -> list[str]:
    """The names ``name`` stands for: itself, or every parameter, input and (inference) output
    ``output:K`` its glob matches."""
    if not any(ch in name for ch in GLOB_CHARS):
        return [name]
    outputs = [] if traced.train else [f"output:{i}" for i in range(len(traced.outputs))]
    matched = fnmatch.filter([*traced.params, *traced.inputs, *outputs], name)
    if not matched:
        example = next(iter(traced.params), "")
        raise UserError(f"constraint {item!r}: the pattern {name!r} matches no parameter, input or output "
                        f"of {traced.model_name} (parameters are named like {example!r}).")
    return matched


def run(args: argparse.Namespace) -> dict:
    # Planning a big model takes a minute or more: show what it is doing (on a terminal only,
    # and never with --json, whose stdout is one object).
    with progress(enabled=not args.json and sys.stderr.isatty()) as say:
        traced, plan, mesh, out = _plan(args, say)
    if not args.json:
        _print_report(traced, plan, out, mesh)
    return out


def _plan(args: argparse.Namespace, say: Callable[[str], None]) -> tuple:
    """The auto plan, its baselines and explanations; (traced, plan, mesh, JSON summary)."""
    say(f"tracing {args.model}")
    from shardwise.cost.hardware import get_hardware
    from shardwise.cost.units import parse_bytes
    from shardwise.ir.trace import trace_model
    from shardwise.mesh import parse_mesh
    from shardwise.passes.pipeline import canonicalize
    from shardwise.plan.explain import explain
    from shardwise.plan.ilp import OPTIMIZER_STATE_BYTES, MemoryModel
    from shardwise.plan.planner import NO_PLAN, no_plan_reason, plan_with_baselines
    from shardwise.plan.report import plan_summary

    mesh = parse_mesh(args.mesh, args.mesh_names, args.hardware)
    get_hardware(args.hardware)  # fail early on an unknown spec
    if not args.time_limit > 0:
        raise UserError(f"--time-limit must be a positive number of seconds, got {args.time_limit:g}.")
    if args.gap is not None and not 0.0 <= args.gap < 1.0:
        raise UserError(f"--gap is a relative gap in [0, 1), e.g. 0.01 for 1%; got {args.gap:g}.")
    if args.optimizer not in OPTIMIZER_STATE_BYTES:
        raise UserError(f"unknown optimizer {args.optimizer!r}; known: {', '.join(OPTIMIZER_STATE_BYTES)}.")
    budget = parse_bytes(args.memory) if args.memory else None
    # The schedule's peak holds the same optimizer state as the ILP's memory row.
    opts = {**step_options(args, mesh.names), "optimizer_state_bytes": OPTIMIZER_STATE_BYTES[args.optimizer]}
    if args.inference and (args.ac not in (None, "none") or args.compile or args.async_tp):
        raise UserError("--ac, --compile and --async-tp price a training step; drop them with --inference.")
    _check_outputs(args)
    t0 = time.perf_counter()
    traced = trace_model(args.model, train=not args.inference, layers=args.layers, batch=args.batch,
                         seq=args.seq, dtype=args.dtype)
    canonicalize(traced)
    trace_s = time.perf_counter() - t0
    constraints = parse_constraints(args.constrain, traced, mesh.ndim)
    for name in args.explain:  # fail before the solve on a name the model does not have
        if name not in traced.params and name not in {n.name for n in traced.gm.graph.nodes}:
            raise UserError(f"--explain {name!r} is neither a parameter nor a node of the traced graph.")
    memory = MemoryModel(optimizer_state_bytes=OPTIMIZER_STATE_BYTES[args.optimizer])
    options = {"memory_budget": budget, "clustering": not args.no_cluster, "time_limit_s": args.time_limit,
               "memory": memory}
    if args.gap is not None:
        options["rel_gap"] = args.gap
    if args.no_baselines:
        plan, hand = plan_with_baselines(traced, mesh, baselines=(), constraints=constraints, on_phase=say,
                                         step_options=opts, **options)
    else:
        plan, hand = plan_with_baselines(traced, mesh, constraints=constraints, on_phase=say,
                                         step_options=opts, **options)
    if plan.status in NO_PLAN:
        raise UserError(no_plan_reason(plan))
    applied = {name: b for name, b in hand.items() if b is not None and b.status not in NO_PLAN}
    if args.save:
        try:
            plan.save(args.save)
        except OSError as e:
            raise UserError(f"--save {args.save!r}: cannot write the plan ({e.strerror}).") from None
    if args.save_all:
        _save_all(args.save_all, {"auto": plan, **applied})
    timings = plan.info["timings"]
    out = plan_summary(plan)
    out["plans"] = {"auto": plan_row(plan), **{name: plan_row(hand[name]) if name in applied else None
                                                for name in hand}}
    # The chosen plan's step and memory by the measure every plan is compared by (the schedule's
    # peak, not the node-by-node sum's parameters and activations, when training).
    out["step_s"] = out["plans"]["auto"]["step_s"]
    out["memory_per_device_bytes"] = out["plans"]["auto"]["memory_per_device_bytes"]
    # "ilp": the ILP's solution; a hand plan's name: it was faster by the schedule.
    out["chosen_from"] = plan.info.get("chosen_from", "ilp")
    if "ilp_solution" in plan.info:
        solution = plan.info["ilp_solution"]
        out["plans"]["ilp"] = {**schedule_row(solution, solution["objective_s"]),
                               "status": solution["status"], "mip_gap": solution["mip_gap"]}
    # Each hand plan's step time by the measure the auto plan is chosen by (the schedule when
    # training, the node-by-node sum otherwise).
    baselines = {name: row["step_s"] if row is not None else None
                 for name, row in out["plans"].items() if name in hand}
    out["timings"] = {"trace_s": trace_s, "strategies_s": timings["strategies_s"],
                      "ilp_build_s": timings["ilp_build_s"], "solve_s": timings["solve_s"],
                      "total_s": trace_s + timings["total_s"]}
    out["ilp"] = {k: plan.info["ilp"][k] for k in ("variables", "constraints", "clusters")}
    out["baselines"] = baselines
    # --ac fixes every layer's policy; without it the planner chose per cluster of layers.
    out["ac_given"] = args.ac is not None
    if args.explain:
        say("explaining " + ", ".join(args.explain))
        out["explain"] = {name: explain(traced, plan, name, memory=memory).to_json() for name in args.explain}
    return traced, plan, mesh, out


def plan_row(plan) -> dict:
    """What ``--json`` reports of one plan: its step by the schedule (and by what it is made of),
    its ILP objective, its memory by the schedule's peak (training); the node-by-node sum's
    figures (inference)."""
    sched = plan.info.get("schedule")
    if sched is None:  # inference: no schedule; the serial sum is the measure
        est = plan.estimate
        return {"step_s": est.total_s, "objective_s": plan.info.get("objective_s", est.total_s),
                "exposed_comm_s": est.comm_s, "comm_s": est.comm_s, "compute_s": est.compute_s,
                "recompute_s": 0.0, "memory_per_device_bytes": est.memory_bytes, "fits": True,
                "async_tp": False, "ac": "none"}
    return schedule_row(sched, plan.info.get("objective_s", plan.estimate.total_s))


def schedule_row(sched: dict, objective_s: float) -> dict:
    """A plan's figures from its schedule (``plan.info["schedule"]``) and its ILP objective."""
    b = sched["breakdown"]
    return {"step_s": sched["step_s"], "objective_s": objective_s,
            "exposed_comm_s": b["exposed_comm_s"], "comm_s": b["comm_s"], "compute_s": b["compute_s"],
            "recompute_s": b["recompute_s"], "memory_per_device_bytes": sched["memory_per_device_bytes"],
            "fits": sched["fits"], "async_tp": sched["options"]["async_tp"], "ac": sched["options"]["ac"]}


def _check_outputs(args: argparse.Namespace) -> None:
    """Refuse a --save or --save-all path that cannot be written before planning (minutes on a
    big model), not after."""
    check_output_file(args.save, "--save")
    check_output_dir(args.save_all, "--save-all")


def _save_all(directory: str, plans: dict) -> None:
    from pathlib import Path

    d = Path(directory)
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--save-all {directory!r}: cannot create the directory ({e.strerror}).") from None
    for name, plan in plans.items():
        plan.save(d / f"{name}.json")


@contextmanager
def progress(*, enabled: bool) -> Iterator[Callable[[str], None]]:
    """A spinner with the current step and the time spent, on stderr; yields the function that
    names the step (a no-op when disabled)."""
    if not enabled:
        yield lambda _step: None
        return
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("")

        def say(step: str) -> None:
            bar.update(task, description=step)
            bar.refresh()  # show every step, not only those still running at the next 10 Hz tick

        yield say


def _print_report(traced, plan, out: dict, mesh) -> None:
    from rich.console import Console
    from rich.table import Table

    from shardwise.plan.report import describe_param

    con = Console()
    status = plan.status
    if plan.status != "optimal":
        status += (f" (MIP gap {plan.mip_gap:.2%}: no plan's ILP objective is below "
                   f"{plan.info['bound_s'] * 1e3:.2f} ms)")
    if plan.info.get("started_from"):
        status += f", started from {plan.info['started_from']}"
    chosen = plan.info.get("chosen_from")
    if chosen not in (None, "ilp"):
        status += f"; the {chosen} hand plan beats the ILP's solution by the schedule and is the plan"
    elif "ilp_solution" in plan.info:
        status += "; another plan the ILP's solve found beats its solution by the schedule and is the plan"
    row = out["plans"]["auto"]
    con.print(f"[bold]{traced.model_name}[/] on {mesh} {mesh.hardware}: {status}, "
              f"step {row['step_s'] * 1e3:.2f} ms (compute {row['compute_s'] * 1e3:.2f} ms, "
              f"communication {row['comm_s'] * 1e3:.2f} ms of which exposed "
              f"{row['exposed_comm_s'] * 1e3:.2f} ms; "
              f"ILP objective {row['objective_s'] * 1e3:.2f} ms), "
              f"{row['memory_per_device_bytes'] / 2**30:.2f} GiB per device"
              f"{'' if row['fits'] else ' (does not fit)'}; activation checkpointing {row['ac']}"
              f"{' (--ac)' if out.get('ac_given') else ''}")
    t = Table(title="parameters (first layer and the rest)")
    t.add_column("parameter")
    t.add_column("placement")
    t.add_column("in words")
    for name in list(traced.params)[:12]:
        t.add_row(name, ", ".join(out["params"][name]), describe_param(traced, plan, name))
    con.print(t)
    if not traced.train:
        con.print("outputs: " + "; ".join(",".join(p) for p in out["outputs"]))
    c = Table(title="collectives per step")
    for col in ("kind", "count", "GiB"):
        c.add_column(col)
    for k, v in out["collectives"].items():
        c.add_row(k, str(v["count"]), f"{v['bytes'] / 2**30:.3f}")
    con.print(c)
    b = Table(title="plans (step: the schedule, as shardwise estimate prices it; objective: the ILP's)")
    for col in ("plan", "AC", "step ms", "ILP objective ms", "exposed comm ms", "GiB", "auto is faster by"):
        b.add_column(col)
    auto_s = row["step_s"]
    for k, r in out["plans"].items():
        if r is None:
            b.add_row(k, "", "n/a", "", "", "", "does not apply or does not fit")
            continue
        b.add_row(k, str(r.get("ac") or ""), f"{r['step_s'] * 1e3:.2f}", f"{r['objective_s'] * 1e3:.2f}",
                  f"{r['exposed_comm_s'] * 1e3:.2f}", f"{r['memory_per_device_bytes'] / 2**30:.2f}",
                  "" if k == "auto" else f"{(r['step_s'] - auto_s) / r['step_s'] * 100:.1f}%")
    con.print(b)
    tm = out["timings"]
    con.print(f"ILP: {out['ilp']['variables']} variables, {out['ilp']['constraints']} constraints, "
              f"{out['ilp']['clusters']} clusters; trace {tm['trace_s']:.1f} s, strategies "
              f"{tm['strategies_s']:.1f} s, build {tm['ilp_build_s']:.1f} s, solve {tm['solve_s']:.1f} s")
    for name, ex in out.get("explain", {}).items():
        e = Table(title=f"alternatives for {name} ({ex['node']}), the rest of the plan fixed")
        for col in ("output", "inputs", "compute ms", "comm ms", "total ms", "MiB", ""):
            e.add_column(col)
        for a in ex["alternatives"]:
            e.add_row(",".join(a["output"]), " ".join(",".join(p) for p in a["inputs"]),
                      f"{a['compute_s'] * 1e3:.3f}", f"{a['comm_s'] * 1e3:.3f}", f"{a['time_s'] * 1e3:.3f}",
                      f"{a['memory_bytes'] / 2**20:.1f}", "chosen" if a["chosen"] else "")
        con.print(e)
    if plan.fallback_ops:
        con.print(f"[yellow]warning:[/] no sharding strategy for {', '.join(plan.fallback_ops)}: planned "
                  "replicated")
