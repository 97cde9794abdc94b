"""Where one device's training step goes, kernel by kernel, beside ``shardwise estimate``'s parts.

    .venv/bin/python benchmarks/device_profile.py [--case llama3-8b:2:1:4096:bf16] [--steps 2]
        [--hardware h100] [--compile] [--kernels 25]

One process, one rank (NCCL on a CUDA device, gloo on the CPU): the case (``model:layers:batch:
seq:dtype``) is parallelized with the ``ddp`` plan, trained as ``shardwise train`` trains it
(``train/loop.py``: the same AdamW, clipping and mixed precision) and, after ``WARMUP_STEPS``,
``--steps`` steps run under ``torch.profiler``. Each kernel goes to a part (GEMMs, attention, the
optimizer with clipping, copies, the loss, the rest) and is set beside the schedule's events of
the same part (``shardwise estimate --timeline``), per step. The wall time of the profiled steps
against the kernels' sum is the host's share. ``benchmarks/device_step.py`` gives the whole step.

Without CUDA the kernels are the CPU's ATen ops (a check of the plumbing against the ``cpu`` spec;
the optimizer's per-tensor ops then fall under "other").

Not yet run on a GPU: the device lent to the session that wrote it (2026-11-27) was given back
before. The figures in ``device_step.py`` come from the same profile taken by a one-off script
(``torch.profiler`` around two steps of ``shardwise train``, kernels summed the same way).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
import time
from collections import defaultdict

import torch
from device_step import _shardwise  # the command's --json object, its stderr shown if it fails

WARMUP_STEPS = 2
# A part per kernel or schedule event, by the first pattern its name matches.
PARTS = (
    ("optimizer+clip", r"adam|multi_tensor|optimizer"),
    ("attention", r"flash|fmha|attention"),
    ("gemm", r"nvjet|gemm|cutlass|xmma|einsum|\bmm\b|aten::mm|addmm|bmm"),
    ("loss", r"softmax|nll_loss"),
    ("copy", r"copy|_to_copy|clone"),
)


def part(name: str) -> str:
    return next((p for p, pat in PARTS if re.search(pat, name, re.IGNORECASE)), "other")


def measured(case: str, steps: int, hardware: str, compile: bool) -> tuple[dict[str, float], float, list]:
    """Per step: each part's kernel time (s), the wall time, and the largest kernels."""
    from shardwise.models import parse_dtype
    from shardwise.train.loop import make_optimizer, train_steps
    from shardwise.train.models import build_model, meta_inputs
    from shardwise.train.module import parallelize
    from shardwise.train.options import TrainOptions

    model_name, layers, batch, seq, dtype = case.split(":")
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29541"))
    cuda = torch.cuda.is_available()
    model, spec = build_model(model_name, layers=int(layers), batch=int(batch), seq=int(seq), dtype=dtype)
    low = parse_dtype(dtype) in (torch.bfloat16, torch.float16)
    pm = parallelize(model, "1", meta_inputs(spec), plan="ddp", backend="nccl" if cuda else "gloo",
                     hardware=hardware, compile=compile, master_dtype=torch.float32 if low else None)
    pm.init_weights(0)
    opts = TrainOptions(steps=WARMUP_STEPS + steps)
    opt, sched = make_optimizer(pm.parameters(), opts)
    device = torch.device(pm.device_mesh.device_type)
    inputs = [x.to(device) for x in spec.example_inputs(True)]

    def step_fn(step: int) -> torch.Tensor:
        loss = pm(*inputs)
        loss.backward()
        return loss.detach()

    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    prof = torch.profiler.profile(activities=acts)
    clock = {}

    def on_step(rec) -> None:  # called once the step has run on the device
        if rec.step == WARMUP_STEPS:
            prof.__enter__()
            clock["t0"] = time.perf_counter()
        elif rec.step == WARMUP_STEPS + steps:
            clock["wall"] = time.perf_counter() - clock["t0"]
            prof.__exit__(None, None, None)

    train_steps(step_fn, pm, opts, opt, sched, tokens_per_step=int(batch) * int(seq), on_step=on_step)
    kernels: dict[str, float] = defaultdict(float)
    if cuda:
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith("Optimizer."):
                kernels[e.name] += e.time_range.elapsed_us() * 1e-6 / steps
    else:  # the CPU's ATen ops, by their own time
        for e in prof.key_averages():
            if e.key.startswith("aten::"):
                kernels[e.key] += e.self_cpu_time_total * 1e-6 / steps
    parts: dict[str, float] = defaultdict(float)
    for name, t in kernels.items():
        parts[part(name)] += t
    top = sorted(kernels.items(), key=lambda kv: -kv[1])
    return dict(parts), clock["wall"] / steps, top


def estimated(case: str, hardware: str, compile: bool) -> tuple[dict[str, float], float]:
    """Each part's time in ``shardwise estimate``'s schedule (compute stream), and its step."""
    model_name, layers, batch, seq, dtype = case.split(":")
    with tempfile.TemporaryDirectory() as tmp:
        trace = os.path.join(tmp, "step.json")
        est = _shardwise(["estimate", "--model", model_name, "--layers", layers, "--batch", batch,
                          "--seq", seq, "--dtype", dtype, "--mesh", "1", "--plan", "ddp",
                          "--hardware", hardware, "--timeline", trace, *(["--compile"] if compile else [])])
        with open(trace) as f:
            events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    parts: dict[str, float] = defaultdict(float)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("compute", "recompute", "optimizer"):
            parts[part(e["name"])] += e["dur"] * 1e-6
    return dict(parts), est["step_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", default=None,
                    help="default: llama3-8b:2:1:4096:bf16 on CUDA, else llama-small:2:2:256:fp32")
    ap.add_argument("--steps", type=int, default=2, help="steps profiled (after the warm-up ones)")
    ap.add_argument("--hardware", default=None, help="spec the estimate prices (default: h100 on CUDA, cpu)")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--kernels", type=int, default=25, help="the largest kernels listed")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    case = args.case or ("llama3-8b:2:1:4096:bf16" if cuda else "llama-small:2:2:256:fp32")
    hardware = args.hardware or ("h100" if cuda else "cpu")
    where = torch.cuda.get_device_name() if cuda else "CPU (no CUDA device: plumbing only)"
    meas, wall, top = measured(case, args.steps, hardware, args.compile)
    est, est_step = estimated(case, hardware, args.compile)
    print(f"{case}{' compiled' if args.compile else ''} on {where}, torch {torch.__version__}, "
          f"spec {hardware!r}; ms per step")
    print(f"{'part':16s} {'measured':>10s} {'estimated':>10s}")
    for p in sorted(set(meas) | set(est), key=lambda p: -meas.get(p, 0.0)):
        print(f"{p:16s} {meas.get(p, 0.0) * 1e3:10.3f} {est.get(p, 0.0) * 1e3:10.3f}")
    print(f"{'kernels, sum':16s} {sum(meas.values()) * 1e3:10.3f} {sum(est.values()) * 1e3:10.3f}")
    print(f"{'step (wall)':16s} {wall * 1e3:10.3f} {est_step * 1e3:10.3f}")
    print(f"\nthe {args.kernels} largest kernels, ms per step")
    for name, t in top[:args.kernels]:
        print(f"{t * 1e3:9.3f}  {part(name):15s} {name[:100]}")


if __name__ == "__main__":
    main()
