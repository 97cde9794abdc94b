"""A plan's training step, estimated: trace, plan, schedule, and the figures people report.

``estimate_step`` traces the model (fake tensors), plans it (a baseline by name, the auto plan, or
a saved plan), lays the step out on streams (``cost/schedule.py``) and reports step time,
tokens per second per device, MFU, peak memory and the time breakdown.

Deep models without tracing every layer (``extrapolate_from=k``): the decoder layers are
identical (``plan/cluster.py`` finds them and plans them once), so the schedules of a model with
``k`` and ``k + PERIOD`` layers differ by exactly ``PERIOD`` layers' forward, backward,
recomputation and communication, and their peak memory by those layers' saved activations and
state. The estimate for ``L`` layers is the ``k``-layer one plus ``(L - k) / PERIOD`` times that
difference. Two layers, not one: a policy whose choices alternate between consecutive layers
(every second matmul counted over the whole forward, with seven matmuls a llama layer) still
repeats over pairs; torchtitan's per-block count (``passes/remat.py``) repeats every layer, which
pairs cover too. The steady state's overlap (prefetched
gathers, reduce_scatters under the next layer's backward) is what the difference measures, so
this is exact once the layers' streams repeat (from the third layer on in the toy of
``tests/cost/test_schedule.py``): llama3-70b on 32x8 extrapolated from 3 and 5 layers is within
1e-10 of all 80 traced (566.66 tokens/s per GPU either way, the same peak memory).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from shardwise.cost.hardware import Hardware, get_hardware
from shardwise.cost.schedule import MemoryBreakdown, StepOptions, StepSchedule, schedule_step
from shardwise.cost.topology import MeshTopology
from shardwise.errors import UserError
from shardwise.gcpause import paused_gc
from shardwise.ir.flops import graph_flops
from shardwise.ir.trace import Traced
from shardwise.mesh import Mesh
from shardwise.passes.remat import ACPolicy, AnyPolicy, LayerPolicies, policy_name, simplify_policy
from shardwise.plan.costs import PlannerCosts
from shardwise.plan.plan import Plan

# Mixed precision as torchtitan runs bf16 training (FSDP2 MixedPrecisionPolicy: param_dtype bf16,
# reduce_dtype fp32, fp32 sharded master weights and gradients).
MASTER_PARAM_BYTES = 4
MASTER_GRAD_BYTES = 4
# torchtitan's launch script (run_llama_train.sh, since October 2024) starts training with
# PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True": its memory figures are read under it.
TORCHTITAN_EXPANDABLE_SEGMENTS = True
# Layers per repeat of the schedule: extrapolation traces k and k + PERIOD layers (see above).
PERIOD = 2


@dataclass
class StepEstimate:
    step_s: float
    tokens_per_s_per_device: float
    mfu: float
    memory_per_device_bytes: int
    fits: bool
    compute_s: float
    recompute_s: float
    comm_s: float
    exposed_comm_s: float
    optimizer_s: float
    layers: int
    extrapolated_from: int | None = None
    schedule: StepSchedule | None = None
    # Peak bytes in tensors (what torch.cuda.max_memory_allocated reads) and held by the caching
    # allocator (max_memory_reserved, what OOMs: ``memory_per_device_bytes`` and ``fits``).
    memory_allocated_peak_bytes: int = 0
    memory_reserved_peak_bytes: int = 0
    memory_breakdown: MemoryBreakdown | None = None
    ac: str = ACPolicy.NONE.value  # the activation checkpointing priced (``remat.policy_name``)

    def to_json(self) -> dict:
        return {
            "step_s": self.step_s, "tokens_per_s_per_device": self.tokens_per_s_per_device,
            "mfu": self.mfu, "memory_per_device_bytes": self.memory_per_device_bytes, "fits": self.fits,
            "memory_allocated_peak_bytes": self.memory_allocated_peak_bytes,
            "memory_reserved_peak_bytes": self.memory_reserved_peak_bytes,
            "memory_breakdown": self.memory_breakdown.to_json() if self.memory_breakdown else None,
            # what each stream's pool holds at the end of the replay (not when extrapolated)
            "memory_reserved_by_stream_bytes": (dict(self.schedule.reserved_by_stream) if self.schedule
                                                else None),
            "breakdown": {"compute_s": self.compute_s, "recompute_s": self.recompute_s,
                          "comm_s": self.comm_s, "exposed_comm_s": self.exposed_comm_s,
                          "hidden_comm_s": self.comm_s - self.exposed_comm_s,
                          "optimizer_s": self.optimizer_s},
            "layers": self.layers, "extrapolated_from_layers": self.extrapolated_from, "ac": self.ac,
        }


def torchtitan_options(traced: Traced, **kw: object) -> StepOptions:
    """Step options for torchtitan's mixed precision when the model computes in bf16/fp16."""
    import torch

    ph = traced.node(next(iter(traced.params.values())))
    low = ph.meta["val"].dtype in (torch.bfloat16, torch.float16)
    mp = ({"param_bytes": MASTER_PARAM_BYTES, "grad_bytes": MASTER_GRAD_BYTES, "reduce_fp32": True}
          if low else {})
    mp["expandable_segments"] = TORCHTITAN_EXPANDABLE_SEGMENTS
    return StepOptions(**{**mp, **kw})


