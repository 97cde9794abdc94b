"""The auto plan is the fastest by the step schedule (what ``shardwise estimate`` reports) of the
ILP's solution and the hand plans that are points of the ILP: never slower than a hand plan by
the measure the report prints."""

from __future__ import annotations

from dataclasses import replace

import pytest

from shardwise.cost.step import price_plan
from shardwise.mesh import Mesh
from shardwise.passes.remat import ACPolicy
from shardwise.plan import BASELINES, make_plan
from shardwise.plan.planner import NO_PLAN, _fastest_by_schedule, plan_with_baselines

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
    solution = replace(hand[slowest], name="auto",
                       info={**hand[slowest].info, "admissible": list(hand)})
    chosen = _fastest_by_schedule(tiny, MESH, solution, hand, {})
    assert chosen.name == "auto" and chosen.info["chosen_from"] == fastest
    assert chosen.params == hand[fastest].params and chosen.nodes == hand[fastest].nodes
    assert chosen.info["schedule"]["step_s"] == pytest.approx(priced[fastest], rel=1e-12)
    assert chosen.info["ilp_solution"]["step_s"] == pytest.approx(priced[slowest], rel=1e-12)
    assert price_plan(tiny, chosen, MESH, {}).step_s == pytest.approx(priced[fastest], rel=1e-12)


def test_a_hand_plan_that_is_no_point_of_the_ilp_is_not_chosen(tiny, hand):
    """Not admissible (it breaks a constraint, or does not fit): however fast, it is not the plan."""
    priced = {n: price_plan(tiny, b, MESH, {}).step_s for n, b in hand.items()}
    slowest, fastest = max(priced, key=priced.get), min(priced, key=priced.get)
    solution = replace(hand[slowest], name="auto", info={**hand[slowest].info, "admissible": [slowest]})
    chosen = _fastest_by_schedule(tiny, MESH, solution, hand, {})
    assert chosen.info["chosen_from"] == "ilp" and chosen.params == hand[slowest].params
    assert priced[fastest] < chosen.info["schedule"]["step_s"]
