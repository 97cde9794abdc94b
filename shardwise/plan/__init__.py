"""Planning: choose a DTensor placement for every node of a traced graph over a mesh."""

from shardwise.plan.baselines import BASELINES
from shardwise.plan.plan import CollectiveCount, Estimate, NodeSpec, Plan
from shardwise.plan.planner import Constraints, estimate, make_plan

__all__ = [
    "BASELINES", "CollectiveCount", "Constraints", "Estimate", "NodeSpec", "Plan", "estimate", "make_plan",
]
