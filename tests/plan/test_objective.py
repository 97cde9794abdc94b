"""The ILP's schedule objective (plan/objective.py): which terms overlap, and that the objective
of a plan is what the step schedule prices it at where the model is exact."""

from __future__ import annotations

import math
from unittest import mock

import numpy as np
import pytest
import torch
from torch import fx
from torch.distributed.tensor import Replicate, Shard

from shardwise.cost.hardware import get_hardware
from shardwise.cost.step import price_plan, torchtitan_options
from shardwise.ir.regions import alias_root
from shardwise.ir.trace import Phase, trace_model
from shardwise.mesh import Mesh
from shardwise.passes.pipeline import canonicalize
from shardwise.passes.remat import ACPolicy
from shardwise.plan import make_plan
from shardwise.plan.cluster import HEAD, TAIL, cluster
from shardwise.plan.costs import PlannerCosts
from shardwise.plan.ilp import build
from shardwise.plan.objective import GRAD_SINK, Load, ScheduleObjective
from shardwise.plan.planner import _price_by_schedule_objective, prepare_plan
from shardwise.plan.strategies import intern

MESH = Mesh((2, 2), ("dp", "tp"), "h100")
NO_TIME_S = 1e-9


@pytest.fixture(scope="module")
def tiny(tiny_two_layers):
    return tiny_two_layers


def _objective(tr) -> ScheduleObjective:
    return ScheduleObjective(tr, cluster(tr), PlannerCosts(MESH.shape, get_hardware(MESH.hardware)),
                             torchtitan_options(tr))


def test_a_parameter_is_gathered_once_per_phase(tiny):
    obj = _objective(tiny)
    wq = tiny.node(tiny.params["layers.0.attention.wq.weight"])
    # the weight or a view of it (its transpose) read by the forward and by the backward
    value = next(n for n in [wq, *wq.users] if {tiny.phase(u) for u in n.users} == set(Phase))
    readers = [(value, u, 0) for u in value.users]
    assert not obj.kept(wq)
    groups = obj.split(readers, obj.kept(wq))
    assert len(groups) == 2 and all(len({tiny.phase(k[1]) for k in g}) == 1 for g in groups)
    act = next(n for n in tiny.gm.graph.nodes if n.op == "call_function" and len(n.users) > 1)
    keys = [(act, u, 0) for u in act.users]
    assert not obj.kept(act) and obj.split(keys, False) == [keys]  # an activation moves to a placement once


def test_a_gathers_later_collective_on_the_inner_dim_is_waited_for(tiny):
    """A parameter gathered through both mesh dims is a chain: only its first collective runs
    under the block before its readers'; a later one on the innermost (tensor-parallel) dim
    queues there when the first ends, ahead of that block's own collectives, which its kernels
    wait for (the step schedule's streams run in issue order; llama3-8b, 32 layers over 8x8:
    the ILP's plan gathered wo over dp then tp, 0.3688 s a step against 0.3214 s without)."""
    obj = _objective(tiny)
    for layer in (0, 1):
        wq = tiny.node(tiny.params[f"layers.{layer}.attention.wq.weight"])
        reader = next(u for u in wq.users if tiny.phase(u) is Phase.FORWARD)
        obj.charge(0, 1.0, [(wq, reader, 0)], shares=(0.75, 0.25), kept=obj.kept(wq))
    # in the block before each copy's (the layers are one cluster): layer 0's before the head's,
    # the last layer's (its gathers kept for the backward) before the cluster's own
    for copy in obj._copies(obj._block(reader)):
        assert obj.terms[obj.canon.get(obj.pred[copy], obj.pred[copy])] == {Load.HIDDEN: {0: 0.75},
                                                                             Load.EXPOSED: {0: 0.25}}


