"""``shardwise train``: train a model on real process groups, with checkpoints, resume and a check.

Pipeline: check the options and files -> trace the model on fake tensors and plan it (``auto``, a
baseline or a plan file) here, once -> start one process per rank (or, under ``torchrun``, be one:
rank 0 then plans and shares its plan) -> every rank builds the model on meta, ``parallelize``s it
with the plan, initialises its shards from ``--seed`` (or reads them from the safetensors
weights ``--init-from`` names, or resumes from ``--resume``) and trains
``--steps`` with AdamW, warmup + cosine LR and gradient clipping, reading only its slice of each
batch -> ``--check`` trains the same steps in one process in fp32 meanwhile and compares curves.

``--grad-accum N`` splits each step's batch into N micro-batches, the program planned for one and
run N times, the gradients summed before the optimizer step (the reference takes the batch whole).

``--master-dtype`` (default fp32) is the dtype the weights, their gradients and AdamW's state are
kept in: a bf16 or fp16 model then trains in mixed precision, each step computing in ``--dtype``.

``--json`` prints one object: ``losses`` (one per step run), ``first_step``, ``tokens_per_s``,
``step_s``, ``world_size``, ``plan``, ``checkpoints``, on GPUs rank 0's ``memory_reserved_peak_bytes``
(``torch.cuda.max_memory_reserved``), and with ``--check`` ``reference_losses``,
``max_rel_diff`` and the ``tolerance`` it must stay within (else exit 1). On a terminal (never
with ``--json``) a progress bar shows step, loss, tokens/s and the time left. ``--save-dir`` also
gets ``metrics.jsonl`` and ``loss.png``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shardwise.cli import check_ac_name
from shardwise.cli.run import (
    PLAN_CHOICES,
    RANK_FAILED_EXIT,
    add_check_options,
    add_program_options,
    check_batch,
    failed_check,
)
from shardwise.errors import UserError

if TYPE_CHECKING:
    import torch

# Seconds a local launch may run per step before its ranks count as hung, on top of a fixed
# allowance for starting the ranks and lowering the program (two slow cores, four ranks).
START_ALLOWANCE_S = 120.0
PER_STEP_ALLOWANCE_S = 30.0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a model on real process groups (checkpoints, resume, check)")
    add_program_options(p)
    p.add_argument("--steps", type=int, default=20, help="training steps (the LR schedule's length)")
    p.add_argument("--stop-at", type=int, default=None, help="stop after this step (schedule unchanged)")
    p.add_argument("--grad-accum", type=int, default=1,
                   help="split each step's --batch into this many micro-batches, their gradients summed "
                        "before the optimizer step (the program is planned for one micro-batch)")
    p.add_argument("--lr", type=float, default=None,
                   help="peak learning rate (AdamW; default 3e-4 x 4096 / the model's width, 3e-3 at most)")
    p.add_argument("--warmup", type=int, default=2, help="linear warmup steps before the cosine decay")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0, help="max gradient norm (0: no clipping)")
    p.add_argument("--data", default=None, help="a local text file (default: a synthetic stream)")
    p.add_argument("--tokenizer", default=None, help="a local Hugging Face tokenizer.json (default: bytes)")
    p.add_argument("--save-dir", default=None, help="where checkpoints, metrics.jsonl and loss.png go")
    p.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (and at the end)")
    p.add_argument("--resume", default=None, help="continue from the newest checkpoint in this dir")
    p.add_argument("--init-from", default=None,
                   help="start from these weights: a .safetensors file, or a directory transformers' "
                   "save_pretrained or shardwise export wrote (default: random weights from --seed)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the synthetic data")
    add_check_options(p, "compare the loss curve with the same steps in one fp32 process")
    p.add_argument("--compile", action="store_true",
                   help="run each rank's step through torch.compile (Inductor) instead of op by op")
    p.add_argument("--master-dtype", choices=("fp32", "bf16", "fp16"), default="fp32",
                   help="dtype the weights, their gradients and AdamW's state are kept in; each step "
                        "computes in --dtype (default fp32: mixed precision, as torchtitan trains)")
    p.add_argument("--time-limit", type=float, default=60.0, help="seconds the planner may solve")
    p.add_argument("--timeout", type=float, default=None, help="seconds before a silent rank counts as hung")
    p.set_defaults(handler=run)


def _checked_options(args: argparse.Namespace):
    """The training options, refused here where the options alone are wrong: nothing has
    imported torch yet, so a mistyped option costs no wait."""
    from shardwise.train.options import TrainOptions, existing_file

    if args.inference:
        raise UserError("train runs training steps; drop --inference.")
    check_ac_name(args.ac)
    if args.grad_accum < 1:
        raise UserError(f"--grad-accum must be a positive integer, got {args.grad_accum}.")
    if args.tokenizer and not args.data:
        raise UserError("--tokenizer needs --data (a text file to tokenize).")
    if args.data:
        existing_file(args.data, "data file")
    if args.tokenizer:
        existing_file(args.tokenizer, "tokenizer file")
    opts = TrainOptions(steps=args.steps, lr=args.lr, warmup=args.warmup, weight_decay=args.weight_decay,
                        clip=args.clip, seed=args.seed, save_dir=args.save_dir, save_every=args.save_every,
                        resume=args.resume, stop_at=args.stop_at, init_from=args.init_from)
    opts.check()
    return opts


def _source(args: argparse.Namespace, spec, save_dir: str | None):
    from shardwise.train.data import SyntheticSource, byte_source, tokenize_file

    if not args.data:
        return SyntheticSource(spec.vocab_size, args.seed)
    if args.tokenizer:
        import tempfile

        out = save_dir or tempfile.mkdtemp(prefix="shardwise-tokens-")
        return tokenize_file(args.data, args.tokenizer, out, spec.vocab_size)
    return byte_source(args.data, spec.vocab_size)


def run(args: argparse.Namespace) -> dict:
    t0 = time.perf_counter()
    args.ac = args.ac or "none"  # train runs one policy for every layer (--ac), none by default
    opts = _checked_options(args)
    from shardwise.mesh import parse_mesh
    from shardwise.models import get_model
    from shardwise.passes import parse_passes
    from shardwise.runtime.launch import RunError, _check_backend, check_tolerance, under_torchrun
    from shardwise.train import checkpoint
    from shardwise.train.job import TrainJob
    from shardwise.train.options import default_lr

    mesh = parse_mesh(args.mesh, args.mesh_names, args.hardware)
    _check_backend(args.backend, mesh.size)
    passes = parse_passes(args.passes)
    spec = get_model(args.model, layers=args.layers, batch=args.batch, seq=args.seq, dtype=args.dtype)
    if opts.lr is None:
        opts.lr = default_lr(spec.width)
    check = _Check(check_tolerance(spec.dtype, args.tolerance), spec.dtype) if args.check else None
    _check_master_dtype(args.master_dtype, spec.dtype)
    if spec.batch % args.grad_accum:
        raise UserError(f"batch {spec.batch} cannot be split into {args.grad_accum} micro-batches; use a "
                        "--batch that --grad-accum divides.")
    check_batch(spec.batch // args.grad_accum, mesh)
    job = TrainJob(model=args.model, layers=args.layers, batch=spec.batch, seq=spec.seq, dtype=args.dtype,
                   mesh=mesh, plan=args.plan, passes=passes, source=None, options=opts,
                   backend=args.backend, time_limit_s=args.time_limit, ac=args.ac, compile=args.compile,
                   grad_accum=args.grad_accum, master_dtype=args.master_dtype)
    if opts.resume:
        path = checkpoint.latest(opts.resume)
        meta = checkpoint.read_meta(path)
        checkpoint.check_compatible(meta, job.build(meta=True)[0], args.model, path)
        if meta.step >= opts.last_step:
            raise UserError(f"the checkpoint is at step {meta.step}, already past --steps "
                            f"{opts.last_step}; raise --steps to train on.")
    if opts.init_from:  # refused here, not in every rank, where they are not this model's weights
        from shardwise.train.weights import Pretrained, aliases, stored_prefix

        module = job.build(meta=True)[0]
        Pretrained(opts.init_from, stored_prefix(module), aliases(module)).check(
            [(k, p.shape) for k, p in module.named_parameters()])
    # The data last: a tokenized copy is the first thing written (never next to a refused run).
    # Under torchrun every process tokenizes into its own temporary dir (no two write one file).
    job.source = _source(args, spec, None if under_torchrun() else opts.save_dir)
    if under_torchrun():
        return _run_torchrun(args, job, check, t0)
    job.plan = _plan_here(args, job).to_json()  # planned once here; ranks lower it
    timeout = args.timeout or START_ALLOWANCE_S + PER_STEP_ALLOWANCE_S * opts.last_step
    try:
        res, ref = _launch(job, timeout, check=check is not None, show=not args.json and sys.stderr.isatty())
    except RunError as e:
        sys.stderr.write(f"shardwise train: error: {e}\n")
        raise SystemExit(RANK_FAILED_EXIT) from None
    return _finish(args, job, res, ref, check, t0)


def _check_master_dtype(name: str, model_dtype: torch.dtype) -> None:
    """Master weights at least as wide as the model's: narrower ones would round every update."""
    from shardwise.models import DTYPES

    if DTYPES[name].itemsize < model_dtype.itemsize:
        model = next(k for k, v in DTYPES.items() if v == model_dtype)
        raise UserError(f"--master-dtype {name} is narrower than the model's {model}; keep the weights in "
                        f"{model} or wider.")


