"""Predicted collective bandwidth vs the public H100 figures (shared/reference/figures.md).

    .venv/bin/python benchmarks/collectives.py [--hardware h100] [--bytes 1GiB]

Prints, for all_gather / reduce_scatter / all_reduce at 2, 4 and 8 ranks in one node (and
all_to_all at 8), the predicted time, algorithm, protocol, algbw and busbw next to the figure's
algbw, and the small-message times next to the latency floors. Target: algbw within +-20%,
8 KiB all_reduce on 8 ranks within 2x of its floor. Then a few cross-node cases.
"""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table

from shardwise.cost.comm import collective_time
from shardwise.cost.hardware import get_hardware
from shardwise.cost.units import parse_bytes
from shardwise.ir.match import CollectiveKind as K

# figures.md, H100 SXM, 8 GPUs on NVSwitch, 1 GB: (algbw GB/s, latency floor us) per ranks.
FIGURES = {
    K.ALL_GATHER: {2: (537, 8), 4: (434, 17), 8: (394, 30)},
    K.REDUCE_SCATTER: {2: (537, 8), 4: (434, 17), 8: (394, 30)},
    K.ALL_REDUCE: {2: (324, 10), 4: (236, 15), 8: (267, 31)},
    K.ALL_TO_ALL: {8: (380, 50)},
}
SMALL = 8 * 1024  # the message size of the latency comparison


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hardware", default="h100")
    ap.add_argument("--bytes", default="1GiB")
    args = ap.parse_args()
    hw = get_hardware(args.hardware)
    size = parse_bytes(args.bytes)
    console = Console(width=160)

    t = Table(title=f"{hw.name}: one node, {args.bytes} (bandwidth) and 8 KiB (latency) vs figures.md")
    for col in ("collective", "ranks", "algorithm", "protocol", "time us", "algbw GB/s", "figure",
                "ratio", "busbw GB/s", "8KiB us", "floor us", "ratio"):
        t.add_column(col, justify="right")
    for kind, rows in FIGURES.items():
        for ranks, (algbw, floor_us) in rows.items():
            big = collective_time(kind, size, ranks, hw)
            small = collective_time(kind, SMALL, ranks, hw)
            t.add_row(kind.value, str(ranks), big.algorithm, big.protocol, f"{big.time_s * 1e6:.0f}",
                      f"{big.algbw_GBps:.0f}", str(algbw), f"{big.algbw_GBps / algbw:.2f}",
                      f"{big.busbw_GBps:.0f}", f"{small.time_s * 1e6:.1f}", str(floor_us),
                      f"{small.time_s * 1e6 / floor_us:.2f}")
    console.print(t)

    nic_gbps = hw.inter_bw / 1e9
    t = Table(title=f"{hw.name}: groups across nodes, {args.bytes} (NIC {nic_gbps:.0f} GB/s per GPU)")
    for col in ("collective", "ranks", "nodes", "algorithm", "protocol", "time us", "algbw GB/s",
                "busbw GB/s", "busbw per NIC"):
        t.add_column(col, justify="right")
    for kind in (K.ALL_REDUCE, K.ALL_GATHER, K.ALL_TO_ALL):
        for ranks, nodes in ((8, 1), (8, 2), (16, 2), (8, 8), (64, 8)):
            e = collective_time(kind, size, ranks, hw, nodes)
            per_node = max(1, ranks // nodes)
            # ring-like collectives put all of a node's group traffic through its NICs
            nic = f"{e.busbw_GBps / per_node:.1f}" if nodes > 1 and kind is not K.ALL_TO_ALL else "-"
            t.add_row(kind.value, str(ranks), str(nodes), e.algorithm, e.protocol, f"{e.time_s * 1e6:.0f}",
                      f"{e.algbw_GBps:.0f}", f"{e.busbw_GBps:.0f}", nic)
    console.print(t)


if __name__ == "__main__":
    main()
