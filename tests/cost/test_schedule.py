"""The step schedule: streams that respect dependencies, the overlap it claims, AC and memory.

Small llama graphs (2 layers) on fake tensors, planned by the hand baselines; every figure is
checked against a property the schedule must have, not against a recorded number.
"""

from __future__ import annotations

import copy
import dataclasses
import functools

import pytest
import torch
from torch.distributed.tensor import Replicate

from shardwise.cost.schedule import (
    COMPUTE_STREAM,
    EventKind,
    StepOptions,
    _Scheduler,
    exposed_time,
    schedule_step,
    union_length,
)
from shardwise.cost.topology import MeshTopology
from shardwise.ir.match import einsum_is_matmul, einsum_is_weight_grad
from shardwise.ir.regions import alias_root
from shardwise.ir.trace import Phase, trace_model
from shardwise.mesh import parse_mesh
from shardwise.passes.pipeline import canonicalize
from shardwise.passes.remat import ACPolicy
from shardwise.plan import make_plan
from shardwise.plan.cluster import regions
from shardwise.plan.plan import NodeSpec

HW = "h100-96gb"


@functools.cache
def _planned(mesh: str, names: str | None, plan: str, batch: int = 8, seq: int = 512, layers: int = 2):
    traced = trace_model("llama3-8b", layers=layers, batch=batch, seq=seq, dtype="bf16")
    canonicalize(traced)
    m = parse_mesh(mesh, names, HW)
    p = make_plan(traced, m, baseline=plan, memory_budget=float("inf"))
    assert p is not None
    return traced, p, MeshTopology(m.shape, HW)


def _schedule(mesh="4", names=None, plan="fsdp", seq=512, **opts):
    traced, p, topo = _planned(mesh, names, plan, seq=seq)
    return traced, schedule_step(traced, p, topo, StepOptions(**opts))


def test_interval_helpers():
    assert union_length([(0, 2), (1, 3), (5, 6)]) == 4  # [0, 3] and [5, 6]
    # comm [0, 4] against compute [1, 2] and [3, 5]: exposed where no compute runs: [0,1] + [2,3]
    assert exposed_time([(0, 4)], [(1, 2), (3, 5)]) == pytest.approx(2.0)


@pytest.mark.parametrize("mesh,names,plan,opts", [
    ("4", None, "fsdp", {}),
    ("4", None, "fsdp", {"ac": ACPolicy.SELECTIVE, "compile": True}),
    ("2x4", "dp,tp", "fsdp_tp_sp", {"ac": ACPolicy.FULL}),
    ("2x4", "dp,tp", "fsdp_tp_sp", {"async_tp": True}),
])
def test_streams_are_sequential_and_the_breakdown_adds_up(mesh, names, plan, opts):
    _, s = _schedule(mesh, names, plan, **opts)
    for stream in {e.stream for e in s.events}:
        evs = sorted(s.stream_events(stream), key=lambda e: e.start)
        for a, b in zip(evs, evs[1:], strict=False):
            assert b.start >= a.end - 1e-12, f"{stream}: {a.name} overlaps {b.name}"
    compute = s.stream_events(COMPUTE_STREAM)
    # The step starts at 0 on every stream (the compute track may first wait for a gather) and
    # ends with the optimizer on the compute track, after the last gradient reduction.
    assert min(e.start for e in s.events) == 0.0
    span = max(e.end for e in compute)
    assert abs(span - s.step_s) <= 0.01 * s.step_s
    comm = [(e.start, e.end) for e in s.events if e.kind == EventKind.COLLECTIVE]
    busy = [(e.start, e.end) for e in compute]
    not_under_compute = union_length(comm + busy) - union_length(busy)
    assert s.exposed_comm_s == pytest.approx(not_under_compute)
    assert 0 <= s.exposed_comm_s <= s.comm_s + 1e-12
    assert s.step_s >= s.compute_s + s.recompute_s + s.optimizer_s - 1e-9