def from_schedule(traced: Traced, plan: Plan, sched: StepSchedule, hw: Hardware, devices: int,
                  tokens: int, budget: float | None = None) -> StepEstimate:
    """The reported figures of one schedule. ``tokens``: tokens per step over the whole mesh."""
    import torch

    dtype = traced.node(next(iter(traced.params.values()))).meta["val"].dtype
    # MFU as torchtitan reports it: the model's FLOPs (forward and backward, no recomputation,
    # attention counted whole) over the devices' peak.
    flops = graph_flops(traced.gm)
    mfu = flops / devices / sched.step_s / hw.peak(dtype if dtype.is_floating_point else torch.float32)
    # OOM happens against what the caching allocator holds, not what tensors use.
    mem = max(sched.reserved_peak_bytes, sched.peak_bytes)
    return StepEstimate(
        step_s=sched.step_s, tokens_per_s_per_device=tokens / devices / sched.step_s, mfu=mfu,
        memory_per_device_bytes=mem, fits=mem <= (hw.mem_capacity if budget is None else budget),
        compute_s=sched.compute_s + sched.optimizer_s, recompute_s=sched.recompute_s,
        comm_s=sched.comm_s, exposed_comm_s=sched.exposed_comm_s, optimizer_s=sched.optimizer_s,
        layers=0, schedule=sched, memory_allocated_peak_bytes=sched.peak_bytes,
        memory_reserved_peak_bytes=mem, memory_breakdown=sched.memory)


def extrapolate(a: StepEstimate, b: StepEstimate, k: int, layers: int, hw: Hardware, tokens: int,
                devices: int, budget: float | None = None) -> StepEstimate:
    """From estimates at ``k`` and ``k + PERIOD`` layers to ``layers`` (see the module docstring)."""
    n = (layers - k) / PERIOD

    def lin(x: float, y: float) -> float:
        return x + n * (y - x)

    step = lin(a.step_s, b.step_s)
    allocated = int(lin(a.memory_allocated_peak_bytes, b.memory_allocated_peak_bytes))
    # Reserved bytes extrapolate linearly too (within 0.1% of the 32 traced layers for 8B
    # eager, 3% compiled), but the allocator holds at least the allocated peak plus the cache
    # it holds beside it at both traced depths: a floor where the shallow traces' reserve is
    # not yet steady.
    cached = min(a.memory_reserved_peak_bytes - a.memory_allocated_peak_bytes,
                 b.memory_reserved_peak_bytes - b.memory_allocated_peak_bytes)
    mem = max(int(lin(a.memory_per_device_bytes, b.memory_per_device_bytes)), allocated + max(cached, 0))
    breakdown = None
    if a.memory_breakdown is not None and b.memory_breakdown is not None:
        # the peak's parts grow with the layers like the peak (same place in the step)
        ma, mb = a.memory_breakdown, b.memory_breakdown
        breakdown = replace(mb, largest=list(mb.largest), **{
            f: int(lin(getattr(ma, f), getattr(mb, f)))
            for f in ("static_bytes", "grads_bytes", "gathered_params_bytes", "saved_activations_bytes",
                      "transients_bytes")})
    return replace(
        a, step_s=step, tokens_per_s_per_device=tokens / devices / step,
        mfu=lin(a.mfu * a.step_s, b.mfu * b.step_s) / step,
        memory_per_device_bytes=mem, fits=mem <= (hw.mem_capacity if budget is None else budget),
        compute_s=lin(a.compute_s, b.compute_s), recompute_s=lin(a.recompute_s, b.recompute_s),
        comm_s=lin(a.comm_s, b.comm_s), exposed_comm_s=lin(a.exposed_comm_s, b.exposed_comm_s),
        optimizer_s=lin(a.optimizer_s, b.optimizer_s), layers=layers, extrapolated_from=k, schedule=None,
        memory_allocated_peak_bytes=allocated,
        memory_reserved_peak_bytes=mem, memory_breakdown=breakdown)


