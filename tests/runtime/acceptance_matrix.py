"""The full acceptance matrix of issue 5, as a script (too slow for CI: planning dominates).

    .venv/bin/python -m tests.runtime.acceptance_matrix [--models llama-tiny,hf] [--meshes 2,4,2x2]

For every model x mode x mesh x plan (every baseline that applies, and auto): trace (1 layer,
batch 4, seq 8), canonicalise, plan, lower, check lowered == predicted collectives, then run
all programs of one world size in one launch with ``check=True`` and print one row each:
max_rel_err against the fp32 reference and whether measured == predicted (count and bytes).
"""

from __future__ import annotations

import argparse
import time

from shardwise.ir.trace import trace_model
from shardwise.lower import lower
from shardwise.mesh import parse_mesh
from shardwise.models import get_model
from shardwise.passes.pipeline import canonicalize
from shardwise.plan import BASELINES, make_plan
from shardwise.runtime import run_many
from shardwise.runtime.counter import as_json
from tests.helpers import hf_model_name

SHAPE = {"layers": 1, "batch": 4, "seq": 8}
MAX_REL_ERR = 1e-4


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="llama-tiny,hf")
    ap.add_argument("--meshes", default="2,4,2x2")
    ap.add_argument("--modes", default="train,inference")
    args = ap.parse_args()
    models = [hf_model_name("llama") if m == "hf" else m for m in args.models.split(",")]
    rows, by_world, failures = [], {}, 0
    for model in models:
        for mode in args.modes.split(","):
            train = mode == "train"
            traced = trace_model(model, train=train, **SHAPE)
            canonicalize(traced)
            for text in args.meshes.split(","):
                mesh = parse_mesh(text)
                for baseline in (*BASELINES, None):
                    key = (model.split("/")[-2] if model.startswith("hf:") else model, mode, text,
                           baseline or "auto")
                    t0 = time.perf_counter()
                    try:
                        plan = make_plan(traced, mesh, baseline=baseline)
                        if plan is None:
                            continue
                        t1 = time.perf_counter()
                        prog = lower(traced, plan)
                    except Exception as e:  # report the configuration and go on with the others
                        failures += 1
                        rows.append((*key, f"failed: {type(e).__name__}: {str(e).splitlines()[0][:80]}",
                                     "", "", "", "", ""))
                        continue
                    t2 = time.perf_counter()
                    prog.model = get_model(model, **SHAPE)
                    lowered_ok = as_json(prog.collectives()) == as_json(plan.collectives)
                    by_world.setdefault(mesh.size, []).append((key, prog, lowered_ok, t1 - t0, t2 - t1))
    for _world, items in sorted(by_world.items()):
        t0 = time.perf_counter()
        results = run_many([p for _, p, _, _, _ in items], check=True, timeout_s=120)
        run_s = time.perf_counter() - t0
        for (key, prog, lowered_ok, plan_s, lower_s), res in zip(items, results, strict=True):
            comm_ok = as_json(res.measured) == as_json(prog.plan.collectives)
            ok = lowered_ok and comm_ok and res.max_rel_err <= MAX_REL_ERR
            failures += not ok
            rows.append((*key, f"{res.max_rel_err:.1e}", "yes" if lowered_ok else "NO",
                         "yes" if comm_ok else "NO", f"{plan_s:.1f}", f"{lower_s:.1f}", f"{run_s:.1f}"))
    head = ("model", "mode", "mesh", "plan", "max_rel_err", "lowered==pred", "measured==pred", "plan_s",
            "lower_s", "launch_s")
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    for r in [head, *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)))
    print(f"{len(rows) - failures}/{len(rows)} configurations pass")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
