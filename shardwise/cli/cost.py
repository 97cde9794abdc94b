"""``shardwise cost``: what one collective or one matmul costs on a hardware spec.

    shardwise cost --collective all_reduce --bytes 1GiB --ranks 8 [--nodes 1] --hardware h100 [--json]
        -> {"time_s", "algorithm", "protocol", "algbw_GBps", "busbw_GBps"}
    shardwise cost --matmul 8192x8192x8192 --dtype bf16 --hardware h100 [--json]
        -> {"time_s", "flops", "bytes", "bound": "compute" | "memory"}

Human output is a rich table. Sizes take units (``512``, ``8KiB``, ``1GiB``, ``1GB``).
"""

from __future__ import annotations

import argparse
import re

from shardwise.errors import UserError

DTYPES = ("bf16", "fp16", "fp32")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cost", help="predict the time of one collective or one matmul on a hardware spec")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--collective",
                      help="all_reduce | all_gather | reduce_scatter | all_to_all | broadcast")
    what.add_argument("--matmul", metavar="MxKxN", help="a [M,K] @ [K,N] matmul, e.g. 8192x8192x8192")
    p.add_argument("--bytes", default="1GiB",
                   help="collective size, nccl-tests convention (all_gather: output, reduce_scatter: input)")
    p.add_argument("--ranks", type=int, default=8, help="ranks in the group")
    p.add_argument("--nodes", type=int, default=1, help="nodes the group spans")
    p.add_argument("--dtype", choices=DTYPES, default="bf16", help="matmul dtype")
    p.add_argument("--hardware", default="h100", help="h100 | h200 | a100 | b200 | cpu | path/to/spec.toml")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(handler=run)


def parse_matmul(text: str) -> tuple[int, int, int]:
    m = re.fullmatch(r"\s*(\d+)\s*x\s*(\d+)\s*x\s*(\d+)\s*", text)
    if m is None or any(int(g) < 1 for g in m.groups()):
        raise UserError(f"matmul {text!r} is malformed; write MxKxN with positive sizes, "
                        "e.g. 8192x8192x8192.")
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


def run(args: argparse.Namespace) -> dict:
    from shardwise.cost.hardware import get_hardware

    hw = get_hardware(args.hardware)
    if args.collective is not None:
        return _collective(args, hw)
    return _matmul(args, hw)


def _collective(args: argparse.Namespace, hw) -> dict:
    from shardwise.cost.comm import collective_time, parse_kind
    from shardwise.cost.units import parse_bytes

    kind = parse_kind(args.collective)
    nbytes = parse_bytes(args.bytes)
    est = collective_time(kind, nbytes, args.ranks, hw, args.nodes)
    result = {"time_s": est.time_s, "algorithm": est.algorithm, "protocol": est.protocol,
              "algbw_GBps": est.algbw_GBps, "busbw_GBps": est.busbw_GBps}
    if not args.json:
        from shardwise.cost.units import format_bytes

        title = (f"{kind.value} of {format_bytes(nbytes)} over {args.ranks} ranks on {args.nodes} node(s), "
                 f"{hw.name}")
        _table(title, [("time", f"{est.time_s * 1e6:.1f} us"), ("algorithm", est.algorithm),
                       ("protocol", est.protocol), ("algorithm bandwidth", f"{est.algbw_GBps:.1f} GB/s"),
                       ("bus bandwidth", f"{est.busbw_GBps:.1f} GB/s")])
    return result


def _matmul(args: argparse.Namespace, hw) -> dict:
    from shardwise.cost.compute import matmul_estimate

    m, k, n = parse_matmul(args.matmul)
    est = matmul_estimate(m, k, n, args.dtype, hw)
    result = {"time_s": est.time_s, "flops": est.flops, "bytes": est.bytes, "bound": est.bound.value}
    if not args.json:
        from shardwise.cost.units import format_bytes

        rate = est.flops / est.time_s / 1e12
        _table(f"{m}x{k}x{n} {args.dtype} matmul, {hw.name}",
               [("time", f"{est.time_s * 1e6:.1f} us"), ("FLOPs", f"{est.flops:.4g}"),
                ("bytes", format_bytes(est.bytes)), ("bound", est.bound.value),
                ("achieved", f"{rate:.0f} TFLOP/s")])
    return result


def _table(title: str, rows: list[tuple[str, str]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, show_header=False, min_width=len(title) + 2)
    table.add_column(style="bold")
    table.add_column(justify="right")
    for k, v in rows:
        table.add_row(k, v)
    Console().print(table)
