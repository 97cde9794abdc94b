"""``shardwise run``: trace, plan, lower and run one distributed step on real process groups.

Pipeline: trace the model (fake tensors) -> canonicalise -> plan (``auto``, a baseline, or a plan
file) -> lower to the per-rank program -> optional passes on it -> run one process per rank
(gloo on CPU, NCCL on GPUs; or the ranks ``torchrun`` started) -> with ``--check`` compare with
the single-process fp32 reference.

``--json`` prints ``{"world_size", "plan", "loss", "loss_ref", "max_rel_err",
"collectives": {"predicted": {kind: {"count", "bytes"}}, "measured": {...}}, "rewrites", "wall_s"}``
(``predicted`` is the plan's; ``measured`` what rank 0 executed; every rank's counts are checked
equal). With ``--ac selective|full`` the remat pass rewrites a copy of the per-rank program, both
programs run (on every rank, in one launch) and the JSON gains ``"ac": {"policy",
"recomputed_nodes", "saved_activation_bytes": {"without", "with"}}``: the forward activations
alive when the backward starts, measured on the ranks (largest rank); the loss, gradients and
check are the rematerialised program's. A failed or hung rank: one sentence naming it on stderr, exit code 1.
With ``--check`` the JSON also holds the ``tolerance`` ``max_rel_err`` must stay within: over it the
result is still printed, one sentence goes to stderr and the exit code is 1.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

from shardwise.cli import add_model_options, check_ac_name, positive_float
from shardwise.errors import CheckFailed, UserError

PLAN_CHOICES = ("auto", "ddp", "fsdp", "fsdp_tp", "fsdp_tp_sp")
# Mesh dims that split the model rather than the batch (every other dim splits the batch).
MODEL_PARALLEL_DIMS = ("tp",)
# Exit code when a rank fails or hangs (2 is bad input).
RANK_FAILED_EXIT = 1


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="run one sharded step on real process groups and check it")
    add_program_options(p)
    add_check_options(p, "compare the loss and gradients with the single-process fp32 reference")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and inputs")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds before a silent rank counts as hung")
    p.set_defaults(handler=run)


def add_check_options(p: argparse.ArgumentParser, what: str) -> None:
    """``--check`` and its ``--tolerance`` (run and train)."""
    p.add_argument("--check", action="store_true", help=what)
    p.add_argument("--tolerance", type=positive_float, default=None,
                   help="largest relative difference --check accepts (default by dtype: fp32 1e-4, "
                        "fp16 1e-2, bf16 5e-2); over it the command exits 1")


def failed_check(err: float, tolerance: float, dtype, what: str, result: dict) -> CheckFailed:
    """The ``CheckFailed`` of a result ``err`` off its reference."""
    name = str(dtype).removeprefix("torch.")
    return CheckFailed(f"{what} {err:.2e} off the one-process fp32 reference, over the tolerance "
                       f"{tolerance:g} for {name}.", result)


def add_program_options(p: argparse.ArgumentParser) -> None:
    """The model, mesh, plan, passes and backend options shared by run and train."""
    add_model_options(p, default_model="llama-tiny")
    p.add_argument("--mesh", default="2", help="device mesh, e.g. 4 or 2x2")
    p.add_argument("--mesh-names", default=None, help="one name per mesh dim, e.g. dp,tp")
    p.add_argument("--hardware", default="h100", help="hardware the planner prices for")
    p.add_argument("--plan", default="auto", help=f"{' | '.join(PLAN_CHOICES)} | path/to/plan.json")
    p.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    p.add_argument("--passes", default="", help="graph passes to run on the per-rank program, e.g. "
                   "sequence_parallel,collective_matmul,bucket")
    p.add_argument("--ac", default=None, help="activation checkpointing of the per-rank training "
                   "program: none | selective | full (the remat pass, run after --passes; default: what a "
                   "plan file records, per layer, else none)")


def check_batch(batch: int, mesh) -> None:
    """The batch splits evenly over the mesh's data-parallel dims (all but tensor-parallel ones)."""
    dp = [i for i, n in enumerate(mesh.names) if n not in MODEL_PARALLEL_DIMS]
    ways = math.prod(mesh.shape[i] for i in dp)
    if ways > 1 and batch % ways:
        names = ",".join(mesh.names[i] for i in dp)
        raise UserError(f"batch {batch} cannot be split over the {ways} data-parallel ranks of mesh dims "
                        f"{names}; use a --batch that {ways} divides or a smaller mesh.")


