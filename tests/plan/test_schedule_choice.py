"""The auto plan is the fastest by the step schedule (what ``shardwise estimate`` reports) of the
ILP's solution and the hand plans that are points of the ILP: never slower than a hand plan by
the measure the report prints."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from shardwise.cost.step import price_plan, regions_layers
from shardwise.ir.trace import trace_model
from shardwise.mesh import Mesh
from shardwise.passes.pipeline import canonicalize
from shardwise.passes.remat import ACPolicy
from shardwise.plan import BASELINES, make_plan
from shardwise.plan.plan import ACChoice, ACGroup
from shardwise.plan.planner import (
    ALTERNATIVE_GAIN,
    NO_PLAN,
    _fastest_by_schedule,
    _fastest_solution,
    _lighten_ac,
    _lighter_ac,
    _Pricer,
    plan_with_baselines,
)

MESH = Mesh((2, 2), ("dp", "tp"), "h100")


@pytest.fixture(scope="module")
def tiny(tiny_two_layers):
    return tiny_two_layers


@pytest.fixture(scope="module")
def hand(tiny):
    return {name: make_plan(tiny, MESH, baseline=name) for name in BASELINES}


def test_auto_is_never_slower_than_an_admissible_hand_plan_by_the_schedule(tiny):
    opts = {"ac": ACPolicy.SELECTIVE, "compile": True, "async_tp": True}
    auto, hand = plan_with_baselines(tiny, MESH, step_options=opts)
    step = auto.info["schedule"]["step_s"]
    assert auto.info["chosen_from"] in ("ilp", *BASELINES)
    applies = {n for n, b in hand.items() if b is not None and b.status not in NO_PLAN}
    assert set(auto.info["admissible"]) == applies
    for name in auto.info["admissible"]:
        assert step <= hand[name].info["schedule"]["step_s"] * (1 + 1e-9), name
    # the recorded figures are the schedule's, with the options as they applied
    again = price_plan(tiny, auto, MESH, opts)
    assert again.step_s == pytest.approx(step, rel=1e-12)
    assert auto.info["schedule"]["options"]["ac"] == "selective"


def test_a_hand_plan_faster_by_the_schedule_replaces_the_ilp_solution(tiny, hand):
    """Handed the slowest hand plan as the ILP's solution, the choice is the fastest admissible
    hand plan, returned as the auto plan, naming its source and the solution it beat."""
    priced = {n: price_plan(tiny, b, MESH, {}).step_s for n, b in hand.items()}
    slowest, fastest = max(priced, key=priced.get), min(priced, key=priced.get)
    assert priced[fastest] < priced[slowest]
    # An optimal solution cheaper by the objective than every hand plan, its bound its own price.
    cheapest = 0.5 * min(b.info["objective_s"] for b in hand.values())
    solution = replace(hand[slowest], name="auto", status="optimal", mip_gap=0.0,
                       info={**hand[slowest].info, "admissible": list(hand), "objective_s": cheapest,
                             "bound_s": cheapest})
    chosen = _fastest_by_schedule(tiny, MESH, solution, hand, {})
    assert chosen.name == "auto" and chosen.info["chosen_from"] == fastest
    assert chosen.params == hand[fastest].params and chosen.nodes == hand[fastest].nodes
    assert chosen.info["schedule"]["step_s"] == pytest.approx(priced[fastest], rel=1e-12)
    assert chosen.info["ilp_solution"]["step_s"] == pytest.approx(priced[slowest], rel=1e-12)
    assert price_plan(tiny, chosen, MESH, {}).step_s == pytest.approx(priced[fastest], rel=1e-12)
    # Objective, bound and gap are the plan's own; the solution's are kept beside it.
    objective = hand[fastest].info["objective_s"]
    assert chosen.info["objective_s"] == objective and chosen.info["bound_s"] == cheapest
    assert chosen.mip_gap == pytest.approx(1 - cheapest / objective, rel=1e-12)
    assert chosen.status == "feasible"  # dearer by the objective than the optimum it replaced
    kept = chosen.info["ilp_solution"]
    assert (kept["objective_s"], kept["status"], kept["mip_gap"]) == (cheapest, "optimal", 0.0)


def test_a_hand_plan_that_is_no_point_of_the_ilp_is_not_chosen(tiny, hand):
    """Not admissible (it breaks a constraint, or does not fit): however fast, it is not the plan."""
    priced = {n: price_plan(tiny, b, MESH, {}).step_s for n, b in hand.items()}
    slowest, fastest = max(priced, key=priced.get), min(priced, key=priced.get)
    solution = replace(hand[slowest], name="auto", info={**hand[slowest].info, "admissible": [slowest]})
    chosen = _fastest_by_schedule(tiny, MESH, solution, hand, {})
    assert chosen.info["chosen_from"] == "ilp" and chosen.params == hand[slowest].params
    assert priced[fastest] < chosen.info["schedule"]["step_s"]


def test_lighter_checkpointing_variants_recompute_less():
    group = ACGroup((0, 1, 2, 3), none=1, selective=1, full=2)
    variants = _lighter_ac(ACChoice((group,)))
    assert [v.describe() for v in variants] == [
        ACChoice.uniform([0, 1, 2, 3], ACPolicy.NONE).describe(),
        ACChoice((ACGroup((0, 1, 2, 3), none=2, selective=2, full=0),)).describe()]
    # nothing lighter than no checkpointing; one rung down from all selective is all none
    assert _lighter_ac(ACChoice.uniform([0, 1], ACPolicy.NONE)) == []
    none = ACChoice.uniform([0, 1], ACPolicy.NONE)
    assert _lighter_ac(ACChoice.uniform([0, 1], ACPolicy.SELECTIVE)) == [none]


def test_checkpointing_the_schedule_finds_only_slower_is_lightened_where_the_lighter_step_fits():
    """Handed a plan that checkpoints every layer in full with memory to spare, the same
    placements run with less recomputation: faster by the schedule, and what estimate prices;
    under a limit, the fastest that fits."""
    # Activations big enough (1 MiB a tensor) that checkpointing moves the allocator's peak.
    traced = trace_model("llama-tiny", layers=2, batch=16, seq=256)
    canonicalize(traced)
    fsdp = make_plan(traced, MESH, baseline="fsdp")
    full = replace(fsdp, ac=ACChoice.uniform(sorted(regions_layers(traced)), ACPolicy.FULL), info={})
    full_est = price_plan(traced, full, MESH, {})
    lighter = _lighten_ac(full, _Pricer(traced, MESH, {}, None))
    assert lighter is not full and lighter.nodes == full.nodes
    assert lighter.info["ilp_ac"] == full.ac.describe() != lighter.ac.describe()
    step = lighter.info["schedule"]["step_s"]
    assert step < full_est.step_s
    assert price_plan(traced, lighter, MESH, {}).step_s == pytest.approx(step, rel=1e-12)

    # Under a limit the full plan's peak: no checkpointing, the fastest, holds more and is left
    # out; selective fits (the allocator's peak is the full plan's) and is faster than full.
    layers = sorted(regions_layers(traced))
    none, selective = (ACChoice.uniform(layers, p) for p in (ACPolicy.NONE, ACPolicy.SELECTIVE))
    priced = {v: price_plan(traced, replace(full, ac=v, info={}), MESH, {}) for v in (none, selective)}
    limit = full_est.memory_per_device_bytes
    assert priced[selective].memory_per_device_bytes <= limit < priced[none].memory_per_device_bytes
    assert priced[none].step_s < priced[selective].step_s < full_est.step_s
    assert _lighten_ac(full, _Pricer(traced, MESH, {}, float(limit))).ac == selective
    # and where nothing lighter fits, the plan stays
    assert _lighten_ac(full, _Pricer(traced, MESH, {}, float(limit - 1))) is full


def test_the_fastest_of_the_ilps_plans_by_the_schedule_is_the_solution(tiny, hand):
    """Among the ILP's solution and the other plans its solve found, the step schedule picks the
    fastest; the solution stays where none is faster."""
    plans = {n: replace(b, name="auto") for n, b in hand.items() if b is not None and b.status not in NO_PLAN}
    steps = {n: price_plan(tiny, b, MESH, {}).step_s for n, b in plans.items()}
    slowest, fastest = max(steps, key=steps.get), min(steps, key=steps.get)
    assert steps[fastest] < steps[slowest]
    price = _Pricer(tiny, MESH, {}, None)
    assert _fastest_solution(plans[slowest], [p for n, p in plans.items() if n != slowest], price) \
        is plans[fastest]
    assert _fastest_solution(plans[fastest], [p for n, p in plans.items() if n != fastest], price) \
        is plans[fastest]


def test_an_ilp_plan_that_fits_beats_a_faster_one_that_does_not(tiny, hand):
    plans = [replace(b, name="auto", info=dict(b.info))
             for b in hand.values() if b is not None and b.status not in NO_PLAN][:3]
    fits = {id(plans[0]): False, id(plans[1]): True, id(plans[2]): True}
    step = {id(plans[0]): 1.0, id(plans[1]): 3.0, id(plans[2]): 2.0}

    def price(plan):  # as _Pricer does, the figures recorded in the plan
        plan.info["schedule"] = {"step_s": step[id(plan)], "fits": fits[id(plan)]}
        return SimpleNamespace(**plan.info["schedule"])

    assert _fastest_solution(plans[0], plans[1:], price) is plans[2]
    fits[id(plans[1])] = fits[id(plans[2])] = False  # none fits: the fastest
    assert _fastest_solution(plans[1], [plans[0], plans[2]], price) is plans[0]
    # Faster by less than ALTERNATIVE_GAIN: the ILP's solution stays; by more, it does not.
    step[id(plans[0])] = step[id(plans[1])] * (1 - ALTERNATIVE_GAIN / 2)
    assert _fastest_solution(plans[1], [plans[0]], price) is plans[1]
    step[id(plans[0])] = step[id(plans[1])] * (1 - 2 * ALTERNATIVE_GAIN)
    assert _fastest_solution(plans[1], [plans[0]], price) is plans[0]