def test_fsdp_gathers_are_prefetched_and_reductions_overlap_the_backward():
    """FSDP2: the layers' parameter all_gathers and gradient reduce_scatters run under compute;
    the same collectives run back to back with their consumers (no overlap) would cost their
    whole time."""
    _, s = _schedule("4", None, "fsdp")
    busy = [(e.start, e.end) for e in s.stream_events(COMPUTE_STREAM)]
    # Layer 1's forward gathers are issued when layer 0 starts; layer 1's gradient
    # reduce_scatters run while layer 0's backward computes.
    ahead = [(e.start, e.end) for e in s.events if e.region == 1 and (
        e.name.startswith("all_gather:") and e.phase == "forward" or e.name.startswith("reduce_scatter:"))]
    total = sum(b - a for a, b in ahead)
    assert total > 0
    assert exposed_time(ahead, busy) < 0.1 * total
    kinds = {e.name.split(":")[0] for e in s.events if e.kind == EventKind.COLLECTIVE}
    assert {"all_gather", "reduce_scatter"} <= kinds
    # reshard after forward: each layer weight is gathered in the forward and again in the backward
    gathers = [e for e in s.events if e.name.startswith("all_gather:") and e.region == 0]
    assert {e.phase for e in gathers} == {"forward", "backward"}


def test_a_forward_block_s_own_collectives_run_ahead_of_the_next_block_s_gathers():
    """FSDP2's forward prefetch is implicit: the CPU issues layer 1's all_gathers at layer 1's
    pre-forward, after layer 0's kernels and collectives, so on the dp stream layer 0's own
    collectives (here an activation gathered for one multiply) run first, and layer 1's gathers
    still run under layer 0's compute. In the backward the prefetch is explicit: layer 0's
    gathers are issued before layer 1's backward kernels, ahead of its gradient reductions."""
    traced, fsdp, topo = _planned("4", None, "fsdp")
    region = regions(traced)
    forward_muls = [n for n in traced.gm.graph.nodes if n.target is torch.ops.aten.mul.Tensor
                    and region.get(n) == 0 and traced.phase(n) is Phase.FORWARD]
    mul = next(n for n in forward_muls if len(fsdp.nodes[n.name].inputs) == 2)
    plan = copy.deepcopy(fsdp)
    whole = (Replicate(),)
    plan.nodes[mul.name] = NodeSpec((whole,), (whole, whole))  # its inputs gathered, elementwise
    s = schedule_step(traced, plan, topo, StepOptions())
    params = {ph for ph in traced.param_of_placeholder()}
    node = {n.name: n for n in traced.gm.graph.nodes}

    def moved(e, phase: str, layer: int, param: bool) -> bool:
        what = node.get(e.name.partition(":")[2])
        return (e.kind == EventKind.COLLECTIVE and e.phase == phase and e.region == layer and what is not None
                and (alias_root(what).name in params) == param)

    own = [e for e in s.events if moved(e, "forward", 0, param=False)]
    ahead = [e for e in s.events if moved(e, "forward", 1, param=True)]
    assert own and ahead and {e.stream for e in own + ahead} == {"comm:dp"}
    assert max(e.end for e in own) <= min(e.start for e in ahead)
    layer0 = [e for e in s.stream_events(COMPUTE_STREAM) if e.region == 0 and e.phase == "forward"]
    assert min(e.start for e in ahead) < max(e.end for e in layer0)
    prefetched = [e for e in s.events if moved(e, "backward", 0, param=True)]
    reductions = [e for e in s.events if e.region == 1 and e.name.startswith("reduce_scatter:")]
    assert prefetched and reductions
    assert max(e.end for e in prefetched) <= min(e.start for e in reductions)


@pytest.mark.parametrize("plan", ["fsdp", "fsdp_tp"])
def test_the_last_layer_keeps_its_forward_gathers_for_its_backward(plan):
    """torchtitan does not reshard the last layer after its forward: its backward reads the
    weights its forward gathered over dp. The backward reads a weight as t(t(w)), the forward as
    t(w): the same parameter placement once both transposes are undone (with one undone, every
    tensor-parallel weight of the last layer was gathered over dp a second time)."""
    traced, s = _schedule("2x4", "dp,tp", plan)
    params = set(traced.params.values())

    def weight_gathers_over_dp(layer: int) -> list[str]:
        out = []
        for e in s.events:
            kind, _, name = e.name.partition(":")
            if (kind == "all_gather" and e.stream.endswith(":dp") and e.region == layer
                    and e.phase == "backward" and alias_root(traced.node(name)).name in params):
                out.append(name)
        return out

    assert weight_gathers_over_dp(1) == []
    # the first layer is resharded after its forward, and gathered over dp again
    assert weight_gathers_over_dp(0)