def _plan_here(args: argparse.Namespace, job):
    from shardwise.cli.run import PLAN_CHOICES, make_plan_for
    from shardwise.plan.baselines import baseline_refusal
    from shardwise.runtime.launch import start_forkserver
    from shardwise.train.models import meta_inputs
    from shardwise.train.module import _trace

    model, spec = job.build(meta=True)
    traced = _trace(model, meta_inputs(spec), train=True, model_name=args.model)
    # The ranks' forkserver imports on the other core while the plan is solved; not for a plan
    # that is refused at once (the server would hold stderr, the error's, until its imports end).
    named = args.plan in PLAN_CHOICES
    if named and (args.plan == "auto" or baseline_refusal(args.plan, traced, job.mesh) is None):
        start_forkserver()
    return make_plan_for(args.plan, traced, job.mesh, args.model, True, time_limit_s=args.time_limit)


def _launch(job, timeout: float, *, check: bool, show: bool):
    """Run the job on one local process per rank; ``(rank 0's summary, reference losses)``."""
    from shardwise.runtime import wire
    from shardwise.runtime.launch import spawn
    from shardwise.train.job import reference

    refs: list[float] = []
    steps = job.options.last_step - _resume_step(job)
    with _progress(show, steps) as on_message:
        outs = spawn(train_worker, [wire.dumps(job)] * job.mesh.size, job.backend, timeout,
                     while_running=(lambda: refs.extend(reference(job))) if check else None,
                     on_message=on_message)
    return outs[0], (refs if check else None)


