"""Plans in words: parameter placements as people say them, and a JSON summary."""

from __future__ import annotations

from torch import fx
from torch.distributed.tensor import Replicate, Shard

from shardwise.ir.trace import Traced
from shardwise.plan.placement import placements_str
from shardwise.plan.plan import Plan, tensor_args


def _compute_consumer(node: fx.Node, plan: Plan) -> tuple[fx.Node, int] | None:
    """The first op that computes with ``node`` (walking through single-input view-likes)."""
    for u in node.users:
        if u.op != "call_function":
            continue
        spec = plan.nodes.get(u.name)
        args = tensor_args(u)
        same = spec is not None and spec.inputs and spec.inputs[0] == plan.nodes[node.name].output[0]
        if len(args) == 1 and same:
            deeper = _compute_consumer(u, plan)
            if deeper is not None:
                return deeper
        return u, args.index(node) if node in args else 0
    return None


def describe_param(traced: Traced, plan: Plan, name: str) -> str:
    """E.g. "FSDP over dp, column-parallel over tp" for a weight stored S(0),S(0) and read S(0) on tp."""
    ph = traced.node(traced.params[name])
    stored = plan.nodes[ph.name].output[0]
    val = ph.meta["val"]
    phrases = []
    for d, (p, mesh_name) in enumerate(zip(stored, plan.mesh_names, strict=True)):
        if isinstance(p, Replicate):
            phrases.append(f"replicated over {mesh_name}")
            continue
        used = None
        c = _compute_consumer(ph, plan)
        if c is not None:
            spec = plan.nodes.get(c[0].name)
            if spec is not None and spec.inputs:
                used = spec.inputs[min(c[1], len(spec.inputs) - 1)][d]
        if isinstance(used, Replicate):
            phrases.append(f"FSDP over {mesh_name}")
        elif isinstance(p, Shard) and val.dim() == 2:
            role = "column-parallel" if p.dim == 0 else "row-parallel"
            phrases.append(f"{role} over {mesh_name}")
        else:
            phrases.append(f"sharded dim {p.dim if isinstance(p, Shard) else '?'} over {mesh_name}")
    return ", ".join(phrases)


def plan_summary(plan: Plan) -> dict:
    """The JSON object ``shardwise plan --json`` prints (without baselines and trace time)."""
    return {
        "status": plan.status,
        "objective_s": plan.info.get("objective_s"),
        "mip_gap": plan.mip_gap,
        # The solver's lower bound on the optimum, and the hand plan it started from (if any).
        "bound_s": plan.info.get("bound_s"),
        "started_from": plan.info.get("started_from"),
        # The node-by-node sum (every kernel and collective one after another, no overlap):
        # the inference measure; a training step's is the schedule's ``step_s``.
        "serial_estimate": {"compute_s": plan.estimate.compute_s, "comm_s": plan.estimate.comm_s,
                            "total_s": plan.estimate.total_s},
        "params": {k: placements_str(v) for k, v in plan.params.items()},
        "outputs": [placements_str(p) for p in plan.outputs],
        "collectives": {k: {"count": v.count, "bytes": v.bytes} for k, v in plan.collectives.items()},
        "fallback_ops": plan.fallback_ops,
        # Activation checkpointing per cluster of identical layers (None: not recorded, runs none).
        "ac": None if plan.ac is None else plan.ac.to_json(),
        "ac_policy": "none" if plan.ac is None else plan.ac.describe(),
    }