def make_plan_for(choice: str, traced, mesh, model: str, train: bool, time_limit_s: float = 60.0):
    """The plan named by ``--plan``: ``auto``, a baseline, or a plan file checked against the graph."""
    from shardwise.plan.plan import Plan, graph_fingerprint
    from shardwise.plan.planner import plan_named

    if choice in PLAN_CHOICES:
        return plan_named(traced, mesh, choice, time_limit_s=time_limit_s)
    if not choice.endswith(".json") and not os.path.exists(choice):
        raise UserError(f"--plan {choice!r} is neither one of {', '.join(PLAN_CHOICES)} nor a plan file.")
    plan = Plan.load(choice)
    plan.check_matches(model, mesh.shape, train, graph_fingerprint(traced.gm))
    return plan


def _ac_policy(name: str, train: bool):
    """The ``--ac`` policy, None for ``none``; refused with ``--inference`` (nothing to save)."""
    from shardwise.passes.remat import ACPolicy

    check_ac_name(name)
    policy = ACPolicy(name)
    if policy is ACPolicy.NONE:
        return None
    if not train:
        raise UserError(f"--ac {policy.value} recomputes activations for the backward, and an "
                        "--inference run has no backward; drop --ac or --inference.")
    return policy


def with_remat(program, policy):
    """A copy of ``program`` whose graph the remat pass rewrote under ``policy``, and the number
    of nodes it recomputes (the original program is left as it was, to measure against)."""
    import copy
    import dataclasses

    from torch import fx

    from shardwise.passes import remat

    gm = fx.GraphModule(program.gm, copy.deepcopy(program.gm.graph))
    done = remat.apply(gm, policy)
    return dataclasses.replace(program, gm=gm, passes=[*program.passes, "remat"],
                               rewrites={**program.rewrites, "remat": done}), done


