"""Training with shardwise against PyTorch's own data-parallel loops, and the memory of a big model.

Speed: the same model, weights, data, AdamW (fused, torchtitan's default; ``--optimizer foreach``)
and clipping on 2 gloo ranks, trained by

- ``shardwise-fsdp`` / ``shardwise-ddp``: ``shardwise.train.parallelize`` with the fsdp / ddp plan
  and the ``bucket`` pass (gradient reductions grouped into 25 MiB buckets, like DDP's);
- ``torch-fsdp2``: ``torch.distributed.fsdp.fully_shard`` on every decoder layer and the root;
- ``torch-ddp``: ``torch.nn.parallel.DistributedDataParallel``;

and, with ``--compile``, each again compiled (``+compile``): shardwise's per-rank program through
``torch.compile`` (``parallelize(compile=True)``); FSDP2 with every decoder layer compiled before
``fully_shard``, as torchtitan does; DDP wrapped in ``torch.compile`` (its DDPOptimizer splits the
graph at the gradient buckets). Compilation happens in the warmup steps.

Each runs ``--warmup`` untimed steps then ``--steps`` timed ones and prints tokens/s (global batch
tokens over the median step time, per step the slower rank's, the best of ``--rounds`` rounds)
and its last loss (all four must agree). A shardwise loop and its PyTorch counterpart run in one
pair of processes, step by step in turn (the order alternating), so that a machine whose speed
drifts (this 2-core one swings 10-30% from minute to minute) slows both alike: for each pair,
the ratio of the best rounds, and the median of the step-by-step ratios (each step's time over
its partner's, the median of each round's) with its range over the rounds.
Two models: llama-tiny (hidden 64), whose CPU step is mostly per-op overhead, and llama-small
(hidden 256), whose step is mostly arithmetic.

``--phases`` adds each loop's step by phase (inputs, model, backward, clip, optimizer, zero_grad),
wall and CPU: where shardwise's step and PyTorch's part ways.

Memory: ``parallelize`` of ``--mem-model`` (default llama3-8b with 4 layers, bf16) built on meta
over 4 ranks with the fsdp plan, then ``init_weights`` (or, ``--mem-weights``, ``load_weights``
from a safetensors file of the same values that this process writes first): each rank's peak
RSS next to the model's size (no rank ever holds the whole model).

    python benchmarks/train.py [--models llama-tiny:8x128,llama-small:8x256] [--layers 4] [--compile]
                               [--loops shardwise-ddp,torch-ddp] [--phases] [--skip-memory] [--mem-weights]
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODES = ("shardwise-fsdp", "shardwise-ddp", "torch-fsdp2", "torch-ddp")
COMPILED = "+compile"  # the suffix of a loop run through torch.compile
# A training step's phases, in order, as ``--phases`` prints them.
PHASES = ("inputs", "model", "backward", "clip", "optimizer", "zero_grad")
# llama-tiny's step is per-op overhead (hidden 64); llama-small's is arithmetic (hidden 256).
DEFAULT_CASES = ("llama-tiny:8x128", "llama-small:8x256")
# AdamW's learning rate and the gradient-norm clip, the same for every loop.
LR, CLIP = 3e-3, 1.0


def _parse_case(text: str) -> tuple[str, int, int]:
    model, _, shape = text.strip().rpartition(":")
    batch, seq = (int(x) for x in shape.split("x"))
    if not model or batch % 2 or batch <= 0 or seq <= 0:
        raise ValueError(text)
    return model, batch, seq


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join(rank: int, world: int, port: int) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)


def _build(args):
    from shardwise.train.models import build_model
    from shardwise.train.module import init_state_dict

    module, spec = build_model(args.model, layers=args.layers, batch=args.batch, seq=args.seq, meta=False)
    shapes = {k: (tuple(p.shape), p.dtype) for k, p in module.named_parameters()}
    with torch.no_grad():
        for k, v in init_state_dict(shapes, 0).items():
            module.get_parameter(k).copy_(v)
    return module, spec


def _now() -> tuple[float, float]:
    """Wall seconds and this thread's CPU seconds."""
    return time.perf_counter(), time.thread_time()