def test_async_tp_hides_tensor_parallel_collectives():
    _, plain = _schedule("2x4", "dp,tp", "fsdp_tp_sp")
    _, fused = _schedule("2x4", "dp,tp", "fsdp_tp_sp", async_tp=True)
    assert fused.comm_s == pytest.approx(plain.comm_s)
    assert fused.exposed_comm_s < plain.exposed_comm_s
    assert fused.step_s < plain.step_s


def test_async_tp_fuses_a_gather_with_the_matmuls_reading_it_as_left_operand():
    """PyTorch's micro-pipeline pass splits the gathered operand's rows into the ring's chunks:
    a matmul reading it as its left operand (``x @ w``) hides the ring, a weight gradient (which
    sums over the gathered rows) does not; a recomputed gather, the recomputed matmuls."""
    traced, p, topo = _planned("2x4", "dp,tp", "fsdp_tp_sp")
    sched = _Scheduler(traced, p, topo, StepOptions(async_tp=True, ac=ACPolicy.FULL))
    items = sched.items()

    def einsums(u, phase, equation_test):
        return [v for v in u.users if v.target is torch.ops.aten.einsum.default
                and traced.phase(v) is phase and equation_test(v.args[0]) and v.args[1][0] is u]

    checked = 0
    for it in items:
        u = it.node
        phase = Phase.FORWARD if it.recompute else it.phase
        left = einsums(u, phase, lambda eq: einsum_is_matmul(eq) is not None)
        grads = einsums(u, Phase.BACKWARD, einsum_is_weight_grad)
        if not left or not grads:
            continue
        fused = sched._matmul_readers_s(u, it)
        assert fused == pytest.approx(sum(sched._node_time(v, it.recompute) for v in left))
        assert fused > 0.0
        checked += 1
    # norm outputs (forward, recomputed) and gradients gathered in the backward
    assert checked >= 4 and any(it.recompute for it in items)


def test_activation_checkpointing_trades_time_for_memory():
    # long sequences: activations, not the 128K-vocabulary embedding and head, set the peak
    _, none = _schedule("4", None, "fsdp", seq=4096)
    _, sel = _schedule("4", None, "fsdp", seq=4096, ac=ACPolicy.SELECTIVE)
    _, full = _schedule("4", None, "fsdp", seq=4096, ac=ACPolicy.FULL)
    assert none.recompute_s == 0 and not none.recomputed
    assert 0 < sel.recompute_s < full.recompute_s
    assert len(sel.recomputed) < len(full.recomputed)
    assert full.peak_bytes < sel.peak_bytes < none.peak_bytes
    assert none.step_s < sel.step_s < full.step_s
    recomputed = [e for e in full.events if e.kind == EventKind.RECOMPUTE]
    assert recomputed and all(e.phase == "backward" for e in recomputed)
    assert {0, 1} <= {e.region for e in recomputed}  # both layers' forwards run again


def test_compile_fuses_memory_bound_work():
    _, eager = _schedule("4", None, "fsdp")
    _, comp = _schedule("4", None, "fsdp", compile=True)
    assert comp.compute_s < eager.compute_s
    assert len(comp.stream_events(COMPUTE_STREAM)) < len(eager.stream_events(COMPUTE_STREAM))
    # torchtitan compiles the decoder blocks only: their memory-bound values are recomputed in
    # the backward's kernels instead of saved; the eager loss region is the same in both
    assert comp.peak_bytes <= eager.peak_bytes
    def saved(s):
        return sum(lt.size for lt in s.lifetimes if lt.category == "saved_activations")

    assert saved(comp) < saved(eager)
    head = [e for e in comp.stream_events(COMPUTE_STREAM) if not 0 <= e.region < 2]
    eager_head = [e for e in eager.stream_events(COMPUTE_STREAM) if not 0 <= e.region < 2]
    assert len(head) == len(eager_head)


