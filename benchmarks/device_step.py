"""A real training step on one device against ``shardwise estimate`` of the same step.

    .venv/bin/python benchmarks/device_step.py [--cases llama3-8b:2:1:4096:bf16,...] [--steps 6]
        [--hardware h100] [--compile] [--json]

Each case (``model:layers:batch:seq:dtype``) runs as users run it, one subprocess per command:

- ``shardwise train --mesh 1 --plan ddp --steps N --json`` on this machine's device (NCCL on a
  CUDA device, gloo on the CPU): the mean step after the first (forward, backward, clipping,
  AdamW) and, on CUDA, ``torch.cuda.max_memory_reserved`` with expandable segments, as
  torchtitan launches;
- ``shardwise estimate --mesh 1 --plan ddp --json`` with ``--hardware``: the step schedule's
  step and reserved peak.

``--compile`` passes ``--compile`` to both: the step through ``torch.compile`` (compiled in the
first, untimed step), and the estimate's memory-bound work priced as Inductor's fused kernels.

It prints both and their ratio (estimated / measured). Without CUDA it runs the default CPU case
against the ``cpu`` spec (a check of the plumbing, not of the model: a laptop's CPU is no spec).

For a bf16 model both sides run torchtitan's mixed precision (fp32 master weights, gradients and
Adam state; ``train``'s default ``--master-dtype fp32``), with one difference left: the estimate
reduces gradients in fp32, ``train``'s program in bf16 (on one device there is nothing to reduce).

Measured (2026-11-27, a second session, one NVIDIA H100 80GB HBM3 lent to it, its image's PyTorch
2.11.0+cu130, ``--steps 6``, spec ``h100``), after two fixes to ``train`` found by profiling the
first row's step (``torch.profiler``, two steps): it timed a step before the device had run its
optimizer (the kernels were only queued), so it reported 72.5 ms for a step whose kernels took
107.7 ms; and its AdamW ran ``foreach``, about eight passes over the fp32 state (50.5 ms of
kernels a step), where torchtitan runs ``fused`` (16.7 ms). The estimate then gained what the
profile showed it missed: gradient clipping (2.2 + 4.4 ms) and flash attention's own rate (FA2:
3.87 ms against 1.22 priced at the GEMM rate; ``attention_eff`` in ``h100.toml``).

| case                    | measured ms | estimated ms, was -> now | est / meas | reserved GiB | est.   |
| ----------------------- | ----------- | ------------------------ | ---------- | ------------ | ------ |
| llama3-8b:2:1:4096:bf16 | 85.936      | 59.287 -> 67.893         | 0.790      | 28.229       | 28.168 |
| llama3-8b:4:2:4096:bf16 | 196.074     | 146.779 -> 165.160       | 0.842      | 45.752       | 42.367 |
| llama3-8b:2:1:4096:fp32 | 588.595     | 487.691 -> 493.609       | 0.839      | 28.578       | 28.068 |
| ... bf16, compiled *    | 71.841      | 56.447 -> 65.053         | 0.906      | 26.666       | 28.070 |

(* ``--compile --steps 5``.) The first row's kernels, profiled, against the estimate now: GEMMs
28.7 ms (30.0 estimated), fused AdamW 16.7 (13.8), clipping 6.6 (5.9), the loss's log-softmax
5.7 (5.6), attention 3.9 (3.9), copies 11.8 (2.8): what is left is the mixed-precision casts of
the weights and gradients (fp32 <-> bf16, about 9 ms, not priced) and the host's gaps between
kernels (wall 88.1 ms against 80.4 ms of kernels under the profiler). The fp32 row's attention
(no FA2 in fp32: another kernel) was not profiled and stays priced at the GEMM rate. Memory is read
within 0.2% (bf16, 2 layers), 7.4% (4 layers) and 1.8% (fp32); mixed precision keeps fp32 master
weights now, so the bf16 rows' earlier 11-14 GiB gap (bf16 weights) is gone.

Earlier (the first session with a lent H100, before both fixes, bf16 weights and AdamW state):
64.787 / 171.240 / 576.020 ms measured, 55.884 compiled, each without its optimizer's kernels.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

GIB = 2**30
GPU_CASES = "llama3-8b:2:1:4096:fp32,llama3-8b:2:1:4096:bf16,llama3-8b:4:2:4096:bf16"
CPU_CASES = "llama-small:2:2:256:fp32"


def _shardwise(args: list[str], env: dict[str, str] | None = None) -> dict:
    """One ``shardwise ... --json`` command's object (its stderr shown where it fails)."""
    out = subprocess.run([sys.executable, "-m", "shardwise", *args, "--json"], capture_output=True, text=True,
                         env=env)
    if out.returncode != 0:
        said = out.stderr.strip()[-1500:]
        raise RuntimeError(f"shardwise {' '.join(args)} exited {out.returncode}: {said}")
    return json.loads(out.stdout)


def measure(case: str, steps: int, hardware: str, cuda: bool, compile: bool = False) -> dict:
    model, layers, batch, seq, dtype = case.split(":")
    common = ["--model", model, "--layers", layers, "--batch", batch, "--seq", seq, "--dtype", dtype,
              "--mesh", "1", "--plan", "ddp", *(["--compile"] if compile else [])]
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    ran = _shardwise(["train", *common, "--steps", str(steps), "--backend", "nccl" if cuda else "gloo",
                      "--hardware", hardware], env)
    est = _shardwise(["estimate", *common, "--hardware", hardware])
    row = {"case": case + (" compiled" if compile else ""), "measured_ms": ran["step_s"] * 1e3,
           "estimated_ms": est["step_s"] * 1e3, "ratio": est["step_s"] / ran["step_s"],
           "tokens_per_s": ran["tokens_per_s"],
           "estimated_reserved_gib": est["memory_reserved_peak_bytes"] / GIB}
    if "memory_reserved_peak_bytes" in ran:
        row["measured_reserved_gib"] = ran["memory_reserved_peak_bytes"] / GIB
        row["memory_ratio"] = est["memory_reserved_peak_bytes"] / ran["memory_reserved_peak_bytes"]
    return row


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=None, help=f"default: {GPU_CASES} on CUDA, {CPU_CASES} otherwise")
    ap.add_argument("--steps", type=int, default=6, help="training steps per case (the first is not timed)")
    ap.add_argument("--hardware", default=None, help="spec the estimate prices (default: h100 on CUDA, cpu)")
    ap.add_argument("--compile", action="store_true",
                    help="train through torch.compile, and price memory-bound work as its fused kernels")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    cases = args.cases or (GPU_CASES if cuda else CPU_CASES)
    hardware = args.hardware or ("h100" if cuda else "cpu")
    where = torch.cuda.get_device_name() if cuda else "CPU (no CUDA device: plumbing only)"
    print(f"device: {where}; torch {torch.__version__}; estimate with spec {hardware!r}", file=sys.stderr)
    rows = []
    for case in cases.split(","):
        try:
            rows.append(measure(case, args.steps, hardware, cuda, args.compile))
        except RuntimeError as e:
            print(f"{case}: {e}", file=sys.stderr)
    if args.json:
        print(json.dumps({"device": where, "torch": torch.__version__, "hardware": hardware, "rows": rows}))
        return
    cols = ("case", "measured_ms", "estimated_ms", "ratio", "tokens_per_s", "measured_reserved_gib",
            "estimated_reserved_gib", "memory_ratio")
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(f"{r[c]:.3f}" if isinstance(r.get(c), float) else str(r.get(c, "-")) for c in cols))


if __name__ == "__main__":
    main()
