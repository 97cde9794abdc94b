"""One training job, as every rank runs it and as the single-process reference replays it.

``TrainJob`` is what the ``shardwise train`` command hands each rank (picklable): the model by
name, the mesh, the plan (already solved by the launcher, or a name for rank 0 to solve under
torchrun), the passes, the data source and the options. ``run_rank`` builds the model on meta,
``parallelize``s it, initialises or resumes, trains and saves; rank 0 returns the curve.
``reference`` trains the same steps in one process, in fp32, from the same weights and data.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from shardwise.lower.spmd import REDISTRIBUTE_LOG
from shardwise.mesh import Mesh, destroy_world
from shardwise.train import checkpoint
from shardwise.train.data import batch_rows, global_batch
from shardwise.train.loop import TrainResult, is_rank0, make_optimizer, train_steps, write_metrics
from shardwise.train.options import TrainOptions


@dataclass
class TrainJob:
    model: str
    layers: int | None
    batch: int
    seq: int
    dtype: str | None
    mesh: Mesh
    plan: dict | str  # a plan's JSON, or a name that rank 0 solves
    passes: tuple[str, ...]
    source: object  # data.SyntheticSource | data.TokenFileSource (None until the launcher sets it)
    options: TrainOptions = field(default_factory=TrainOptions)
    backend: str = "gloo"
    time_limit_s: float = 60.0
    ac: str = "none"
    compile: bool = False
    grad_accum: int = 1  # micro-batches a step's batch is split into, their gradients summed
    master_dtype: str | None = None  # the weights', gradients' and optimizer state's dtype (None: dtype's)

    @property
    def micro_batch(self) -> int:
        """The samples of one micro-batch: the batch the per-rank program is planned for."""
        return self.batch // self.grad_accum

    def build(self, meta: bool, dtype: str | None = None):
        """The model, its example inputs one micro-batch."""
        from shardwise.train.models import build_model

        return build_model(self.model, meta=meta, **{**self.build_options(), "batch": self.micro_batch,
                                                      "dtype": dtype or self.dtype})

    def build_options(self) -> dict:
        """What rebuilds this model (kept in checkpoints, for resume checks and export)."""
        return {"layers": self.layers, "batch": self.batch, "seq": self.seq, "dtype": self.dtype}

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.seq


def run_rank(job: TrainJob, send: Callable[[object], None] | None = None) -> dict:
    """Train on this process's rank (the process group is up, or torchrun's environment is set)."""
    from shardwise.models import parse_dtype
    from shardwise.plan.plan import Plan
    from shardwise.train.models import meta_inputs
    from shardwise.train.module import parallelize

    # DTensor notes at every clip/checkpoint that a 2-D shard gathers in two steps: a performance
    # hint about PyTorch's own utilities, printed by every rank at every step, not about the job.
    REDISTRIBUTE_LOG.setLevel(logging.ERROR)
    model, spec = job.build(meta=True)
    plan = Plan.from_json(job.plan) if isinstance(job.plan, dict) else job.plan
    pm = parallelize(model, job.mesh, meta_inputs(spec), plan=plan, passes=job.passes,
                     time_limit_s=job.time_limit_s, backend=job.backend, hardware=job.mesh.hardware,
                     ac=job.ac, compile=job.compile, master_dtype=parse_dtype(job.master_dtype))
    opts = job.options
    opt, sched = make_optimizer(pm.parameters(), opts)
    first = _start(job, pm, opt, sched, pm.init_weights, pm.load_weights)
    layouts = pm.input_layouts()
    coord = pm.coordinate()
    device = torch.device(pm.device_mesh.device_type)

    # (tokens, labels): this rank's rows of a micro-batch and its columns, the same every step.
    windows = [(rows.indices(job.micro_batch)[:2], cols)
               for rows, cols in (lay.index(coord) for lay in layouts)]

    def step_fn(step: int) -> torch.Tensor:
        # Each micro-batch's loss is its tokens' mean: a 1/grad_accum share of each makes the
        # summed gradients the whole batch's mean (the micro-batches hold as many tokens each).
        total = torch.zeros((), device=device)
        for k in range(job.grad_accum):
            at = k * job.micro_batch
            local = []
            for i, ((first, stop), cols) in enumerate(windows):
                rows = slice(at + first, at + stop)
                local.append(batch_rows(job.source, step, job.batch, job.seq, rows, cols)[i].to(device))
            loss = pm(*local)
            (loss / job.grad_accum).backward()
            total += loss.detach()
        return total / job.grad_accum

    def save(step: int) -> str:
        return str(checkpoint.save(opts.save_dir, step, pm, opt, sched, job.model, job.build_options()))

    def on_step(rec) -> None:
        if is_rank0():
            if opts.save_dir:
                write_metrics(opts.save_dir, [rec], f"{job.model} on {job.mesh}")
            if send is not None:
                send(asdict(rec))

    res = train_steps(step_fn, pm, opts, opt, sched, tokens_per_step=job.tokens_per_step, first_step=first,
                      save=save if opts.save_dir else None, on_step=on_step)
    if not is_rank0():
        return {}
    out = _summary(res, pm.plan.name)
    if device.type == "cuda":  # what torchtitan reports as peak memory, and what OOMs
        out["memory_reserved_peak_bytes"] = torch.cuda.max_memory_reserved(device)
    return out


def _start(job: TrainJob, module, optimizer, scheduler, init_weights: Callable[[int], None],
           load_weights: Callable[[str], None]) -> int:
    """Resume from the job's checkpoint (its step), or start (step 0) from the weights
    ``--init-from`` names or from ``init_weights``. Every rank and the reference seed PyTorch's
    generator alike first: a model's dropout masks are drawn from it, the same numbers on every
    rank and in one process (``plan/strategies.py``); a checkpoint then restores the state it
    saved."""
    torch.manual_seed(job.options.seed)
    if job.options.resume:
        return checkpoint.load(job.options.resume, module, optimizer, scheduler, job.model).step
    if job.options.init_from:
        load_weights(job.options.init_from)
    else:
        init_weights(job.options.seed)
    return 0


def _summary(res: TrainResult, plan_name: str) -> dict:
    recs = res.records
    # The first step pays one-off costs (allocations, first collectives): timing starts after it.
    timed = recs[1:] or recs
    step_s = sum(r.step_s for r in timed) / len(timed) if timed else 0.0
    return {"first_step": res.first_step, "losses": res.losses, "lrs": [r.lr for r in recs],
            "grad_norms": [r.grad_norm for r in recs], "step_s": step_s,
            "tokens_per_s": (sum(r.tokens_per_s for r in timed) / len(timed)) if timed else 0.0,
            "checkpoints": res.checkpoints, "plan": plan_name}


def reference(job: TrainJob) -> list[float]:
    """The same steps in this process, fp32, from the same weights (or checkpoint) and data."""
    from shardwise.train.module import init_state_dict
    from shardwise.train.weights import Pretrained, aliases, stored_prefix

    if dist.is_initialized() and dist.get_backend() == "fake":
        destroy_world()  # the planner's; DCP must see a single process
    module, _ = job.build(meta=False, dtype="fp32")
    opts = job.options
    opt, sched = make_optimizer(module.parameters(), opts)

    @torch.no_grad()
    def init_weights(seed: int) -> None:
        shapes = {k: (tuple(p.shape), p.dtype) for k, p in module.named_parameters()}
        for k, v in init_state_dict(shapes, seed).items():
            module.get_parameter(k).copy_(v)

    def load_weights(path: str) -> None:
        pieces = [(k, p, p.shape, None) for k, p in module.named_parameters()]
        Pretrained(path, stored_prefix(module), aliases(module)).fill(pieces)

    first = _start(job, module, opt, sched, init_weights, load_weights)

    def step_fn(step: int) -> torch.Tensor:
        loss = module(*global_batch(job.source, step, job.batch, job.seq))
        loss.backward()
        return loss.detach()

    res = train_steps(step_fn, module, opts, opt, sched, tokens_per_step=job.tokens_per_step,
                      first_step=first)
    return res.losses