def run(args: argparse.Namespace) -> dict:
    from shardwise.ir.trace import trace_model
    from shardwise.lower import lower
    from shardwise.mesh import parse_mesh
    from shardwise.models import get_model
    from shardwise.passes import parse_passes
    from shardwise.passes.pipeline import canonicalize
    from shardwise.passes.remat import policy_name
    from shardwise.runtime.counter import as_json
    from shardwise.runtime.launch import (
        RunError,
        _check_backend,
        check_tolerance,
        run_many,
        start_forkserver,
        under_torchrun,
    )
    from shardwise.runtime.launch import run as run_program

    t0 = time.perf_counter()
    mesh = parse_mesh(args.mesh, args.mesh_names, args.hardware)
    _check_backend(args.backend, mesh.size)
    passes = list(parse_passes(args.passes))
    train = not args.inference
    ac = _ac_policy(args.ac, train) if args.ac is not None else None
    spec = get_model(args.model, layers=args.layers, batch=args.batch, seq=args.seq, dtype=args.dtype)
    tolerance = check_tolerance(spec.dtype, args.tolerance)
    check_batch(spec.batch, mesh)
    traced = trace_model(args.model, train=train, layers=args.layers, batch=args.batch, seq=args.seq,
                         dtype=args.dtype)
    canonicalize(traced)
    plan = make_plan_for(args.plan, traced, mesh, args.model, train)
    if args.ac is None and train and plan.ac is not None:
        from shardwise.passes.remat import ACPolicy, simplify_policy

        recorded = simplify_policy(plan.ac.layer_policies())  # the plan's choice, per layer
        ac = None if recorded is ACPolicy.NONE else recorded
    if not under_torchrun():
        start_forkserver()  # its imports run on the other core while this one lowers
    program = lower(traced, plan)
    program.model = spec
    rewrites = program.apply_passes(passes)
    try:
        if ac is None:
            res = run_program(program, args.backend, check=args.check, seed=args.seed, timeout_s=args.timeout)
        else:
            # The program without and with remat run together, both measured on every rank.
            rematted, recomputed = with_remat(program, ac)
            rewrites = {**rewrites, "remat": recomputed}
            base, res = run_many([program, rematted], args.backend, check=args.check, seed=args.seed,
                                 timeout_s=args.timeout, measure_activations=True) or (None, None)
    except RunError as e:
        sys.stderr.write(f"shardwise run: error: {e}\n")
        raise SystemExit(RANK_FAILED_EXIT) from None
    if res is None:  # a torchrun rank other than 0
        args.json = False  # rank 0 speaks for the job
        return {}
    result = {
        "world_size": res.world_size,
        "plan": args.plan if args.plan in PLAN_CHOICES else plan.name,
        "loss": res.loss,
        "loss_ref": res.loss_ref,
        "max_rel_err": res.max_rel_err,
        # "program": the per-rank program's own collectives, after passes (fused ops move theirs
        # as ring transfers); the plan's prediction is for the program before passes.
        "collectives": {"predicted": as_json(res.predicted), "program": as_json(res.lowered),
                        "measured": as_json(res.measured)},
        "rewrites": rewrites,
        "wall_s": round(time.perf_counter() - t0, 3),
    }
    if ac is not None:
        result["ac"] = {"policy": policy_name(ac), "recomputed_nodes": rewrites["remat"],
                        "saved_activation_bytes": {"without": base.saved_activation_bytes,
                                                   "with": res.saved_activation_bytes}}
    if res.max_rel_err is not None:
        result["tolerance"] = tolerance
    if not args.json:
        _report(result, res, mesh)
    if res.max_rel_err is not None and res.max_rel_err > tolerance:
        raise failed_check(res.max_rel_err, tolerance, spec.dtype, f"the step's {res.worst} is", result)
    return result


def _report(result: dict, res, mesh) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console()
    head = f"[bold]{result['plan']}[/] plan on mesh {mesh}: {res.world_size} ranks, {res.backend}"
    con.print(head)
    if res.loss is not None:
        ref = f" (reference {res.loss_ref:.6f})" if res.loss_ref is not None else ""
        con.print(f"loss {res.loss:.6f}{ref}")
    if res.max_rel_err is not None:
        con.print(f"max relative error {res.max_rel_err:.2e} (tolerance {result['tolerance']:g})"
                  + (f", at {res.worst}" if res.worst else ""), soft_wrap=True)
    table = Table(title="collectives per rank")
    for col in ("kind", "predicted count", "predicted bytes", "measured count", "measured bytes"):
        table.add_column(col, justify="right" if col != "kind" else "left")
    pred, meas = result["collectives"]["predicted"], result["collectives"]["measured"]
    for kind in sorted(set(pred) | set(meas)):
        p, m = pred.get(kind, {}), meas.get(kind, {})
        table.add_row(kind, str(p.get("count", 0)), str(p.get("bytes", 0)), str(m.get("count", 0)),
                      str(m.get("bytes", 0)))
    con.print(table)
    rewritten = any(result["rewrites"].values())
    if not rewritten:
        con.print("measured == predicted" if pred == meas else "[yellow]measured differs from predicted[/]")
    else:
        con.print("rewrites: " + ", ".join(f"{k} {v}" for k, v in result["rewrites"].items()))
        same = meas == result["collectives"]["program"]
        con.print("measured == the rewritten program's collectives (the prediction is the plan's, "
                  "before passes)" if same else "[yellow]measured differs from the rewritten program[/]")
    con.print(f"wall {result['wall_s']:.2f} s")
