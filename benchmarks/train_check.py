"""``shardwise train --check`` over plans, meshes and models: the distributed loss curve against
the same steps in one fp32 process (issue 13's acceptance matrix).

Prints one row per run: model, mesh, plan, passes, first and last loss, and the largest relative
difference from the reference curve (target <= 1e-4); a plan that does not apply to a mesh
(fsdp_tp without a tp dim) is listed as such.

    python benchmarks/train_check.py [--steps 20]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MESHES = (("2", "dp"), ("4", "dp"), ("2x2", "dp,tp"))
PLANS = ("ddp", "fsdp", "fsdp_tp", "auto")
HF = ("llama", "mistral", "qwen2")
TARGET = 1e-4


def train(model: str, mesh: str, names: str, plan: str, steps: int, passes: str = "") -> dict | str:
    cmd = [sys.executable, "-m", "shardwise", "train", "--model", model, "--mesh", mesh,
           "--mesh-names", names, "--plan", plan, "--steps", str(steps), "--check", "--json"]
    if passes:
        cmd += ["--passes", passes]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        # The CLI's own one-sentence error if it wrote one (library warnings may follow it).
        lines = proc.stderr.strip().splitlines()
        said = [ln for ln in lines if ln.startswith("shardwise")]
        return (said or lines or [f"exit {proc.returncode}"])[-1]
    return json.loads(proc.stdout)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    runs = [("llama-tiny", "2x2", "dp,tp", "fsdp_tp_sp", "sequence_parallel,collective_matmul")]
    runs += [("llama-tiny", m, n, plan, "") for m, n in MESHES for plan in PLANS]
    runs += [(f"hf:tests/data/hf_tiny_{h}/config.json", "2x2", "dp,tp", "fsdp_tp", "") for h in HF]
    print(f"{'model':<36} {'mesh':<5} {'plan':<11} {'passes':<5} {'loss_0':>7} {'loss_N':>7} "
          f"{'max_rel_diff':>12}  ok")
    worst = 0.0
    for model, mesh, names, plan, passes in runs:
        res = train(model, mesh, names, plan, args.steps, passes)
        if isinstance(res, str):
            print(f"{model:<36} {mesh:<5} {plan:<11} {'':<5} {res}")
            continue
        worst = max(worst, res["max_rel_diff"])
        ok = res["max_rel_diff"] <= TARGET and res["losses"][-1] < res["losses"][0]
        print(f"{model:<36} {mesh:<5} {plan:<11} {'yes' if passes else 'no':<5} {res['losses'][0]:>7.4f} "
              f"{res['losses'][-1]:>7.4f} {res['max_rel_diff']:>12.2e}  {'yes' if ok else 'NO'}")
    print(f"worst max_rel_diff {worst:.2e} (target {TARGET:g})")


if __name__ == "__main__":
    main()