def _resume_step(job) -> int:
    from shardwise.train import checkpoint

    return checkpoint.read_meta(checkpoint.latest(job.options.resume)).step if job.options.resume else 0


def train_worker(rank: int, backend: str, payload: bytes, send) -> dict:
    """A rank of a local launch (module-level: the launcher pickles it by name)."""
    import pickle

    from shardwise.train.job import run_rank

    return run_rank(pickle.loads(payload), send)


def _run_torchrun(args: argparse.Namespace, job, check: _Check | None, t0: float) -> dict:
    """This process is one rank: train; rank 0 reports (and runs the reference after)."""
    import torch.distributed as dist

    from shardwise.train.job import reference, run_rank

    steps = job.options.last_step - _resume_step(job)
    rank0 = int(os.environ["RANK"]) == 0
    with _progress(rank0 and not args.json and sys.stderr.isatty(), steps) as on_message:
        res = run_rank(job, lambda rec: on_message(0, rec))
    if dist.is_initialized():
        dist.destroy_process_group()
    if not rank0:
        args.json = False  # rank 0 speaks for the job
        return {}
    ref = reference(job) if check is not None else None
    return _finish(args, job, res, ref, check, t0)


@dataclass(frozen=True)
class _Check:
    """What ``--check`` accepts: ``tolerance`` for a run in ``dtype``."""

    tolerance: float
    dtype: torch.dtype