def plan_for(traced: Traced, mesh: Mesh, plan: str, time_limit_s: float = 60.0,
             opts: dict | None = None) -> Plan:
    """A baseline by name, ``auto``, or a saved plan file checked against this graph. ``auto``
    is what ``shardwise plan`` chooses with the step options ``opts``: the fastest by the
    schedule of the ILP's solution and the hand plans that fit."""
    from shardwise.plan import BASELINES, make_plan
    from shardwise.plan.plan import graph_fingerprint
    from shardwise.plan.planner import NO_PLAN, no_plan_reason, plan_named

    if plan == "auto":
        return plan_named(traced, mesh, "auto", time_limit_s=time_limit_s, step_options=opts or {})
    if plan in BASELINES:
        # Baselines are priced as their authors run them, whatever memory they need: ``fits``
        # reports whether that is within the device's memory.
        # (Their free choices by the serial objective, as benchmarks/fidelity.py was fitted:
        # ``shardwise plan`` prices its own hand plans, chosen by the schedule objective within
        # the budget; a plan file it saves is what to pass here to see the same step.)
        p = make_plan(traced, mesh, baseline=plan, memory_budget=math.inf, time_limit_s=time_limit_s)
        if p is None:
            raise UserError(f"the {plan} plan does not apply to mesh {mesh} (it needs a 'tp' dim, or a "
                            "batch and weights the mesh divides evenly).")
        if p.status in NO_PLAN:
            raise UserError(no_plan_reason(p))
        return p
    if not plan.endswith(".json"):
        raise UserError(f"--plan {plan!r} is neither a plan name ({', '.join(('auto', *BASELINES))}) "
                        "nor a .json plan file.")
    p = Plan.load(plan)
    p.check_matches(traced.model_name, mesh.shape, traced.train, graph_fingerprint(traced.gm))
    return p


def uses_tp(plan: Plan, traced: Traced) -> bool:
    """The plan is tensor-parallel over a mesh dim named ``tp``: it shards some parameter there
    and does not split the batch there (FSDP over every dim shards both)."""
    from torch.distributed.tensor import Shard

    if "tp" not in plan.mesh_names:
        return False
    d = list(plan.mesh_names).index("tp")
    batch_split = any(plan.nodes[i].output[0][d] == Shard(0) for i in traced.inputs if i in plan.nodes)
    return (plan.mesh_shape[d] > 1 and not batch_split
            and any(isinstance(ps[d], Shard) for ps in plan.params.values()))


def estimate_step(model: str, mesh: Mesh, plan: str, opts: dict, *, batch: int | None = None,
                  seq: int | None = None, layers: int | None = None, dtype: str | None = None,
                  memory_budget: float | None = None, extrapolate_from: int | None = None,
                  time_limit_s: float = 60.0) -> StepEstimate:
    """Trace, plan and schedule one training step of ``model`` on ``mesh`` (see module doc).
    ``opts``: ``StepOptions`` fields (``ac``, ``compile``, ``async_tp``)."""
    from shardwise.ir.trace import trace_model
    from shardwise.models import get_model
    from shardwise.passes.pipeline import canonicalize

    spec = get_model(model, layers=layers, batch=batch, seq=seq, dtype=dtype)
    depths = [spec.n_layers]
    if extrapolate_from is not None and extrapolate_from < 1:
        raise UserError(f"--extrapolate-from must be at least 1 layer, got {extrapolate_from}.")
    if extrapolate_from is not None and extrapolate_from + PERIOD < spec.n_layers:
        depths = [extrapolate_from, extrapolate_from + PERIOD]
    prepared = []
    for n_layers in depths:
        traced = trace_model(model, train=True, layers=n_layers, batch=batch, seq=seq, dtype=dtype)
        canonicalize(traced)
        p = plan_for(traced, mesh, plan, time_limit_s, opts)
        if plan != "auto" and opts.get("async_tp") and not uses_tp(p, traced):
            raise UserError(f"--async-tp needs a plan that shards weights over a 'tp' mesh dim; the "
                            f"{p.name} plan on mesh {mesh} has none.")
        # The auto plan was chosen with async TP wherever it applies; every plan runs the
        # activation checkpointing it records unless ``opts`` names one.
        applied = step_options_for(p, traced, opts)
        prepared.append((traced, p))
    hw = get_hardware(mesh.hardware)
    opts = applied
    return estimate_prepared(prepared, spec.n_layers, spec.batch * spec.seq, mesh, hw, opts, memory_budget)


