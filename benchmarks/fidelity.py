"""Does the step estimate reproduce published training measurements?

    .venv/bin/python benchmarks/fidelity.py [--hardware h100-96gb] [--fit] [--memory]

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

Since the fsdp_tp_sp plan gathers a column-parallel weight's tp shard over dp, as FSDP2's strided
shard does (``plan/baselines._fsdp_of_tp_shard``; it gathered the whole weight), the tensor-parallel
rows read 1.025 (8B 64 GPU; 0.994 before), 1.114 (async TP; 1.072), 1.020 (70B 256 GPU; 0.976) and
1.085 (async TP; 1.031); the fitted rows' worst ratio is 1.047, inside the band: the fit was not
run again.

Async TP fuses a tensor-parallel all_gather only with the matmuls that read the gathered value as
their left operand, as PyTorch's micro-pipeline pass does (``ir.match.matmuls_reading``):
their rows split into the ring's chunks. The schedule had hidden the ring behind every matmul
reading the value in the phase, the weight gradients too (which sum over the gathered rows and
read the gathered copy after the ring, or the shard without it), and a recomputed gather behind
the backward's weight gradients rather than the recomputed matmuls. Since: the async-TP rows 1.118
-> 1.103 (8B 64 GPU) and 1.088 -> 1.084 (70B 256 GPU); every other row the same. The model still
hides more than torchtitan measured: 0.41 s a step against 0.25 s (8B), 3.66 s against 2.32 s
(70B). What it leaves out, and not measured here: the decomposed matmuls' own efficiency (a
W-th of the rows each), and the copy engines' transfers beside the matmuls.

Peak memory. torchtitan reports ``torch.cuda.max_memory_reserved`` (its DeviceMemoryMonitor's
``max_reserved_gib``), with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` set by its launch
script. The estimate has no constant for it: the schedule lays every buffer of the step out in
time (``cost/schedule.py``: who allocates it, on which stream, until its last reader) and
replays them, three steps long, through a simulation of PyTorch's caching allocator
(``cost/allocator.py``); the reserved peak it ends with is the figure (``--memory`` prints the
audit below, with the classic allocator's figure next to it).

The audit of the allocated peak, 8B on 8 GPUs, local batch 2 x 8192 = 16,384 tokens, eager
(``--memory`` prints each line from the schedule): the peak is in the loss's backward
(``_log_softmax_backward_data``), where by hand

- static 11.2 GiB: 8.03 B parameters x (4 B fp32 master + 8 B Adam moments) / 8 ranks;
  gradients not yet (``zero_grad(set_to_none=True)``);
- saved activations 39.8 GiB: per layer under per-op SAC the block input (128 MiB), the kept
  matmul outputs wq, wv, w1, w2 (128 + 32 + 448 + 128 MiB: every second one recomputed, the
  7th kept although no backward reads it, since eager SAC caches what its policy saves until
  the block's recomputation), flash attention's output and logsumexp (130 MiB): 994 MiB x 32 =
  31.1 GiB; the head: the final norm's input and output, and log_softmax's fp32 output of the
  upcast logits [16384, 128256] (7.8 GiB);
- transients 15.7 GiB: nll_loss's fp32 gradient (7.8 GiB) and log_softmax's backward output
  (7.8 GiB);
- gathered parameters 2.4 GiB: the root's bf16 embedding and output weights (1 GiB each; FSDP2
  does not reshard the root after forward) and the last block (436 MiB; torchtitan does not
  reshard it either);

69.0 GiB, what the schedule finds. Compiled, 64.6 GiB: compiled blocks save only what their
backward reads (not w2's output, 4 GiB over the layers), the loss still runs eagerly (torchtitan
compiles each TransformerBlock). The reserved peak adds what the allocator holds but no tensor
uses at that moment: the reduce-scatter stream's pool (the fp32 gradient shards, 3.7 GiB, and
FSDP2's fp32 reduce-scatter inputs, up to the root's 2.2 GiB) which the compute stream cannot
reuse, the all-gather stream's pool, and the compute pool's blocks cached from other phases
of the step (the optimizer's foreach temporaries, the Adam moments made at the first step)
that the loss's 7.8 GiB buffers do not fit in. Rules fixed by the audit, each a faithful one:
attention's tuple outputs were freed at once; eager SAC's cached outputs were freed after
their forward reader; the root and last block were gathered again for the backward and
prefetched gathers allocated at their reader; unsharded gradients died at once with no
reduce-scatter staging; compiled runs fused the eager loss. Held out, never fitted: the same
run on 128 GPUs (torchtitan's docs, same hardware): 67.0 GiB eager, 62.0 compiled.

Known gap: the ``fsdp`` plan makes the embedding's gradient already sharded (it gathers the
activation gradient instead) where FSDP2 reduce-scatters it, so the root's reduce-scatter
input is 2.2 GiB instead of 3.9, at the end of the backward (not at the allocated peak; in the
reduce-scatter pool's reserve). The 128-GPU memory rows come out 5.5-7% high, the 8-GPU ones
0.3-1.3%: the difference between them, the sharded state (16 B per parameter / N ranks) and the
reduce-scatter pool, is 11.9 GiB estimated and 15.4 (eager), 15.0 (compiled) measured. The
replay's steady state: the first step alone reserves 75.6 GiB (8B, 8 GPUs, eager), since
Adam's moments, made at its end, take cached blocks the next step's activations then need;
the second and later steps reserve 83.4.

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
C128 = Config("llama3-8b", "128", None, "fsdp", 2 * 128, 32)
# Held out: torchtitan's docs (docs/performance.md, Table 3: 8B on 128 H100s, same hardware and
# settings as the 8-GPU rows), and another accelerator (eager, 64 A100 80GB, FSDP).
HELD_OUT = [
    Row("8B 128 GPU FSDP lb2 sel-AC eager", C128, SEL, False, False, 5605),
    Row("8B 128 GPU FSDP lb2 sel-AC compiled", C128, SEL, True, False, 6514),
    Row("8B 128 GPU FSDP lb2 sel-AC eager: peak memory", C128, SEL, False, False, 67.0, "GiB"),
    Row("8B 128 GPU FSDP lb2 sel-AC compiled: peak memory", C128, SEL, True, False, 62.0, "GiB"),
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


def estimate(row: Row, hw, **extra: object) -> StepEstimate:
    mesh, prep = prepared(row.config, row.hardware)
    opts = {"ac": row.ac, "compile": row.compile, "async_tp": row.async_tp, **extra}
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


def memory_audit(rows: list[Row], hw, con: Console) -> None:
    """Where each memory row's allocated peak is, what is alive there, and the reserved peak per
    stream pool (expandable segments, as torchtitan runs, and the classic allocator)."""
    t = Table(title="memory audit (GiB): allocated peak by category, reserved peak by allocator")
    for col in ("configuration", "peak at", "static", "grads", "gathered", "saved", "transient",
                "allocated", "reserved (pools)", "reserved classic", "measured"):
        t.add_column(col)
    for row in rows:
        est = estimate(row, hw)
        classic = estimate(row, hw, expandable_segments=False)
        m, s = est.memory_breakdown, est.schedule
        pools = ", ".join(f"{k} {v / GIB:.1f}" for k, v in sorted(s.reserved_by_stream.items()) if v)
        t.add_row(row.label.split(":")[0], f"{m.at} ({m.phase})", *(f"{getattr(m, f) / GIB:.1f}" for f in (
            "static_bytes", "grads_bytes", "gathered_params_bytes", "saved_activations_bytes",
            "transients_bytes")), f"{est.memory_allocated_peak_bytes / GIB:.1f}",
            f"{est.memory_reserved_peak_bytes / GIB:.1f} ({pools})",
            f"{classic.memory_reserved_peak_bytes / GIB:.1f}", f"{row.measured:.1f}")
    con.print(t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hardware", default="h100-96gb")
    ap.add_argument("--fit", action="store_true", help="rerun the fit of compute_eff and mem_eff")
    ap.add_argument("--memory", action="store_true", help="print the memory audit of the memory rows")
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
    if args.memory:
        memory_audit([r for r in [*ROWS, *HELD_OUT] if r.metric == "GiB" and r.hardware == args.hardware],
                     hw, con)


if __name__ == "__main__":
    main()
