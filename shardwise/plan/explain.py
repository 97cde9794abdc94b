"""Why a node (or parameter) got its placement: what each alternative would cost.

``explain(traced, plan, name)`` takes one node of a plan, or a parameter by name, and prices
every strategy it could have run, everything else held as planned:

- compute: the node's roofline time on the strategy's local shapes;
- communication: for the chosen strategy, moving each input from its producer's planned
  placement to what the strategy reads, and moving the output to what each consumer reads (for
  a parameter, also its gradient's synchronisation into the parameter's placement), each value
  moved to a placement once, as the ILP and the lowering do: an input move the plan already
  makes for another reader costs nothing more, and consumers reading the output in one placement
  share one move; for any other, that plus what the plan's moves change by with the node so
  (``planner.plan_moves``, which also moves a value from the copy of it cheapest to move);
- memory: for a parameter, its local bytes with gradient and optimizer state (training); for an
  activation the backward reads, its local bytes.

This is a neighbourhood view: the ILP chose the whole assignment at once, so an alternative that
looks cheaper here would force other nodes to change (which is why it was not taken); one that
looks dearer shows what the choice saves. Each alternative's communication is exactly what it
adds to the plan's, so with everything else held, the plan's step time changes by the difference
between an alternative's ``time_s`` and the chosen one's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import fx

from shardwise.cost.hardware import get_hardware
from shardwise.errors import UserError
from shardwise.ir.trace import Traced
from shardwise.mesh import Mesh
from shardwise.plan.costs import PlannerCosts, local_bytes
from shardwise.plan.ilp import MemoryModel
from shardwise.plan.placement import Placements, placements_str
from shardwise.plan.plan import NodeSpec, Plan, tensor_args
from shardwise.plan.planner import destination, edges, plan_moves
from shardwise.plan.strategies import Strategy, enumerate_strategies


@dataclass(frozen=True)
class Alternative:
    output: Placements
    inputs: tuple[Placements, ...]
    compute_s: float
    comm_s: float
    memory_bytes: int
    chosen: bool

    @property
    def time_s(self) -> float:
        return self.compute_s + self.comm_s

    def to_json(self) -> dict:
        return {"output": placements_str(self.output), "inputs": [placements_str(p) for p in self.inputs],
                "compute_s": self.compute_s, "comm_s": self.comm_s, "time_s": self.time_s,
                "memory_bytes": self.memory_bytes, "chosen": self.chosen}


@dataclass(frozen=True)
class Explanation:
    name: str  # as asked: a parameter name or a node name
    node: str
    alternatives: list[Alternative]  # cheapest (time) first

    def to_json(self) -> dict:
        return {"name": self.name, "node": self.node,
                "alternatives": [a.to_json() for a in self.alternatives]}


def explain(traced: Traced, plan: Plan, name: str, *, memory: MemoryModel | None = None) -> Explanation:
    """Every alternative for ``name`` (a parameter or a node of ``traced``), priced as above."""
    node = _resolve(traced, plan, name)
    mesh = plan.mesh
    costs = PlannerCosts(mesh.shape, get_hardware(plan.hardware))
    per_byte = (memory or MemoryModel()).bytes_per_byte(traced, node)
    chosen = plan.nodes[node.name]
    touching = [(u, v, j) for u, v, j in edges(traced) if node in (u, v)]
    inputs = {u for u, _, _ in touching if u is not node}
    # Moves of the node's inputs the plan makes for other readers anyway.
    paid = {(u, destination(plan, v, j)) for u, v, j in edges(traced) if u in inputs and v is not node}
    moves: dict[tuple[fx.Node, Placements], Placements] = {}  # (value, to) -> from, as chosen
    for u, v, j in touching:
        src, dst = plan.nodes[u.name].output[0], destination(plan, v, j)
        if src != dst and (u, dst) not in paid:
            moves[(u, dst)] = src
    own = sum(costs.reshard(src, dst, u.meta["val"]).time_s for (u, dst), src in moves.items())
    step, _ = plan_moves(traced, plan, costs)
    alts = []
    for s in _strategies(node, mesh):
        out = s.output[0]
        is_chosen = s.output == chosen.output and s.inputs == chosen.inputs
        other = replace(plan, nodes={**plan.nodes, node.name: NodeSpec((out,), s.inputs)})
        comm = own if is_chosen else own + plan_moves(traced, other, costs)[0] - step
        alts.append(Alternative(out, s.inputs, costs.compute_time(node, s), comm,
                                int(local_bytes(node.meta["val"], out, mesh.shape) * per_byte), is_chosen))
    alts.sort(key=lambda a: (a.time_s, not a.chosen))
    return Explanation(name, node.name, alts)


def _resolve(traced: Traced, plan: Plan, name: str) -> fx.Node:
    target = traced.params.get(name, name)
    node = next((n for n in traced.gm.graph.nodes if n.name == target), None)
    if node is None or node.name not in plan.nodes or not isinstance(node.meta.get("val"), torch.Tensor):
        raise UserError(f"{name!r} is neither a parameter nor a tensor node of the plan; parameters are "
                        f"named like {next(iter(traced.params), 'layers.0.attention.wq.weight')}.")
    return node


def _strategies(node: fx.Node, mesh: Mesh) -> list[Strategy]:
    """Every strategy ``node`` could run, its inputs free to take any placement: the planner's
    enumeration on a graph of the node alone."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for a in dict.fromkeys([node] if node.op == "placeholder" else tensor_args(node)):  # x * x: one input
        env[a] = g.placeholder(a.name)
        env[a].meta["val"] = a.meta["val"]
    alone = env[node] if node.op == "placeholder" else g.node_copy(node, lambda a: env.get(a, a))
    g.output(alone)
    return enumerate_strategies(fx.GraphModule(torch.nn.Module(), g), mesh.device_mesh())[alone].strategies