class _Loop:
    """One training loop of ``mode`` on this rank: its model, optimizer and inputs."""

    def __init__(self, mode: str, rank: int, world: int, args) -> None:
        from shardwise.train.data import SyntheticSource, global_batch

        module, spec = _build(args)
        source = SyntheticSource(spec.vocab_size, 0)
        per = args.batch // world
        self.mode = mode
        loop, compiled = mode.removesuffix(COMPILED), mode.endswith(COMPILED)
        self.torch = not loop.startswith("shardwise")
        if not self.torch:
            from shardwise.train import meta_inputs, parallelize

            example = meta_inputs(spec)
            # The bucket pass groups the gradient reductions, as DDP and FSDP2 do.
            model = parallelize(module, "2", example, plan=loop.split("-")[1], passes=("bucket",),
                                time_limit_s=60, compile=compiled)

            def step_inputs(step):
                return model.shard_inputs(*global_batch(source, step, args.batch, args.seq))
        else:
            if loop == "torch-ddp":
                from torch.nn.parallel import DistributedDataParallel

                model = DistributedDataParallel(module)
                model = torch.compile(model) if compiled else model
            else:
                from torch.distributed.device_mesh import init_device_mesh
                from torch.distributed.fsdp import fully_shard

                mesh = init_device_mesh("cpu", (world,))
                for layer in module.layers:
                    if compiled:
                        layer.compile()
                    fully_shard(layer, mesh=mesh)
                model = fully_shard(module, mesh=mesh)

            def step_inputs(step):
                tokens, labels = global_batch(source, step, args.batch, args.seq)
                return tokens[rank * per:(rank + 1) * per], labels[rank * per:(rank + 1) * per]
        self.model, self.step_inputs = model, step_inputs
        # The same for every loop; fused is torchtitan's default AdamW implementation.
        self.opt = torch.optim.AdamW(model.parameters(), lr=LR, **{args.optimizer: True})
        self.loss = None

    def step(self, step: int) -> list[tuple[float, float]]:
        """One training step; the (wall, CPU) seconds at each phase's end, from its start."""
        dist.barrier()
        marks = [_now()]
        inputs = self.step_inputs(step)
        marks.append(_now())
        self.loss = self.model(*inputs)
        marks.append(_now())
        self.loss.backward()
        marks.append(_now())
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), CLIP)
        marks.append(_now())
        self.opt.step()
        marks.append(_now())
        self.opt.zero_grad()
        marks.append(_now())
        return marks

    def last_loss(self, world: int) -> float:
        # DDP and FSDP2 losses are this rank's half of the batch: average them over the ranks.
        loss = self.loss.detach().clone()
        if self.torch:
            dist.all_reduce(loss)
            loss /= world
        return loss.item()


def _speed_worker(rank: int, world: int, port: int, modes: tuple[str, ...], args, results) -> None:
    """Runs ``modes`` step by step, each in turn (the order alternating from step to step), so
    that a machine whose speed drifts slows them alike."""
    _join(rank, world, port)
    loops = [_Loop(mode, rank, world, args) for mode in modes]
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    # Per phase, the wall and this thread's CPU seconds of each timed step (``--phases``).
    phases = {mode: {name: [] for name in PHASES} for mode in modes}
    for step in range(args.warmup + args.steps):
        for loop in (loops if step % 2 == 0 else loops[::-1]):
            marks = loop.step(step)
            times[loop.mode].append(marks[-1][0] - marks[0][0])
            if step >= args.warmup:
                for name, (w0, c0), (w1, c1) in zip(PHASES, marks[:-1], marks[1:], strict=True):
                    phases[loop.mode][name].append((w1 - w0, c1 - c0))
    for loop in loops:
        # The median step: one step stalled by another process on a shared machine does not count.
        per_phase = {name: tuple(statistics.median(x) for x in zip(*v, strict=True))
                     for name, v in phases[loop.mode].items()}
        results[(loop.mode, rank)] = (times[loop.mode][args.warmup:], loop.last_loss(world), per_phase)
    dist.destroy_process_group()