@pytest.mark.parametrize("src,dims", [(("S(0)", "S(1)"), (0, 1)), (("S(0)", "S(0)"), (1, 0, 1))])
def test_a_move_s_share_queued_on_the_inner_dim(src, dims):
    """(S(0), S(1)) -> (R, R) gathers over dp, then over tp: the tp gather waits for the dp one.
    (S(0), S(0)) -> (R, R) gathers an eighth over tp, then over dp, then the whole over tp
    (``cost/reshard.hop_tree``): the first tp gather runs at once, the last one waits. What runs
    at once is priced at its larger mesh dim's part where it is issued under the block before
    its readers' (a block's chains pipeline over the dims' streams), whole before the first
    block."""
    costs = PlannerCosts((8, 8), get_hardware("h100"))
    val = torch.empty((4096, 4096), dtype=torch.bfloat16, device="meta")
    parse = {"S(0)": Shard(0), "S(1)": Shard(1)}
    srcs, dsts = [intern(tuple(parse[p] for p in src))], [intern((Replicate(), Replicate()))]
    uses = costs.reshard(srcs[0], dsts[0], val).collectives
    assert tuple(u.mesh_dim for u in uses) == dims
    times = [costs.topology.collective_time(u.kind, u.bytes, u.mesh_dim) for u in uses]
    first, later = costs.move_shares(srcs, dsts, val)[0, 0]
    assert later == pytest.approx(times[-1] / sum(times))
    at_once: dict[int, float] = {}
    for t, u in zip(times[:-1], uses[:-1], strict=True):
        at_once[u.mesh_dim] = at_once.get(u.mesh_dim, 0.0) + t
    assert first == pytest.approx(max(at_once.values()) / sum(times))
    assert (first + later == pytest.approx(1.0)) == (len(at_once) == 1)
    first, later = costs.move_shares(srcs, dsts, val, pipelined=False)[0, 0]
    assert first + later == pytest.approx(1.0)


def test_a_plan_without_collectives_is_priced_as_the_schedule_prices_it():
    """On a mesh of one device there is no communication: the objective is the compute stream
    (causal attention at half its FLOPs) plus the optimizer step, exactly the schedule's."""
    tr = trace_model("llama-tiny", layers=2, batch=8, seq=256)
    canonicalize(tr)
    mesh = Mesh((1,), ("dp",), "h100")
    plan = make_plan(tr, mesh, step_options={})
    assert plan.info["objective"] == "schedule"
    step = price_plan(tr, plan, mesh, {}).step_s
    assert plan.info["objective_s"] == pytest.approx(step, rel=1e-6)
    serial = make_plan(tr, mesh).info["objective_s"]
    assert abs(serial - step) > 1e-3 * step  # the serial sum prices it otherwise


def test_hidden_gathers_make_fsdp_cheaper_than_its_serial_sum(tiny):
    serial = make_plan(tiny, MESH, baseline="fsdp")
    sched = make_plan(tiny, MESH, baseline="fsdp", step_options={})
    assert sched.info["objective"] == "schedule" and serial.info["objective"] == "serial"
    assert sched.info["objective_s"] < serial.info["objective_s"]
    assert sched.info["objective_s"] >= sched.info["bound_s"]


def test_the_objective_of_a_plan_is_its_price_as_a_start(tiny):
    """The solve reports the objective at its point (the maximum form, whatever the refinement
    charged); started from that plan with no time to search, the ILP prices it the same."""
    mesh = Mesh((2,), ("dp",), "h100")  # (a 1-D mesh: a quicker solve than 2x2's)
    auto = make_plan(tiny, mesh, step_options={})
    again = make_plan(tiny, mesh, step_options={}, start_from=[auto], time_limit_s=NO_TIME_S)
    assert again.info["start_s"] == pytest.approx(auto.info["objective_s"], rel=1e-9)
    assert again.params == auto.params


# The agreement issue 15 asks of the objective of a plan with the schedule's step time.
AGREEMENT = 0.01
# Where the ILP's per-block max is not the schedule (plan/objective.py, "Not modelled": one
# communication stream for all mesh dims, a block waiting for all its prefetched gathers where
# the schedule starts it at its first parameter's): the relative difference measured on these
# plans (up to 0.037, fsdp's; it was 0.218 while its gathers over both dims' streams were priced
# as their sum, not as the larger stream's part: ``PlannerCosts.move_shares``), with head room.
ENVELOPE = 0.1


@pytest.fixture(scope="module")
def tiny256():
    tr = trace_model("llama-tiny", layers=2, batch=8, seq=256)
    canonicalize(tr)
    return tr


@pytest.mark.parametrize("shape,names", [((2,), ("dp",)), ((4,), ("dp",))])
def test_the_auto_plan_is_priced_as_the_schedule_prices_it(tiny256, shape, names):
    mesh = Mesh(shape, names, "h100")
    auto = make_plan(tiny256, mesh, step_options={})
    step = price_plan(tiny256, auto, mesh, {}).step_s
    assert auto.info["objective_s"] == pytest.approx(step, rel=AGREEMENT)


