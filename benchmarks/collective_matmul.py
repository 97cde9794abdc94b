"""Fused (ring-overlapped) vs unfused collective-matmul: measured on gloo, predicted on a GPU spec.

    .venv/bin/python benchmarks/collective_matmul.py [--ranks 2] [--iters 5] [--gpu]

1. gloo, ``--ranks`` processes on this machine (one thread each): for a few sizes, the time of
   ``shardwise::all_gather_matmul`` and ``shardwise::matmul_reduce_scatter`` with the ring
   implementation (P2P transfers overlapped with per-chunk matmuls) against the unfused one (c10d
   collective, then the matmul). No speed target on CPU: gloo's transfers are memory copies
   competing with the matmuls for the same cores.
2. The cost model's view on ``--hardware`` (default h100, 8 ranks): unfused vs overlapped time.
3. ``--gpu`` (where a CUDA device is present): the single-GPU part of the decomposition, one
   matmul against the same matmul cut into W chunks (what the ring computes), measured, next to the
   roofline prediction for one chunk.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rich.console import Console
from rich.table import Table

# (rows per rank, K, N): sizes of an fp32 matmul on CPU whose work and traffic are both visible.
CPU_SIZES = [(128, 512, 512), (256, 1024, 1024), (512, 1024, 2048)]
# (rows, K, N) of a bf16 projection on a GPU (a LLaMA-8B-class hidden size and a tokens slab).
GPU_SIZES = [(4096, 4096, 4096), (8192, 4096, 14336), (16384, 8192, 8192)]
WARMUP = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _time(fn, iters: int) -> float:
    """Median seconds of ``fn`` over ``iters`` runs (all ranks start each run together)."""
    for _ in range(WARMUP):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _worker(rank: int, ranks: int, port: int, iters: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", rank=rank, world_size=ranks)
    import shardwise.ir.ops  # noqa: F401
    from shardwise.runtime.collective_matmul import Impl, collective_matmul_impl

    group = dist.group.WORLD.group_name
    agm, mrs = torch.ops.shardwise.all_gather_matmul, torch.ops.shardwise.matmul_reduce_scatter
    rows = []
    for m, k, n in CPU_SIZES:
        a, b = torch.randn(m, k), torch.randn(k, n)
        a_full = torch.randn(m * ranks, k)
        for name, fn in (("all_gather_matmul", lambda a=a, b=b: agm(a, [b], 0, group, ranks)),
                         ("matmul_reduce_scatter", lambda a=a_full, b=b: mrs(a, b, 0, "sum", group, ranks))):
            measured = {}
            for impl in (Impl.UNFUSED, Impl.RING):
                with collective_matmul_impl(impl):
                    measured[impl] = _time(fn, iters)
            rows.append((name, m, k, n, measured[Impl.UNFUSED], measured[Impl.RING]))
    if rank == 0:
        results["rows"] = rows
    dist.destroy_process_group()


def gloo_table(ranks: int, iters: int) -> Table:
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(ranks, _free_port(), iters, results), nprocs=ranks, join=True)
    t = Table(title=f"gloo, {ranks} ranks, fp32, 1 thread per rank: median of {iters} runs")
    for col in ("op", "rows/rank", "K", "N", "unfused ms", "ring ms", "unfused / ring"):
        t.add_column(col, justify="right")
    for name, m, k, n, unfused, ring in results["rows"]:
        t.add_row(name, str(m), str(k), str(n), f"{unfused * 1e3:.2f}", f"{ring * 1e3:.2f}",
                  f"{unfused / ring:.2f}")
    return t


def model_table(hardware: str, ranks: int) -> Table:
    from shardwise.cost.hardware import get_hardware
    from shardwise.cost.overlap import all_gather_matmul_estimate, matmul_reduce_scatter_estimate

    hw = get_hardware(hardware)
    t = Table(title=f"cost model, {hw.name}, {ranks} ranks in one node, bf16")
    for col in ("op", "rows", "K", "N", "comm us", "compute us", "unfused us", "fused us", "speedup"):
        t.add_column(col, justify="right")
    for m, k, n in GPU_SIZES:
        dtype = torch.bfloat16
        for name, est in (
            ("all_gather_matmul", all_gather_matmul_estimate((m, k), [n], 0, ranks, dtype, hw)),
            ("matmul_reduce_scatter", matmul_reduce_scatter_estimate((m, k), n, 0, ranks, dtype, hw)),
        ):
            us = [f"{x * 1e6:.0f}" for x in (est.comm_s, est.compute_s, est.unfused_s, est.time_s)]
            t.add_row(name, str(m), str(k), str(n), *us, f"{est.unfused_s / est.time_s:.2f}")
    return t


def _cuda_time(fn, iters: int) -> float:
    for _ in range(WARMUP):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def gpu_table(hardware: str, iters: int) -> Table:
    from shardwise.cost.compute import matmul_estimate
    from shardwise.cost.hardware import get_hardware

    hw = get_hardware(hardware)
    t = Table(title=f"{torch.cuda.get_device_name()}: one matmul vs the ring's W chunks, bf16, "
                    f"predicted on {hw.name}")
    for col in ("rows", "K", "N", "W", "whole ms", "W chunks ms", "chunks / whole", "chunk ms",
                "predicted chunk ms", "measured / predicted"):
        t.add_column(col, justify="right")
    for m, k, n in GPU_SIZES:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        whole = _cuda_time(lambda a=a, b=b: a @ b, iters)
        for w in (2, 4, 8):
            pieces = a.chunk(w)
            chunks = _cuda_time(lambda pieces=pieces, b=b: [p @ b for p in pieces], iters)
            pred = matmul_estimate(m // w, k, n, torch.bfloat16, hw).time_s
            t.add_row(str(m), str(k), str(n), str(w), f"{whole * 1e3:.3f}", f"{chunks * 1e3:.3f}",
                      f"{chunks / whole:.2f}", f"{chunks / w * 1e3:.3f}", f"{pred * 1e3:.3f}",
                      f"{chunks / w / pred:.2f}")
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--hardware", default="h100")
    ap.add_argument("--model-ranks", type=int, default=8)
    ap.add_argument("--gpu", action="store_true", help="also run the single-GPU part (needs CUDA)")
    ap.add_argument("--no-gloo", action="store_true", help="skip the multi-process gloo part")
    args = ap.parse_args()
    console = Console(width=160)
    if not args.no_gloo:
        console.print(gloo_table(args.ranks, args.iters))
    console.print(model_table(args.hardware, args.model_ranks))
    if args.gpu:
        if not torch.cuda.is_available():
            console.print("--gpu: no CUDA device here; skipped.")
        else:
            console.print(gpu_table(args.hardware, max(args.iters, 20)))


if __name__ == "__main__":
    main()