def _memory_worker(rank: int, world: int, port: int, args, results) -> None:
    from shardwise.train import meta_inputs, parallelize
    from shardwise.train.models import build_model

    _join(rank, world, port)
    t0 = time.perf_counter()
    module, spec = build_model(args.mem_model, layers=args.mem_layers, batch=args.mem_batch, seq=args.mem_seq)
    size = sum(p.numel() * p.element_size() for p in module.parameters())
    example = meta_inputs(spec)
    pm = parallelize(module, str(world), example, plan="fsdp", time_limit_s=120)
    if args.weights_file:
        pm.load_weights(args.weights_file)
    else:
        pm.init_weights(0)
    local = sum(p.to_local().numel() * p.element_size() for p in pm.parameters())
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    results[rank] = (size, local, rss, time.perf_counter() - t0)
    dist.destroy_process_group()


def _pairs(modes: list[str], compiled: bool) -> list[tuple[str, str]]:
    """(shardwise loop, PyTorch loop) pairs among ``modes``."""
    pairs = [("shardwise-fsdp", "torch-fsdp2"), ("shardwise-ddp", "torch-ddp")]
    if compiled:
        pairs += [(a + COMPILED, b + c) for a, b in pairs[:2] for c in ("", COMPILED)]
    return [pair for pair in pairs if set(pair) <= set(modes)]


def speed(args) -> None:
    print(f"\n{args.model}, {args.layers} layers, batch {args.batch} x {args.seq}, fp32, 2 gloo ranks, "
          f"{args.steps} timed steps after {args.warmup}, best of {args.rounds} rounds")
    print(f"{'loop':<24} {'step_ms':>9} {'tokens/s':>10} {'last_loss':>10}")
    modes = [*args.loops, *(m + COMPILED for m in args.loops if args.compile)]
    pairs = _pairs(modes, args.compile)
    # Each pair runs in one pair of processes, step by step in turn; a loop in no pair alone (a
    # compiled shardwise loop is paired with the eager PyTorch one only in the ratios below).
    runs = [pair for pair in pairs if pair[0].endswith(COMPILED) == pair[1].endswith(COMPILED)]
    runs = [run for i, run in enumerate(runs) if not set(run) & {m for r in runs[:i] for m in r}]
    runs += [(m,) for m in modes if not any(m in run for run in runs)]
    # Each loop's step times in every round (per step, the slower rank's).
    steps: dict[str, list[list[float]]] = {}
    losses: dict[str, float] = {}
    best_phases: dict[str, dict[str, tuple[float, float]]] = {}
    # Rounds repeat the runs, so a load that drifts on a shared machine touches them all.
    for _ in range(args.rounds):
        for run in runs:
            results = mp.Manager().dict()
            mp.spawn(_speed_worker, args=(2, _free_port(), run, args, results), nprocs=2, join=True)
            for mode in run:
                per_step = [max(ts) for ts in zip(results[(mode, 0)][0], results[(mode, 1)][0], strict=True)]
                slower = max(range(2), key=lambda r: statistics.median(results[(mode, r)][0]))
                _, losses[mode], per_phase = results[(mode, slower)]
                if statistics.median(per_step) < min(map(statistics.median, steps.get(mode, [[math.inf]]))):
                    best_phases[mode] = per_phase
                steps.setdefault(mode, []).append(per_step)
    rows = {}
    for mode in modes:
        best = min(map(statistics.median, steps[mode]))
        rows[mode] = args.batch * args.seq / best
        print(f"{mode:<24} {best * 1e3:>9.1f} {rows[mode]:>10,.0f} {losses[mode]:>10.4f}")
    for ours, theirs in pairs:
        line = f"{ours} / {theirs}: {rows[ours] / rows[theirs]:.2f}x tokens/s (best of rounds)"
        if any(ours in run and theirs in run for run in runs):
            # Step by step in one pair of processes: the ratio of each step to its partner's,
            # the median of each round's, their median and range.
            per_round = sorted(statistics.median(t / o for o, t in zip(so, st, strict=True))
                               for so, st in zip(steps[ours], steps[theirs], strict=True))
            line += (f"; step by step, median {statistics.median(per_round):.2f}x "
                     f"(rounds {per_round[0]:.2f}-{per_round[-1]:.2f}x)")
        print(line)
    if args.phases:
        _print_phases(modes, best_phases)


