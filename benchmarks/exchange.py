"""gloo's all_reduce against the pairwise exchange of ``runtime/exchange.py``, on 2 local ranks.

For each buffer size (a small model's gradient buckets are 0.1-1 MiB), the mean wall time of a
blocking ``dist.all_reduce`` and of ``exchange.start`` + ``exchange.finish`` (one isend/irecv
round and an add), and their ratio.

    .venv/bin/python benchmarks/exchange.py [--sizes-kib 64,256,706,4096,16384] [--iters 20]
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _mean_ms(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters * 1e3


def _worker(rank: int, port: int, sizes_kib: list[int], iters: int, results) -> None:
    from shardwise.runtime import exchange

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    name = dist.group.WORLD.group_name
    for kib in sizes_kib:
        x = torch.randn(kib * 1024 // 4)
        gloo = _mean_ms(lambda x=x: dist.all_reduce(x), iters)
        pairwise = _mean_ms(lambda x=x: exchange.finish(exchange.start(x, "sum", name, True, 0)), iters)
        results[(rank, kib)] = (gloo, pairwise)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes-kib", default="64,256,706,4096,16384")
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()
    sizes = [int(s) for s in args.sizes_kib.split(",")]
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(_free_port(), sizes, args.iters, results), nprocs=2, join=True)
    print(f"{'KiB':>8} {'all_reduce_ms':>14} {'exchange_ms':>12} {'speedup':>8}")
    for kib in sizes:
        gloo = max(results[(r, kib)][0] for r in range(2))
        pairwise = max(results[(r, kib)][1] for r in range(2))
        print(f"{kib:>8} {gloo:>14.2f} {pairwise:>12.2f} {gloo / pairwise:>7.2f}x")


if __name__ == "__main__":
    main()
