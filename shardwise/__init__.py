"""shardwise: a graph compiler for distributed PyTorch.

    traced = shardwise.trace_model("llama3-8b", layers=2)      # or shardwise.trace(model, *inputs)
    shardwise.canonicalize(traced)                             # view-mm-view -> einsum, norms
    plan = shardwise.make_plan(traced, shardwise.Mesh((8, 8), ("dp", "tp")))
    program = shardwise.lower_plan(traced, plan)               # per-rank graph with c10d collectives
    shardwise.optimize(program.gm, ["sequence_parallel", "collective_matmul"])
    result = shardwise.run(program, backend="gloo", check=True)

    pm = shardwise.parallelize(model, "2x2", example_inputs, mesh_names=("dp", "tp"))  # to train

Names are imported on first use, so ``import shardwise`` stays cheap. (``make_plan`` and
``lower_plan`` rather than ``plan`` and ``lower``: those are the subpackages' names.)
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "trace": ("shardwise.ir.trace", "trace"),
    "trace_model": ("shardwise.ir.trace", "trace_model"),
    "Traced": ("shardwise.ir.trace", "Traced"),
    "canonicalize": ("shardwise.passes.pipeline", "canonicalize"),
    "Mesh": ("shardwise.mesh", "Mesh"),
    "make_plan": ("shardwise.plan.planner", "make_plan"),
    "Plan": ("shardwise.plan.plan", "Plan"),
    "estimate": ("shardwise.plan.planner", "estimate"),
    "lower_plan": ("shardwise.lower.spmd", "lower"),
    "optimize": ("shardwise.passes", "run_passes"),
    "run": ("shardwise.runtime.launch", "run"),
    "segment": ("shardwise.passes.segment", "segment"),
    "parallelize": ("shardwise.train.module", "parallelize"),
    "params_on_meta": ("shardwise.train.models", "params_on_meta"),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'shardwise' has no attribute {name!r}")
    module, attr = _EXPORTS[name]
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value