def _print_phases(modes: list[str], best_phases: dict[str, dict[str, tuple[float, float]]]) -> None:
    """Each loop's step by phase (the slower rank of its best round, median over the timed
    steps), wall / this thread's CPU in ms. ``model`` is shardwise's whole planned step (forward
    and backward, its collectives included) but DDP's and FSDP2's forward alone; their backward
    is ``backward``, where shardwise only hands out the gradients it already has."""
    print("per phase, wall/cpu ms (cpu: the training thread alone; the rest of wall is waiting)")
    print(f"{'loop':<24}" + "".join(f"{name:>14}" for name in PHASES))
    for mode in modes:
        cells = "".join(f"{w * 1e3:>8.2f}/{c * 1e3:<5.2f}" for w, c in (best_phases[mode][n] for n in PHASES))
        print(f"{mode:<24}{cells}")


def _write_weights(args, path: str) -> None:
    """``init_weights(0)``'s values of the memory case's model as one safetensors file."""
    from safetensors.torch import save_file

    from shardwise.train.models import build_model
    from shardwise.train.module import init_state_dict

    module, _ = build_model(args.mem_model, layers=args.mem_layers, batch=args.mem_batch, seq=args.mem_seq)
    save_file(init_state_dict({k: (tuple(p.shape), p.dtype) for k, p in module.named_parameters()}, 0), path)


def memory(args) -> None:
    import tempfile

    world = 4
    results = mp.Manager().dict()
    with tempfile.TemporaryDirectory(prefix="shardwise-weights-") as tmp:
        args.weights_file = None
        if args.mem_weights:
            args.weights_file = str(Path(tmp) / "model.safetensors")
            # Written by a process of its own: Linux keeps a process's peak RSS across fork and
            # exec, so ranks spawned from a parent that had held the whole model would report it.
            writer = mp.get_context("spawn").Process(target=_write_weights, args=(args, args.weights_file))
            writer.start()
            writer.join()
        mp.spawn(_memory_worker, args=(world, _free_port(), args, results), nprocs=world, join=True)
    then = "load_weights from a safetensors file" if args.mem_weights else "init_weights"
    print(f"\nparallelize({args.mem_model}, {args.mem_layers} layers, on meta) over {world} gloo ranks, "
          f"fsdp plan, then {then}")
    print(f"{'rank':>4} {'model_GiB':>10} {'local_params_GiB':>17} {'peak_rss_GiB':>13} {'rss/model':>10} "
          f"{'wall_s':>7}")
    for r in range(world):
        size, local, rss, wall = results[r]
        print(f"{r:>4} {size / 2**30:>10.2f} {local / 2**30:>17.2f} {rss / 2**30:>13.2f} {rss / size:>10.2f} "
              f"{wall:>7.1f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default=",".join(DEFAULT_CASES),
                   help="MODEL:BATCHxSEQ,... (4 layers each, unless --layers)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--optimizer", choices=("fused", "foreach"), default="fused",
                   help="AdamW implementation, the same for every loop")
    p.add_argument("--mem-model", default="llama3-8b")
    p.add_argument("--mem-layers", type=int, default=4)
    p.add_argument("--mem-batch", type=int, default=4)
    p.add_argument("--mem-seq", type=int, default=256)
    p.add_argument("--mem-weights", action="store_true",
                   help="the memory case loads its weights from a safetensors file instead of init_weights")
    p.add_argument("--loops", default=",".join(MODES), help=f"which of {','.join(MODES)} to run")
    p.add_argument("--compile", action="store_true", help="also run every loop through torch.compile")
    p.add_argument("--phases", action="store_true",
                   help="also print each loop's step by phase (wall and CPU ms)")
    p.add_argument("--skip-memory", action="store_true")
    p.add_argument("--skip-speed", action="store_true")
    args = p.parse_args()
    try:
        cases = [_parse_case(c) for c in args.models.split(",") if c.strip()]
    except ValueError:
        p.error("--models takes MODEL:BATCHxSEQ,... with an even batch (two ranks)")
    args.loops = [m.strip() for m in args.loops.split(",") if m.strip()]
    if not args.loops or not set(args.loops) <= set(MODES):
        p.error(f"--loops takes some of {','.join(MODES)}")
    if args.steps <= 0:
        p.error("--steps must be positive")
    if not args.skip_speed:
        for args.model, args.batch, args.seq in cases:
            speed(args)
    if not args.skip_memory:
        memory(args)


if __name__ == "__main__":
    main()