def test_the_reductions_the_last_layer_makes_late_are_priced_after_its_kernels():
    """The plan the ILP chooses without the drain (``ScheduleObjective._drain_rows``) ends its
    step with the last layer's late gradients still reducing when the head's are issued: without
    the rows it is priced more than 1% under the schedule, with them within 1%."""
    tiny = trace_model("llama-tiny", layers=2, batch=8, seq=128)
    canonicalize(tiny)
    mesh = Mesh((4,), ("dp",), "h100")
    with mock.patch.object(ScheduleObjective, "_drain_rows", lambda self: ([], [])):
        undrained = make_plan(tiny, mesh, step_options={})
    step = price_plan(tiny, undrained, mesh, {}).step_s
    assert undrained.info["objective_s"] < (1 - AGREEMENT) * step
    priced = make_plan(tiny, mesh, step_options={}, start_from=[undrained], time_limit_s=NO_TIME_S)
    assert priced.params == undrained.params
    assert priced.info["start_s"] == pytest.approx(step, rel=AGREEMENT)


def test_ddp_is_priced_as_the_schedule_prices_it(tiny256):
    """DDP's gradient all_reduces run under the backward of their own layer (the layer before
    the head's included): only the head's are after the last kernel. (Charged exposed too, the
    layer before the head's made the objective 23% dearer than the step.)"""
    mesh = Mesh((4,), ("dp",), "h100")
    ddp = make_plan(tiny256, mesh, baseline="ddp", step_options={})
    step = price_plan(tiny256, ddp, mesh, {}).step_s
    assert ddp.info["objective_s"] == pytest.approx(step, rel=3 * AGREEMENT)


@pytest.mark.parametrize("name", ["ddp", "fsdp", "fsdp_tp", "fsdp_tp_sp"])
def test_every_hand_plan_is_priced_within_the_documented_envelope(tiny256, name):
    mesh = Mesh((2, 2), ("dp", "tp"), "h100")
    plan = make_plan(tiny256, mesh, baseline=name, step_options={})
    step = price_plan(tiny256, plan, mesh, {}).step_s
    assert plan.info["objective_s"] == pytest.approx(step, rel=ENVELOPE)


def test_a_layers_reductions_over_both_dims_of_one_node_are_priced_per_stream(tiny256):
    """DDP over a 2x2 mesh inside one node all_reduces each gradient over dp, then tp; the
    schedule runs one's tp collective beside the next one's dp collective, and the objective
    prices a layer's at their larger part (``ScheduleObjective.pipelined_reduction``): within 2%
    of the step (1.017; at their sum, 1.050)."""
    mesh = Mesh((2, 2), ("dp", "tp"), "h100")
    ddp = make_plan(tiny256, mesh, baseline="ddp", step_options={})
    step = price_plan(tiny256, ddp, mesh, {}).step_s
    assert ddp.info["objective_s"] == pytest.approx(step, rel=2 * AGREEMENT)


def test_a_hand_plan_the_serial_objective_chose_is_priced_by_the_schedule_objective(tiny256):
    """A hand plan whose free choices the serial objective made (``shardwise estimate``'s, which
    the planner returns where the schedule finds it faster) carries the serial sum as its
    objective; the planner prices it by the auto ILP's objective instead, so that it is ordered
    among the solver's starts and reported beside the auto ILP's bound in one kind."""
    mesh = Mesh((4,), ("dp",), "h100")
    faithful = make_plan(tiny256, mesh, baseline="fsdp", memory_budget=math.inf, step_options=None)
    serial = faithful.info["objective_s"]
    step = price_plan(tiny256, faithful, mesh, {}).step_s
    assert faithful.info["objective"] == "serial" and serial > (1 + ENVELOPE) * step  # overlaps nothing
    _price_by_schedule_objective(prepare_plan(tiny256, mesh, step_options={}), faithful)
    assert faithful.info["objective"] == "schedule" and faithful.info["serial_objective_s"] == serial
    assert faithful.info["objective_s"] == pytest.approx(step, rel=ENVELOPE)
    by_schedule = make_plan(tiny256, mesh, baseline="fsdp", step_options={})
    assert by_schedule.nodes == faithful.nodes
    assert faithful.info["objective_s"] == pytest.approx(by_schedule.info["objective_s"], rel=1e-9)