def test_memory_peak_holds_the_state_and_grows_with_the_layers():
    traced, s2 = _schedule("4", None, "fsdp", param_bytes=4, grad_bytes=4)
    n_params = sum(traced.node(ph).meta["val"].numel() for ph in traced.params.values())
    # fp32 master weights and Adam's two moments all step long; fp32 gradients from their
    # reduce_scatter to the optimizer, which the peak includes when it comes at the end
    assert s2.static_bytes == pytest.approx(n_params / 4 * (4 + 8), rel=1e-3)
    assert s2.peak_bytes >= s2.static_bytes + n_params / 4 * 4
    t3, p3, topo = _planned("4", None, "fsdp", layers=3)
    s3 = schedule_step(t3, p3, topo, StepOptions(param_bytes=4, grad_bytes=4))
    assert s3.peak_bytes > s2.peak_bytes


def test_extrapolating_identical_layers_matches_tracing_them():
    """k and k+2 traced layers extrapolated to k+4 give what tracing k+4 layers gives (from
    k = 3: in this communication-heavy toy the first two layers are not yet steady)."""
    from shardwise.cost.hardware import get_hardware
    from shardwise.cost.step import PERIOD, estimate_prepared

    mesh = parse_mesh("4", None, HW)
    opts = {"ac": ACPolicy.SELECTIVE}
    k = 3
    prep = [_planned("4", None, "fsdp", layers=n)[:2] for n in (k, k + PERIOD, k + 2 * PERIOD)]
    tokens = 8 * 512
    depth = k + 2 * PERIOD
    direct = estimate_prepared([prep[2]], depth, tokens, mesh, get_hardware(HW), opts)
    extra = estimate_prepared(prep[:2], depth, tokens, mesh, get_hardware(HW), opts)
    assert extra.extrapolated_from == k and direct.extrapolated_from is None
    for field in ("step_s", "memory_allocated_peak_bytes", "recompute_s", "compute_s", "exposed_comm_s"):
        assert getattr(extra, field) == pytest.approx(getattr(direct, field), rel=0.005), field
    # the allocator's reserved bytes are not exactly linear in the layers (where a block is
    # carved from depends on what was cached before it): close, not exact
    assert extra.memory_per_device_bytes == pytest.approx(direct.memory_per_device_bytes, rel=0.05)


def test_attention_kernels_run_at_the_specs_attention_rate_and_nothing_else_moves():
    traced, p, topo = _planned("4", None, "fsdp")
    slow = MeshTopology(topo.mesh_shape, dataclasses.replace(topo.hw, attention_eff=topo.hw.compute_eff / 3))
    attention = {n.name for n in traced.gm.graph.nodes if "attention" in str(n.target)}
    assert attention
    durs = [{e.name: e.dur for e in schedule_step(traced, p, t, StepOptions()).stream_events(COMPUTE_STREAM)}
            for t in (topo, slow)]
    for name, dur in durs[0].items():
        assert durs[1][name] == pytest.approx(3 * dur if name in attention else dur), name


def test_the_optimizer_tail_clips_the_gradients_it_stores():
    """Clipping reads each gradient element and then reads and writes it: 3 passes over the
    stored gradient, so fp32 gradients (mixed precision) add 6 bytes an element to bf16 ones,
    beside the fused Adam's 28."""
    traced, p, topo = _planned("4", None, "fsdp")
    tails = [schedule_step(traced, p, topo, StepOptions(grad_bytes=g)).optimizer_s - topo.hw.launch_s
             for g in (None, 4)]
    assert tails[1] / tails[0] == pytest.approx((28 + 3 * 4) / (28 + 3 * 2))


def test_a_plan_priced_with_the_planners_costs_is_priced_the_same():
    """``schedule_step`` may reuse the planner's ``PlannerCosts`` (its caches warm): the events
    are those of a schedule with its own; costs for another mesh are refused."""
    from shardwise.cost.hardware import get_hardware
    from shardwise.plan.costs import PlannerCosts

    traced, p, topo = _planned("2x2", "dp,tp", "fsdp_tp")
    own = schedule_step(traced, p, topo, StepOptions())
    shared = PlannerCosts(topo.mesh_shape, get_hardware(HW))
    first = schedule_step(traced, p, topo, StepOptions(), shared)
    again = schedule_step(traced, p, topo, StepOptions(), shared)  # from the warm caches
    for got in (first, again):
        assert [(e.name, e.stream, e.start, e.end) for e in got.events] == \
            [(e.name, e.stream, e.start, e.end) for e in own.events]
    with pytest.raises(ValueError, match="cannot price"):
        schedule_step(traced, p, topo, StepOptions(), PlannerCosts((4,), get_hardware(HW)))