@paused_gc()
def estimate_prepared(prepared: list[tuple[Traced, Plan]], layers: int, tokens: int, mesh: Mesh,
                      hw: Hardware, opts: dict, memory_budget: float | None = None,
                      costs: PlannerCosts | None = None) -> StepEstimate:
    """Schedule traced-and-planned steps on ``hw``: one graph of the whole model, or two of
    ``k`` and ``k + PERIOD`` layers extrapolated to ``layers`` (see the module docstring).
    ``costs``: the planner's (``schedule_step``)."""
    topo = MeshTopology(mesh.shape, hw)
    ests = []
    for traced, p in prepared:
        sched = schedule_step(traced, p, topo, torchtitan_options(traced, **opts), costs)
        ests.append(from_schedule(traced, p, sched, hw, mesh.size, tokens, memory_budget))
        ests[-1].layers = layers
        ests[-1].ac = policy_name(opts.get("ac", ACPolicy.NONE))
    if len(ests) == 1:
        return ests[0]
    k = len(regions_layers(prepared[0][0]))
    return extrapolate(ests[0], ests[1], k, layers, hw, tokens, mesh.size, memory_budget)


def tokens_per_step(traced: Traced) -> int:
    """Tokens one step processes over the whole mesh: the elements of the first input (the
    token ids, ``[batch, seq]``)."""
    return traced.node(traced.inputs[0]).meta["val"].numel()


# The ``StepOptions`` field a plan records for ``estimate`` of it: bytes of optimizer state per
# parameter element.
OPTIMIZER_STATE = "optimizer_state_bytes"


def step_options_for(plan: Plan, traced: Traced, opts: dict) -> dict:
    """``opts`` as they apply to ``plan``: ``async_tp`` only where the plan is tensor-parallel
    (fusing would otherwise pair an FSDP gather over a dim named tp with its matmul); ``ac`` the
    plan's recorded activation checkpointing (``Plan.ac``, none without one) unless ``opts``
    names a policy, which then holds for every layer; the optimizer state the plan was made for
    (``shardwise plan --optimizer``, recorded when it was priced) unless ``opts`` gives one."""
    recorded = plan.info.get("schedule", {}).get("options", {})
    state = {OPTIMIZER_STATE: recorded[OPTIMIZER_STATE]} if OPTIMIZER_STATE in recorded else {}
    return {**state, **opts, "ac": plan_ac(plan, opts.get("ac")),
            "async_tp": bool(opts.get("async_tp")) and uses_tp(plan, traced)}


def plan_ac(plan: Plan, given: AnyPolicy | None) -> AnyPolicy:
    """The activation checkpointing ``plan`` runs: ``given`` if not None, else its own."""
    if given is not None:
        return simplify_policy(given) if isinstance(given, LayerPolicies) else given
    return simplify_policy(plan.ac.layer_policies()) if plan.ac is not None else ACPolicy.NONE


def price_plan(traced: Traced, plan: Plan, mesh: Mesh, opts: dict,
               memory_budget: float | None = None, costs: PlannerCosts | None = None) -> StepEstimate:
    """The schedule estimate of one traced, planned step: the code path of ``shardwise
    estimate`` (``estimate_prepared``), with ``async_tp`` where the plan uses it. Records the
    figures and the options in ``plan.info["schedule"]`` (saved with the plan). ``costs``: the
    planner's (``schedule_step``)."""
    applied = step_options_for(plan, traced, opts)
    est = estimate_prepared([(traced, plan)], len(regions_layers(traced)), tokens_per_step(traced), mesh,
                            get_hardware(mesh.hardware), applied, memory_budget, costs)
    so = StepOptions(**applied)
    plan.info["schedule"] = {**est.to_json(), "options": {"ac": policy_name(so.ac), "compile": so.compile,
                                                          "async_tp": so.async_tp,
                                                          OPTIMIZER_STATE: so.optimizer_state_bytes}}
    return est


def regions_layers(traced: Traced) -> set[int]:
    """The decoder layer indices of a traced graph."""
    from shardwise.plan.cluster import TAIL, regions

    return {r for r in regions(traced).values() if 0 <= r < TAIL}