def test_the_last_layer_keeps_its_forward_gathers_for_its_backward(tiny):
    """torchtitan keeps the last block's parameters gathered from the forward to the backward,
    and the schedule prices it so. The ILP groups a weight's edges over all its transposes (the
    forward reads t(w), the backward t(t(w))); the objective keeps the last layer's in one
    group, which pays a placement once, at its first (forward) reader. Every other layer's
    backward gathers again, in a group of its own."""
    splits = []

    class Recorded(ScheduleObjective):
        def split(self, keys, kept):
            splits.append(super().split(keys, kept))
            return splits[-1]

    prep = _built(tiny)
    obj = Recorded(tiny, prep.clus, prep.costs, torchtitan_options(tiny))
    build(tiny, prep.ns, prep.clus, prep.costs, schedule=obj)
    wq = prep.clus.rep[tiny.node(tiny.params["layers.0.attention.wq.weight"])]
    by_layer = {}
    for groups in splits:
        keys = [k for g in groups for k in g]
        if keys and alias_root(keys[0][0]) is wq:
            bwd = {obj._block(k[1])[1] for k in keys if tiny.phase(k[1]) is Phase.BACKWARD}
            by_layer[bwd.pop()] = groups
    assert sorted(by_layer) == [0, 1]
    assert [{tiny.phase(k[1]) for k in g} for g in by_layer[0]] == [{Phase.FORWARD}, {Phase.BACKWARD}]
    (last,) = by_layer[1]
    assert {tiny.phase(k[1]) for k in last} == set(Phase)
    assert len({k[0] for k in last}) >= 2  # t(w) and t(t(w)), one group

    plain = _objective(tiny)
    plain.charge(0, 1.0, last)
    assert {b[0] for b in plain.terms} == {Phase.FORWARD}
    assert sum(t for loads in plain.terms.values() for t in loads[Load.HIDDEN].values()) == pytest.approx(1.0)


def test_the_last_layer_keeps_its_gathers_where_its_backward_joins_the_other_layers(tiny_four_layers):
    """The last layer's backward joins its cluster (``cluster``): its weights' forward edges are
    every layer's, its backward ones its own (their readers keep their own variables). The
    objective charges its moves apart, once over both phases and before the last layer's block
    (``ScheduleObjective.kept``), and the other layers' before their own blocks: none before the
    tail's backward, none before the head's forward for the last layer."""
    four = tiny_four_layers
    splits = []

    class Recorded(ScheduleObjective):
        def split(self, keys, kept):
            splits.append((kept, super().split(keys, kept)))
            return splits[-1][1]

    prep = _built(four)
    obj = Recorded(four, prep.clus, prep.costs, torchtitan_options(four))
    build(four, prep.ns, prep.clus, prep.costs, schedule=obj)
    wq = prep.clus.rep[four.node(four.params["layers.0.attention.wq.weight"])]
    mine = {kept: groups for kept, groups in splits if groups[0] and alias_root(groups[0][0][0]) is wq}
    assert sorted(mine) == [False, True]
    assert len(mine[True]) == 1 and [{four.phase(k[1]) for k in g} for g in mine[False]] == [
        {Phase.FORWARD}, {Phase.BACKWARD}]
    (kept,) = mine[True]
    forward, backward = mine[False]
    assert {k for k in kept if four.phase(k[1]) is Phase.FORWARD} == set(forward)
    assert {k for k in kept if four.phase(k[1]) is Phase.BACKWARD}.isdisjoint(backward)

    def charged(keys, kept):
        plain = _objective(four)
        plain.charge(0, 1.0, keys, kept=kept)
        return {b: sum(loads[Load.HIDDEN].values()) for b, loads in plain.terms.items()}

    head, tail_bwd = (Phase.FORWARD, HEAD), (Phase.BACKWARD, TAIL)
    assert head not in charged(mine[True][0], True)
    assert charged(mine[False][0], False)[head] == pytest.approx(1 / 3)  # layer 0 of 0..2
    assert tail_bwd not in charged(mine[False][1], False)


