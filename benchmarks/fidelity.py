"""Does the step estimate reproduce published training measurements?

    .venv/bin/python benchmarks/fidelity.py [--hardware h100-96gb] [--fit]

Rows (torchtitan, Llama 3.1, bf16, sequence 8192, H100 96 GB at 500 W, 8 per host; figures.md):

- 8B, 8 GPUs, FSDP, local batch 2, selective AC: 5,762 tokens/s/GPU eager, 6,667 compiled; peak
  memory 82.4 GiB eager, 77.0 GiB compiled;
- 8B, 64 GPUs, FSDP 8 x TP 8, local batch 12, selective AC, compiled: 4,378; 4,809 with async TP;
- 70B, 256 GPUs, FSDP 32 x TP 8, local batch 16, full AC, compiled: 597.3; 652.4 with async TP.

Each row is estimated by the same code as ``shardwise estimate``: the hand plan (``fsdp`` or
``fsdp_tp_sp``) traced on fake tensors, laid out on streams (``cost/schedule.py``) with
torchtitan's mixed precision. The 70B rows are not traced at 80 layers: 3 and 5 layers are
traced and planned (identical layers, clustered) and the step extrapolated linearly per layer
(``cost/step.py`` says why that is exact for repeating layers); the 8B rows trace all 32.

One hardware spec (``h100-96gb``) and one set of efficiencies for every row, no constant per row.
How they were fitted (``--fit`` reruns it): the spec's bandwidths, capacities and NCCL
efficiencies are the published values or the SXM part's; two efficiencies are free,
``compute_eff`` (sustained GEMM and attention rate as a fraction of the 989 TFLOP/s bf16 peak,
lowered by the 500 W power limit) and ``mem_eff`` (sustained fraction of 2.4 TB/s HBM2e in
memory-bound kernels). A grid search (``COMPUTE_EFF_GRID`` x ``MEM_EFF_GRID``) picks the pair
that minimises the largest |log(estimated / measured)| over three rows: 8B 8-GPU eager and
compiled (compute-bound, FSDP communication hidden: they pin the GEMM rate and, through their
difference, the memory-bound rate) and 70B 256-GPU without async TP. It found compute_eff 0.48
and mem_eff 0.7 (worst fitted ratio 1.070). Not fitted on: the 8B 64-GPU rows (vanilla and async
TP), the 70B async-TP row, the two memory rows, and the held-out rows below.

Peak memory falls short of the published figures (about 0.7 of them) and nothing is fitted to
close it: the schedule counts the tensors alive at each point (what the caching allocator has
allocated: fp32 master weights and Adam state, gradients from their reduction on, saved
activations, gathered parameters, transients such as the 8 GiB fp32 loss tensors), while
torchtitan reports the allocator's peak reserved bytes, which add its fragmentation and cached
blocks, and buffers the schedule does not model (NCCL's, FSDP2's reduce-scatter staging).

Other published measurements, not fitted on (torchtitan docs/performance.md, 64 A100 80GB,
Llama 3 8B local batch 1 selective AC, 70B local batch 1 full AC, FSDP, eager: 2,904 and 331
tokens/s/GPU) are estimated with the ``a100`` spec as it stands in the repository.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import math
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from shardwise.cost.hardware import get_hardware, with_overrides
from shardwise.cost.step import PERIOD, StepEstimate, estimate_prepared, plan_for
from shardwise.ir.trace import trace_model
from shardwise.mesh import parse_mesh
from shardwise.passes.pipeline import canonicalize
from shardwise.passes.remat import ACPolicy

SEQ = 8192
GIB = 2**30
TOLERANCE = (0.85, 1.15)  # issue 14's acceptance band for estimated / measured
# The fit's grid (``--fit``): sustained fractions of peak GEMM rate and of HBM bandwidth.
COMPUTE_EFF_GRID = (0.40, 0.44, 0.48, 0.52, 0.56, 0.60, 0.64)
MEM_EFF_GRID = (0.5, 0.6, 0.7, 0.8, 0.9)
TABLE_WIDTH = 170


@dataclass(frozen=True)
class Config:
    model: str
    mesh: str
    names: str | None
    plan: str
    batch: int        # global batch (local batch x data-parallel ranks)
    layers: int
    extrapolate_from: int | None = None


@dataclass(frozen=True)
class Row:
    label: str
    config: Config
    ac: ACPolicy
    compile: bool
    async_tp: bool
    measured: float
    metric: str = "tokens/s/GPU"  # or "GiB" (peak memory per GPU)
    fitted: bool = False
    hardware: str = "h100-96gb"


C8 = Config("llama3-8b", "8", None, "fsdp", 2 * 8, 32)
C64 = Config("llama3-8b", "8x8", "dp,tp", "fsdp_tp_sp", 12 * 8, 32)
C256 = Config("llama3-70b", "32x8", "dp,tp", "fsdp_tp_sp", 16 * 32, 80, extrapolate_from=3)
A8 = Config("llama3-8b", "64", None, "fsdp", 64, 32)
A70 = Config("llama3-70b", "64", None, "fsdp", 64, 80, extrapolate_from=3)
SEL, FULL = ACPolicy.SELECTIVE, ACPolicy.FULL

ROWS = [
    Row("8B 8 GPU FSDP lb2 sel-AC eager", C8, SEL, False, False, 5762, fitted=True),
    Row("8B 8 GPU FSDP lb2 sel-AC compiled", C8, SEL, True, False, 6667, fitted=True),
    Row("8B 8 GPU FSDP lb2 sel-AC eager: peak memory", C8, SEL, False, False, 82.4, "GiB"),
    Row("8B 8 GPU FSDP lb2 sel-AC compiled: peak memory", C8, SEL, True, False, 77.0, "GiB"),
    Row("8B 64 GPU FSDP8xTP8 lb12 sel-AC compiled", C64, SEL, True, False, 4378),
    Row("8B 64 GPU FSDP8xTP8 lb12 sel-AC compiled async TP", C64, SEL, True, True, 4809),
    Row("70B 256 GPU FSDP32xTP8 lb16 full-AC compiled", C256, FULL, True, False, 597.3, fitted=True),
    Row("70B 256 GPU FSDP32xTP8 lb16 full-AC compiled async TP", C256, FULL, True, True, 652.4),
]
# Held out: another accelerator, published in torchtitan's docs (eager, 64 A100 80GB, FSDP).
HELD_OUT = [
    Row("A100: 8B 64 GPU FSDP lb1 sel-AC eager", A8, SEL, False, False, 2904, hardware="a100"),
    Row("A100: 70B 64 GPU FSDP lb1 full-AC eager", A70, FULL, False, False, 331, hardware="a100"),
]


@functools.cache
def prepared(cfg: Config, hardware: str):
    """Traced and planned graphs of ``cfg`` (two depths when extrapolated)."""
    mesh = parse_mesh(cfg.mesh, cfg.names, hardware)
    k = cfg.extrapolate_from
    depths = [cfg.layers] if k is None else [k, k + PERIOD]
    out = []
    for n in depths:
        traced = trace_model(cfg.model, layers=n, batch=cfg.batch, seq=SEQ, dtype="bf16")
        canonicalize(traced)
        out.append((traced, plan_for(traced, mesh, cfg.plan)))
    return mesh, out


def estimate(row: Row, hw) -> StepEstimate:
    mesh, prep = prepared(row.config, row.hardware)
    opts = {"ac": row.ac, "compile": row.compile, "async_tp": row.async_tp}
    return estimate_prepared(prep, row.config.layers, row.config.batch * SEQ, mesh, hw, opts)


def value(row: Row, est: StepEstimate) -> float:
    return est.memory_per_device_bytes / GIB if row.metric == "GiB" else est.tokens_per_s_per_device


def fit(base) -> dict[str, float]:
    """Grid search of (compute_eff, mem_eff) on the fitted rows (see the module docstring)."""
    rows = [r for r in ROWS if r.fitted]
    best = None
    for ce, me in itertools.product(COMPUTE_EFF_GRID, MEM_EFF_GRID):
        hw = with_overrides(base, compute_eff=ce, mem_eff=me)
        worst = max(abs(math.log(value(r, estimate(r, hw)) / r.measured)) for r in rows)
        if best is None or worst < best[0]:
            best = (worst, ce, me)
    return {"compute_eff": best[1], "mem_eff": best[2], "worst_ratio": math.exp(best[0])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hardware", default="h100-96gb")
    ap.add_argument("--fit", action="store_true", help="rerun the fit of compute_eff and mem_eff")
    args = ap.parse_args()
    hw = get_hardware(args.hardware)
    con = Console(width=TABLE_WIDTH)
    if args.fit:
        con.print(f"fit on the rows marked fitted: {fit(hw)}")
    t = Table(title=f"fidelity: estimate vs published ({hw.name}: compute_eff {hw.compute_eff}, "
                    f"mem_eff {hw.mem_eff})")
    for col in ("configuration", "metric", "measured", "estimated", "ratio", "fitted on", "in 0.85-1.15"):
        t.add_column(col)
    for row in [*ROWS, *HELD_OUT]:
        r_hw = hw if row.hardware == args.hardware else get_hardware(row.hardware)
        est = estimate(row, r_hw)
        v = value(row, est)
        ratio = v / row.measured
        ok = TOLERANCE[0] <= ratio <= TOLERANCE[1]
        t.add_row(row.label, row.metric, f"{row.measured:,.1f}", f"{v:,.1f}", f"{ratio:.3f}",
                  "yes" if row.fitted else "no", "yes" if ok else "[red]NO[/]")
    con.print(t)


if __name__ == "__main__":
    main()