def _finish(args: argparse.Namespace, job, res: dict, ref: list[float] | None, check: _Check | None,
            t0: float) -> dict:
    out = {"world_size": job.mesh.size, "mesh": list(job.mesh.shape), "mesh_names": list(job.mesh.names),
           "plan": args.plan if args.plan in PLAN_CHOICES else res["plan"], "model": args.model, "ac": job.ac,
           "compile": job.compile, "master_dtype": job.master_dtype, "batch": job.batch,
           "grad_accum": job.grad_accum,
           "data": job.source.describe(), "init_from": job.options.init_from, **res,
           "wall_s": round(time.perf_counter() - t0, 3)}
    if ref is not None:
        out["reference_losses"] = ref
        out["max_rel_diff"] = max((abs(a - b) / abs(b) for a, b in zip(res["losses"], ref, strict=True)),
                                  default=0.0)
        out["tolerance"] = check.tolerance
    if not args.json:
        _report(out)
    if ref is not None and out["max_rel_diff"] > check.tolerance:
        raise failed_check(out["max_rel_diff"], check.tolerance, check.dtype, "the loss curve is", out)
    return out


class _progress:
    """A rich progress bar on stderr fed by rank 0's step records (disabled: a no-op)."""

    def __init__(self, enabled: bool, steps: int) -> None:
        self.enabled, self.steps, self.bar, self.task = enabled, steps, None, None

    def __enter__(self):
        if not self.enabled:
            return lambda _rank, _rec: None
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.bar = Progress(TextColumn("step"), MofNCompleteColumn(), BarColumn(),
                            TextColumn("{task.fields[info]}"), TimeRemainingColumn(),
                            console=Console(stderr=True), transient=True)
        self.bar.__enter__()
        self.task = self.bar.add_task("train", total=self.steps, info="starting ranks")

        def update(_rank: int, rec: dict) -> None:
            info = f"loss {rec['loss']:.4f}  {rec['tokens_per_s']:,.0f} tok/s"
            self.bar.update(self.task, advance=1, info=info)

        return update

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)


def _report(out: dict) -> None:
    from rich.console import Console

    con = Console()
    losses = out["losses"]
    first, last = out["first_step"] + 1, out["first_step"] + len(losses)
    con.print(f"[bold]{out['model']}[/] trained with the {out['plan']} plan on {out['world_size']} ranks "
              f"({'x'.join(map(str, out['mesh']))}): steps {first}..{last}")
    if out["grad_accum"] > 1:
        con.print(f"each step {out['grad_accum']} micro-batches of {out['batch'] // out['grad_accum']}, "
                  f"gradients summed")
    if losses:
        con.print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; {out['tokens_per_s']:,.0f} tokens/s, "
                  f"{out['step_s'] * 1e3:.1f} ms/step")
    if "max_rel_diff" in out:
        con.print(f"reference (one process, fp32): max relative difference {out['max_rel_diff']:.2e} "
                  f"(tolerance {out['tolerance']:g})")
    for c in out["checkpoints"]:
        con.print(f"checkpoint {c}")