def test_a_gradient_is_reduced_under_its_own_block_but_the_last_and_the_tails(tiny):
    obj = _objective(tiny)
    for pname, gname in tiny.grads.items():
        g = tiny.node(gname)
        obj.charge(0, 1.0, [(g, tiny.node(tiny.params[pname]), GRAD_SINK)])
    exposed = sum(t for loads in obj.terms.values() for t in loads.get(Load.EXPOSED, {}).values())
    hidden = sum(t for loads in obj.terms.values() for t in loads.get(Load.HIDDEN, {}).values())
    root = [p for p in tiny.grads if not p.startswith("layers.")]
    # the head's gradients (the embedding) are reduced after the backward's last kernel
    head = [p for p in root if obj._block(tiny.node(tiny.grads[p])) == obj.last]
    assert head and exposed == pytest.approx(len(head))
    assert hidden == pytest.approx(len(tiny.grads) - len(head))
    # the tail's (the output weight's and the final norm's, made by the tail's last kernels)
    # under the last layer's backward, where the schedule runs them; the tail's block has none
    tail = [p for p in root if obj._block(tiny.node(tiny.grads[p])) == (Phase.BACKWARD, TAIL)]
    assert "output.weight" in tail
    assert not obj.terms.get((Phase.BACKWARD, TAIL), {}).get(Load.HIDDEN)
    # (the last layer's backward pairs with the first's: their cluster's block holds both)
    block = (Phase.BACKWARD, obj.last_layer)
    under = obj.terms[obj.canon.get(block, block)][Load.HIDDEN][0]
    layers = {f"layers.{b[1]}." for b in obj._copies(block)}
    assert len(layers) == 2
    layer_grads = [p for p in tiny.grads if p.startswith(tuple(layers))]
    assert under == pytest.approx(len(layer_grads) + len(tail))


def _built(tr):
    """The placement ILP of ``tr`` over MESH with the schedule objective, as the planner builds it."""
    return prepare_plan(tr, MESH, step_options={"ac": ACPolicy.NONE})


def _traced():
    tr = trace_model("llama-tiny", layers=2, batch=8, seq=32)
    canonicalize(tr)
    return tr


def test_the_same_graph_gives_the_same_model():
    """The ILP is built in the graph's order, not in the order of sets of nodes (which follows
    their hashes: another trace of the same model gave HiGHS its columns in another order)."""
    first, second = (_built(_traced()).model.m for _ in range(2))
    assert (first.cost, first.index, first.value, first.row_lb) == (second.cost, second.index, second.value,
                                                                    second.row_lb)


def test_a_move_several_readers_share_is_charged_to_the_first(tiny):
    """A value moved to a placement once serves every reader that needs it there: the wait is
    the first reader's (a forward one), not that of a backward reader that reuses the copy. The
    ILP hands each producer's edges over in its readers' graph order, and the objective
    charges the first one's block."""
    order = {n: i for i, n in enumerate(tiny.gm.graph.nodes)}
    tags = []

    class Recorded(ScheduleObjective):
        def charge(self, col, seconds, tag, shares=None, kept=False):
            if not isinstance(tag, fx.Node):
                tags.append(list(tag))
            super().charge(col, seconds, tag, shares, kept)

    prep = _built(tiny)
    build(tiny, prep.ns, prep.clus, prep.costs, schedule=Recorded(tiny, prep.clus, prep.costs,
                                                                   torchtitan_options(tiny)))
    obj = _objective(tiny)
    # an activation's readers in both phases (a root parameter's readers are one group too)
    shared = [t for t in tags if {tiny.phase(k[1]) for k in t} == set(Phase) and not obj._is_param(t[0][0])]
    assert shared and all(t == sorted(t, key=lambda k: (order[k[1]], k[2])) for t in tags)
    obj.charge(0, 1.0, shared[0])
    first = obj._block(shared[0][0][1])
    assert first[0] is Phase.FORWARD
    assert obj.terms == {obj.canon.get(first, first): {Load.EXPOSED: {0: 1.0}}}


def test_recomputation_costs_something_where_communication_outlasts_the_compute(tiny):
    """A backward block that runs 1 ms of hidden communication and little compute: the max rows
    alone price recomputing a forward kernel of its layer at nothing, and the ILP checkpointed
    layers for no memory (llama3-8b, 32 layers over 8x8: a step 0.4082 s against 0.3688 s by
    the schedule). The objective keeps the plan that recomputes dearer than the one that does not."""
    obj = _objective(tiny)
    kernel = next(n for n in tiny.gm.graph.nodes if n.op == "call_function" and tiny.phase(n) is Phase.FORWARD
                  and obj.region.get(n) == 0 and "einsum" in n.name)
    layer_backward = (Phase.BACKWARD, 0)
    obj._add(layer_backward, Load.HIDDEN, 0, 1e-3)  # column 0: what the plan moves
    obj.charge_recompute(1, 1e-5, kernel)  # column 1: the kernel recomputed
    moves_only, recomputes = np.array([1.0, 0.0]), np.array([1.0, 1.0])
    assert obj.value(recomputes) > obj.value(moves_only) == pytest.approx(1e-3)
