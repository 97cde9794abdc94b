"""The ILP's schedule objective (plan/objective.py): which terms overlap, and that the objective
of a plan is what the step schedule prices it at where the model is exact."""

from __future__ import annotations

import pytest

from shardwise.cost.hardware import get_hardware
from shardwise.cost.step import price_plan, torchtitan_options
from shardwise.ir.trace import Phase, trace_model
from shardwise.mesh import Mesh
from shardwise.passes.pipeline import canonicalize
from shardwise.plan import make_plan
from shardwise.plan.cluster import cluster
from shardwise.plan.costs import PlannerCosts
from shardwise.plan.objective import ScheduleObjective

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
    groups = obj.split(readers)
    assert len(groups) == 2 and all(len({tiny.phase(k[1]) for k in g}) == 1 for g in groups)
    act = next(n for n in tiny.gm.graph.nodes if n.op == "call_function" and len(n.users) > 1)
    keys = [(act, u, 0) for u in act.users]
    assert obj.split(keys) == [keys]  # an activation moves to a placement once


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
