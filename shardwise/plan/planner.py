"""The planning driver: trace -> clusters -> strategies -> ILP -> Plan, with timings.

``make_plan(traced, mesh)`` gives the auto plan; ``baseline="fsdp"`` (etc.) the best plan that
keeps a hand-written plan's fixed choices (see ``baselines.py``); ``plan_with_baselines`` prices
the hand plans first and starts the auto solve from the cheapest that fits, keeping it where the
solver finds nothing better in its time (so the auto plan is never dearer than a hand plan).
All are priced by the same cost model, and ``estimate`` re-prices any plan node by node,
which is also how the report's collectives and memory are computed.
"""

from __future__ import annotations

import logging
import math
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from torch import fx
from torch.distributed.tensor import Partial, Replicate, Shard

from shardwise.cost.hardware import get_hardware
from shardwise.cost.reshard import leaves_copies, start_of_move
from shardwise.cost.units import format_bytes
from shardwise.errors import UserError
from shardwise.gcpause import paused_gc
from shardwise.ir.trace import Phase, Traced
from shardwise.mesh import Mesh
from shardwise.passes.remat import ACPolicy
from shardwise.plan.baselines import (
    BASELINES,
    BaselineSpec,
    baseline_refusal,
    baseline_spec,
    node_filter,
    tensor_parallel_uses,
)
from shardwise.plan.cluster import Clustering, cluster, no_clustering
from shardwise.plan.costs import PlannerCosts, local_bytes
from shardwise.plan.ilp import (
    GRAD_SINK,
    LOSS_SINK,
    IlpModel,
    IlpResult,
    MemoryModel,
    build,
    chosen_strategy,
    solve_built,
)
from shardwise.plan.placement import Placements, on_mesh, placements_str
from shardwise.plan.plan import (
    ACChoice,
    ACGroup,
    CollectiveCount,
    Estimate,
    NodeSpec,
    Plan,
    graph_fingerprint,
    tensor_args,
)
from shardwise.plan.solver import MIP_REL_GAP
from shardwise.plan.strategies import NodeStrategies, Strategy, enumerate_strategies

log = logging.getLogger(__name__)
# Memory kept free for the framework, allocator fragmentation and communication buffers.
MEMORY_RESERVE_FRACTION = 0.1
# The solver's time limit where the caller gives none, seconds.
DEFAULT_TIME_LIMIT_S = 60.0
# Plan statuses that come without placements: no plan fits the memory budget, or the solver's
# time ran out before it found one.
NO_PLAN = ("infeasible", "unsolved")


@dataclass(frozen=True)
class Constraints:
    """User constraints: placements by parameter name, by input placeholder name, and (inference)
    by output position. A training step's outputs are the loss (always replicated) and the
    gradients (placed as their parameters): constrain the parameters instead."""

    params: dict[str, Placements]
    inputs: dict[str, Placements]
    outputs: dict[int, Placements] = field(default_factory=dict)


def default_budget(mesh: Mesh) -> float:
    return get_hardware(mesh.hardware).mem_capacity * (1.0 - MEMORY_RESERVE_FRACTION)


# ``strategy_cache``'s key for the planner costs its calls share.
_COSTS = "costs"


def _planner_costs(mesh: Mesh, strategy_cache: dict | None) -> PlannerCosts:
    """The costs of plans on ``mesh``, kept in ``strategy_cache`` (when given): their caches (per
    node and placement) hold for every plan of its graph and mesh, and for their pricing by the
    step schedule."""
    costs = strategy_cache.get(_COSTS) if strategy_cache is not None else None
    if costs is None:
        costs = PlannerCosts(mesh.shape, get_hardware(mesh.hardware))
        if strategy_cache is not None:
            strategy_cache[_COSTS] = costs
    return costs


@paused_gc()
def make_plan(
    traced: Traced,
    mesh: Mesh,
    *,
    baseline: str | None = None,
    memory_budget: float | None = None,
    constraints: Constraints | None = None,
    clustering: bool = True,
    time_limit_s: float = DEFAULT_TIME_LIMIT_S,
    memory: MemoryModel | None = None,
    on_phase: Callable[[str], None] | None = None,
    start_from: Sequence[Plan] = (),
    step_options: dict | None = None,
    rel_gap: float = MIP_REL_GAP,
    strategy_cache: dict | None = None,
) -> Plan | None:
    """Plan ``traced`` over ``mesh``. Returns None when ``baseline`` does not apply to this mesh.
    ``on_phase`` is told what the planner is doing (for progress displays). ``start_from``: plans
    of the same graph and mesh (the hand-written baselines) the solver starts from; the cheapest
    one that is a point of this ILP becomes its first incumbent, so the result is never dearer
    than it, even when the time limit stops the search (see ``plan_with_baselines``).
    ``step_options`` (a training step's ``ac``, ``compile``, ``async_tp``; ``{}`` for the
    defaults): the objective is the step schedule, linearised (``plan/objective.py``), instead
    of the serial sum of every kernel and collective (None). ``rel_gap``: the solver may stop at
    a plan within this relative gap of its bound (the default: the optimum). ``strategy_cache``:
    a dict shared by calls on the same ``traced`` and ``mesh`` (``plan_with_baselines``) that
    keeps each baseline's clustering and strategies, and the planner costs, for the next call."""
    prepared = prepare_plan(traced, mesh, baseline=baseline, memory_budget=memory_budget,
                            constraints=constraints, clustering=clustering, time_limit_s=time_limit_s,
                            memory=memory, on_phase=on_phase, step_options=step_options, rel_gap=rel_gap,
                            strategy_cache=strategy_cache)
    return None if prepared is None else prepared.finish(start_from)


@dataclass
class PreparedPlan:
    """A plan's ILP built (``prepare_plan``), to be solved from the hand plans (``finish``)."""

    traced: Traced
    mesh: Mesh
    baseline: str | None
    budget: float
    clus: Clustering
    ns: dict[fx.Node, NodeStrategies]
    costs: PlannerCosts
    memory: MemoryModel | None
    model: IlpModel
    time_limit_s: float
    rel_gap: float
    timings: dict[str, float]
    prepare_s: float  # seconds ``prepare_plan`` took
    say: Callable[[str], None]
    # The other plans of the ILP its last solve found (``IlpResult.alternatives``), as plans like
    # the one ``finish`` returned, for the step schedule to choose among (``_fastest_solution``).
    alternatives: list[Plan] = field(default_factory=list)

    def start_lp(self) -> None:
        """Start the ILP's LP relaxation now, in a background thread: the caller's work until
        ``finish`` (pricing the hand plans) runs on another core meanwhile."""
        self.model.start_lp(self.time_limit_s, self.rel_gap)

    def price(self, plan: Plan) -> float | None:
        """``plan``'s objective by this ILP (seconds), at its placements and checkpointing; None
        where it is no point of the ILP."""
        choice = _choices_of(plan, self.ns, self.clus)
        return None if choice is None else self.model.price(self.model.point(choice, plan.ac))

    def finish(self, start_from: Sequence[Plan] = ()) -> Plan:
        """Solve the ILP from the cheapest of ``start_from`` that is a point of it (``make_plan``)."""
        return _finish(self, start_from)

    def finish_again(self, memory_budget: float, start_from: Sequence[Plan], time_limit_s: float) -> Plan:
        """Solve the ILP once more, with another memory budget (``IlpModel.set_budget``): not
        built again, and its LP relaxation not solved again (Gemma-2, 26 layers over 2x4: an
        interior point of 152,565 columns, 22 s). This plan's budget and time limit become
        those given."""
        self.model.set_budget(memory_budget)
        self.budget, self.time_limit_s, self.prepare_s = memory_budget, time_limit_s, 0.0
        self.timings = dict(self.timings)  # the plans solved before keep theirs
        return _finish(self, start_from)


def prepare_plan(traced: Traced, mesh: Mesh, *, baseline: str | None = None,
                 memory_budget: float | None = None, constraints: Constraints | None = None,
                 clustering: bool = True, time_limit_s: float = DEFAULT_TIME_LIMIT_S,
                 memory: MemoryModel | None = None, on_phase: Callable[[str], None] | None = None,
                 step_options: dict | None = None, rel_gap: float = MIP_REL_GAP,
                 strategy_cache: dict | None = None) -> PreparedPlan | None:
    """``make_plan`` up to its ILP built, not solved (None where ``baseline`` does not apply)."""
    say = on_phase or (lambda _phase: None)
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    spec: BaselineSpec | None = None
    if baseline is not None:
        spec = baseline_spec(baseline, traced, mesh)
        if spec is None:
            return None
    budget = default_budget(mesh) if memory_budget is None else memory_budget
    key = (baseline, id(constraints), clustering)
    if strategy_cache is not None and key in strategy_cache:
        if strategy_cache[key] is None:
            return None
        # Shallow copies: the strategy lists are replaced, never changed in place.
        clus, kept = strategy_cache[key]
        ns = {n: replace(st) for n, st in kept.items()}
        timings["cluster_s"] = timings["strategies_s"] = 0.0
    else:
        built = _strategies(traced, mesh, spec, constraints, clustering, say, timings, t0)
        if strategy_cache is not None:
            strategy_cache[key] = built
        if built is None:
            return None
        clus, kept = built
        ns = {n: replace(st) for n, st in kept.items()} if strategy_cache is not None else kept

    costs = _planner_costs(mesh, strategy_cache)
    say("building the placement ILP")
    linearised = checkpointing = None
    if step_options is not None and traced.train:
        from shardwise.cost.step import torchtitan_options
        from shardwise.plan.objective import ScheduleObjective

        given = step_options.get("ac")
        if given is not ACPolicy.NONE:
            # Decided per cluster of layers (None), or one policy fixed: the ILP prices the
            # recomputation and the saved bytes itself (plan/checkpointing.py).
            from shardwise.plan.checkpointing import CheckpointingModel

            checkpointing = CheckpointingModel(traced, clus, costs, fixed=given,
                                               compile=bool(step_options.get("compile")))
        linearised = ScheduleObjective(traced, clus, costs,
                                       torchtitan_options(traced, **{**step_options, "ac": ACPolicy.NONE}))
    model = build(traced, ns, clus, costs, memory_budget=budget, memory=memory, schedule=linearised,
                  checkpointing=checkpointing)
    return PreparedPlan(traced, mesh, baseline, budget, clus, ns, costs, memory, model, time_limit_s, rel_gap,
                        timings, time.perf_counter() - t0, say)


def _finish(prep: PreparedPlan, start_from: Sequence[Plan]) -> Plan:
    t0 = time.perf_counter() - prep.prepare_s  # the plan's own time: the caller's in between is not
    traced, mesh, baseline, budget = prep.traced, prep.mesh, prep.baseline, prep.budget
    clus, ns = prep.clus, prep.ns
    timings, time_limit_s, checkpointing = prep.timings, prep.time_limit_s, prep.model.checkpointing
    prep.say(f"solving the placement ILP (limit {time_limit_s:g} s)")
    prep.alternatives = []  # this solve's own, none where it finds no plan
    points = _points(traced, ns, clus, start_from, budget)
    starts = [_Start(choice, _objective_s(p), p.ac, p.name) for p, choice in points]
    if checkpointing is not None and checkpointing.fixed is None:
        # The ILP decides the checkpointing: a hand plan that does not fit as it runs may fit
        # with more of it (the ILP's rows say which do).
        starts += [_Start(choice, math.inf, ac, p.name)
                   for p, choice in _points(traced, ns, clus, start_from, math.inf)
                   for ac in _ac_variants(traced, p)]
    res = solve_built(prep.model, time_limit_s=time_limit_s, start=starts[0].choice if starts else None,
                      rel_gap=prep.rel_gap, start_ac=starts[0].ac if starts else None,
                      more_starts=[(st.choice, st.ac) for st in starts[1:]])
    # The start the solver was given; where none was a point of its model, the cheapest hand
    # plan that fits (the solver's time may run out before it finds a plan of its own).
    start = starts[res.start_index] if res.start_index is not None else (starts[0] if points else None)
    started_from = start.name if start is not None else None
    if start is not None:
        res = _never_worse(res, start)
    timings["ilp_build_s"] = res.build_s
    timings["solve_s"] = res.solve_s
    if res.status in NO_PLAN:
        plan = Plan(name=baseline or "auto", model=traced.model_name, mesh_shape=mesh.shape,
                    mesh_names=mesh.names, hardware=mesh.hardware, train=traced.train,
                    fingerprint=graph_fingerprint(traced.gm), nodes={}, status=res.status)
        plan.info = {"memory_budget_bytes": budget, "min_memory_bytes": res.min_memory_bytes,
                     "time_limit_s": time_limit_s, "timings": timings}
        return plan
    plan, est = _plan_at(prep, res.choice, res.ac, res.memory_bytes, res.status, res.mip_gap)
    objective_kind = "serial" if prep.model.schedule is None else "schedule"
    objective = res.objective_s
    if objective_kind == "serial" and res.status != "optimal" and est < objective:
        # An incumbent cut short may carry slack in its continuous move variables (t >= ... is
        # only bounded below); its placements priced exactly are what the plan costs.
        objective = est
        plan.mip_gap = (est - res.bound_s) / est if est > 0.0 else 0.0
    timings["total_s"] = time.perf_counter() - t0
    plan.info = {
        "objective_s": objective, "objective": objective_kind, "bound_s": res.bound_s,
        "bound_any_budget_s": res.bound_any_budget_s,
        "started_from": started_from,
        "start_s": res.start_s, "timings": timings, "memory_budget_bytes": budget,
        # The hand plans that are points of this ILP (they fit and keep the constraints), and
        # those that keep the constraints whatever the ILP's memory row says of them.
        "admissible": [p.name for p, _ in points],
        "eligible": [p.name for p, _ in _points(traced, ns, clus, start_from, math.inf)],
        "ilp": {"variables": res.n_vars, "constraints": res.n_rows, "clusters": len(clus.clusters),
                "representatives": len(clus.representatives), "nodes": len(clus.rep), **res.stats},
    }
    if checkpointing is not None:
        plan.info["ilp"]["checkpointing"] = {**checkpointing.stats, "decided": checkpointing.fixed is None}
    if plan.fallback_ops:
        log.warning("no sharding strategy for %s: planned replicated", ", ".join(plan.fallback_ops))
    for point in res.alternatives:
        gap = (point.objective_s - res.bound_s) / point.objective_s if point.objective_s > 0.0 else 0.0
        other, _ = _plan_at(prep, point.choice, point.ac, point.memory_bytes, "feasible", gap)
        other.info = {**plan.info, "objective_s": point.objective_s}
        prep.alternatives.append(other)
    return plan


def _plan_at(prep: PreparedPlan, choice: dict[fx.Node, int], ac: ACChoice | None, memory_bytes: float | None,
             status: str, mip_gap: float) -> tuple[Plan, float]:
    """The plan of ``prep``'s ILP at ``choice`` (a strategy index per representative) with the
    activation checkpointing ``ac`` and its memory row at ``memory_bytes``, and its price by the
    node-by-node estimate (seconds)."""
    traced, mesh, clus, ns = prep.traced, prep.mesh, prep.clus, prep.ns
    specs = {n: chosen_strategy(ns, clus, choice, n) for n in traced.gm.graph.nodes if n.op != "output"}
    plan = Plan(
        name=prep.baseline or "auto", model=traced.model_name, mesh_shape=mesh.shape, mesh_names=mesh.names,
        hardware=mesh.hardware, train=traced.train, fingerprint=graph_fingerprint(traced.gm),
        nodes={n.name: NodeSpec(s.output, s.inputs) for n, s in specs.items()},
        status=status, mip_gap=mip_gap,
    )
    plan.params = {p: plan.nodes[ph].output[0] for p, ph in traced.params.items()}
    plan.outputs = _output_placements(traced, plan, mesh)
    plan.fallback_ops = sorted({str(n.target) for n, st in ns.items() if st.fallback})
    plan.ac = ac
    est = estimate(traced, plan, prep.costs, prep.memory).total_s
    if memory_bytes is not None and prep.model.checkpointing is not None:
        plan.estimate.memory_bytes = int(memory_bytes)  # the saved bytes as the AC chosen holds them
    return plan, est


def _strategies(traced: Traced, mesh: Mesh, spec: BaselineSpec | None, constraints: Constraints | None,
                clustering: bool, say: Callable[[str], None], timings: dict[str, float], t0: float,
                ) -> tuple[Clustering, dict[fx.Node, NodeStrategies]] | None:
    """The clustering and each representative's strategies under the baseline's fixed choices
    and the constraints; None when the baseline does not apply."""
    fixed = _fixed_placeholders(traced, spec, constraints)
    clus = cluster(traced, fixed) if clustering else no_clustering(traced.gm)
    timings["cluster_s"] = time.perf_counter() - t0
    t = time.perf_counter()
    say("enumerating strategies")
    allowed = _placeholder_filter(fixed, mesh)
    ns = enumerate_strategies(traced.gm, mesh.device_mesh(), placeholder_filter=allowed, rep=clus.rep)
    if spec is not None and not _fix_baseline_choices(spec, traced, ns, mesh, clus):
        return None
    if not traced.train:
        _no_partial_outputs(traced, ns, clus)
    if constraints is not None and constraints.outputs:
        _constrain_outputs(traced, ns, clus, constraints.outputs, mesh)
    for n, st in ns.items():
        if n.op == "placeholder" and not st.strategies:
            shape = list(n.meta["val"].shape)
            why = _uneven(shape, fixed.get(n.name, ()), mesh.shape)
            raise UserError(f"no placement of {_user_name(traced, n.name)} (shape {shape}) fits the "
                            f"constraints on mesh {mesh}" + (f": {why}." if why else "."))
    timings["strategies_s"] = time.perf_counter() - t
    return clus, ns


@paused_gc()
def plan_with_baselines(traced: Traced, mesh: Mesh, *, baselines: Sequence[str] = BASELINES,
                        on_phase: Callable[[str], None] | None = None, step_options: dict | None = None,
                        **options) -> tuple[Plan, dict[str, Plan | None]]:
    """The hand-written baselines (None where one does not apply), then the auto plan started
    from the cheapest of them that fits: (auto, {name: baseline}). ``options`` go to every
    ``make_plan`` call; the user's constraints bind the auto plan only (a baseline that breaks
    them is no start point: the ILP rejects it).

    A training step's plans are then priced by the step schedule (``cost/step.py``, what
    ``shardwise estimate`` reports; ``step_options``: its ``ac``, ``compile``, ``async_tp``),
    and the auto plan is the fastest by it among the ILP's solution and the hand plans that
    are points of the ILP (they fit and keep the constraints): never slower than a hand plan
    by the measure the report prints, whatever the ILP's objective leaves out. Where the planner
    decides the checkpointing, its choice is first lightened where the schedule finds less
    recomputation faster and fitting (``_lighten_ac``)."""
    say = on_phase or (lambda _phase: None)
    constraints = options.pop("constraints", None)
    _fixed_placeholders(traced, None, constraints)  # refuse a bad constraint before the baselines
    plans: dict[str, Plan | None] = {}
    step_options = step_options or {}
    options["step_options"] = step_options
    cache = options.setdefault("strategy_cache", {})  # the same graph and mesh in every call below
    decide = traced.train and step_options.get("ac") is None
    limit = _schedule_limit(mesh, options.get("memory_budget"))
    price = _Pricer(traced, mesh, step_options, limit, _planner_costs(mesh, cache))
    # The auto ILP's LP relaxation does not depend on the hand plans (only its start point
    # does): it runs on another core while they are priced.
    prepared = prepare_plan(traced, mesh, constraints=constraints, on_phase=on_phase, **options)
    assert prepared is not None  # only a baseline can fail to apply
    prepared.start_lp()
    for name in baselines:
        say(f"pricing the {name} baseline")
        plans[name] = (_baseline_with_ac(traced, mesh, name, limit, options, price) if decide
                       else make_plan(traced, mesh, baseline=name, **options))
    starts = [b for b in plans.values() if b is not None and b.status not in NO_PLAN]
    for b in starts:
        _price_by_schedule_objective(prepared, b)
    auto = prepared.finish(starts)
    if traced.train and auto.status not in NO_PLAN:
        auto = _fastest_solution(auto, prepared.alternatives, price)
    if decide and auto.status not in NO_PLAN:
        say("fitting the activation checkpointing to the step's memory")
        auto = _fit_by_schedule(prepared, auto, limit, starts, price)
        auto = _lighten_ac(auto, price)
    if traced.train and auto.status not in NO_PLAN:
        say("laying each plan's step out on streams")
        # Deciding the checkpointing, whether a hand plan fits is the schedule's to say (the
        # ILP's memory row is a model of it): every hand plan that keeps the constraints runs.
        auto = _fastest_by_schedule(traced, mesh, auto, plans, step_options, limit,
                                    "eligible" if decide else "admissible", price)
    return auto, plans


# Policies in the order of their recomputation: a hand plan runs the first that fits (torchtitan
# users turn activation checkpointing up until the step fits).
AC_LADDER = (ACPolicy.NONE, ACPolicy.SELECTIVE, ACPolicy.FULL)
# Another plan an ILP solve found replaces its solution only where the step schedule finds it
# faster by more than this fraction: the objective ranked the solution first, and a plan faster by
# the schedule's rounding is not worth the larger gap it reports (llama-tiny, 2 layers over 2x2:
# the rounded LP point, 2% dearer by the objective, ran 0.015% faster).
ALTERNATIVE_GAIN = 0.01
# Solves after the first that set the ILP's budget from the step schedule of its last plan: the
# ILP's memory row holds the state and the saved activations, not the transients, the gathered
# parameters nor the allocator's cache, which the schedule counts (``_fit_by_schedule``).
FIT_ROUNDS = 4
# Head room kept under the limit when the budget is set from the schedule, and the smallest
# change of budget worth a solve, as fractions of the limit (the schedule's peak is not exactly
# linear in the saved bytes: the allocator rounds and caches).
FIT_SLACK = 0.01
# A solve with another budget is worth it only where the ILP's bounds leave room for a plan
# cheaper by more than this fraction (of the ILP's objective) than the best that fits so far.
FIT_GAIN = 0.01
# A plan that fits and whose memory row holds at most this fraction of the ILP's budget was not
# shaped by the budget: no larger one is tried. Where the solver stops at its time limit (its
# bounds too weak to skip the solve), such a re-solve was a second time limit spent on the same
# search: Phi-3 with 1 layer over 2x2 (5-s limit), its row at 1.2 of 67 GiB: 19.2 -> 14.1 s.
FIT_UNBOUND = 0.5


def _schedule_limit(mesh: Mesh, memory_budget: float | None) -> float:
    """The peak the step schedule checks a plan against: the user's budget, else the device's."""
    return get_hardware(mesh.hardware).mem_capacity if memory_budget is None else float(memory_budget)


@dataclass
class _Pricer:
    """Prices plans by the step schedule (``cost/step.price_plan``, which records the figures
    in ``plan.info["schedule"]``), each plan once: on 70B one pricing takes ~5 s, and the same
    plans are priced while the baselines are chosen, the budget fitted and the fastest picked."""

    traced: Traced
    mesh: Mesh
    step_options: dict
    limit: float | None
    # The planner's costs, whose caches hold what the schedule asks again (on llama3-70b over
    # 8x8 a cold one took 3.1 s of the hand plans' 25 s under cProfile).
    costs: PlannerCosts | None = None
    done: dict[int, tuple] = field(default_factory=dict)  # id(plan) -> (plan, its AC, estimate)

    def __call__(self, plan: Plan):
        from shardwise.cost.step import price_plan

        hit = self.done.get(id(plan))
        if hit is not None and hit[0] is plan and hit[1] == plan.ac:
            return hit[2]
        est = price_plan(self.traced, plan, self.mesh, self.step_options, self.limit, self.costs)
        self.done[id(plan)] = (plan, plan.ac, est)
        return est


def _baseline_with_ac(traced: Traced, mesh: Mesh, name: str, limit: float, options: dict,
                      price: _Pricer) -> Plan | None:
    """The hand plan ``name`` run with the first policy of ``AC_LADDER`` whose step fits
    ``limit`` by the schedule (every layer the same, as torchtitan configures it); the last
    that solved where none fits. None where it does not apply.

    Its free choices are made twice, by this planner's objective within its budget and as
    ``shardwise estimate --plan NAME`` makes them (the serial objective, no budget: the faithful
    plan ``benchmarks/fidelity.py`` prices); the faster by the schedule that fits is the plan."""
    from shardwise.cost.step import regions_layers

    last = None
    layers = sorted(regions_layers(traced))
    for policy in AC_LADDER:
        so = {**options["step_options"], "ac": policy}
        plan = make_plan(traced, mesh, baseline=name, **{**options, "step_options": so})
        if plan is None:
            return None
        if plan.status in NO_PLAN:
            last = last or plan
            continue
        plan.ac = plan.ac or ACChoice.uniform(layers, policy)
        last = plan
        if price(plan).fits:
            faithful = make_plan(traced, mesh, baseline=name,
                                 **{**options, "memory_budget": math.inf, "step_options": None})
            if faithful is None or faithful.status in NO_PLAN:
                break
            faithful.ac = ACChoice.uniform(layers, policy)
            if faithful.nodes == plan.nodes:
                break  # the same placements and checkpointing: the same step
            est = price(faithful)
            if est.fits and est.step_s < plan.info["schedule"]["step_s"]:
                faithful.info["free_choices"] = "serial objective, no budget (shardwise estimate --plan NAME)"
                faithful.info["memory_budget_bytes"] = None  # none: not inf, which JSON lacks
                return faithful
            break
    return last


def _fit_by_schedule(prepared: PreparedPlan, auto: Plan, limit: float, starts: list[Plan],
                     price: _Pricer) -> Plan:
    """Solve again with the ILP's budget set from the step schedule (``FIT_ROUNDS`` at most):
    first the limit less what the schedule held beyond the ILP's memory row in the last plan
    (or, after two plans that do not fit, where the line through their budgets and peaks
    reaches the limit, if that is lower: what the schedule holds beyond the row grows as the
    budget shrinks, so the first rule alone can take more rounds than there are);
    once one budget gave a plan that fits and another one that does not, halfway between them.
    Returns the fastest plan that fits by the schedule, else the last one solved. A solve is
    skipped where the bounds of the last ones show no plan cheaper by FIT_GAIN can come of it,
    where the last plan fits with its memory row far under its budget (``FIT_UNBOUND``), and
    where none fits yet and the last is already no faster than a hand plan of ``starts`` that
    fits: the next budget is lower, and a plan held to less memory shards or recomputes more
    (llama3-405b over 16x8 at --gap 0.01: five solves of 13.03-13.28 s plans against fsdp_tp_sp's
    10.47 s, 170 s of the 251);
    once a plan fits, the solves for a faster one share one time limit (``time_limit_s``, from
    the first re-solve; until then each has its own), and each starts from the hand plans and
    the plans solved before that fit its budget. Each solve is ``prepared``'s ILP again
    (``PreparedPlan.finish_again``)."""
    time_limit_s = prepared.time_limit_s
    deadline = time.perf_counter() + time_limit_s
    starts = list(starts)
    budget = auto.info["memory_budget_bytes"]
    best: tuple[float, Plan] | None = None
    fits_at, over_at = -math.inf, math.inf  # the largest budget that fit, the smallest that did not
    bound_over = math.inf  # the ILP's bound at over_at: no smaller budget gives a cheaper plan
    target = limit * (1.0 - FIT_SLACK)
    last: tuple[float, float] | None = None  # (budget, schedule's peak) of the last plan
    hand_s = min((e.step_s for e in map(price, starts) if e.fits), default=math.inf)
    for k in range(FIT_ROUNDS + 1):
        est = price(auto)
        log.info("ILP budget %s: AC %s, memory row %s, step %.4f s, peak %s (%s)", format_bytes(budget),
                 est.ac, format_bytes(auto.estimate.memory_bytes), est.step_s,
                 format_bytes(est.memory_per_device_bytes), "fits" if est.fits else "does not fit")
        if est.fits:
            fits_at = max(fits_at, budget)
            starts.append(auto)  # a point of every ILP with a larger budget
            if best is None or est.step_s < best[0]:
                best = (est.step_s, auto)
        elif budget < over_at:
            over_at, bound_over = budget, auto.info["bound_s"]
        if k == FIT_ROUNDS:
            break
        if best is None and not est.fits and est.step_s >= hand_s:
            break  # a lower budget's plan is slower still than a hand plan that fits
        if math.isfinite(fits_at) and math.isfinite(over_at):
            new = (fits_at + over_at) / 2.0
            if _objective_s(best[1]) <= (1.0 + FIT_GAIN) * bound_over:
                break  # no budget between gives a plan cheaper by more than FIT_GAIN
        else:
            new = target - (est.memory_per_device_bytes - auto.estimate.memory_bytes)
            if not est.fits and last is not None and last[1] > est.memory_per_device_bytes:
                slope = (last[1] - est.memory_per_device_bytes) / (last[0] - budget)
                if slope > 0.0:
                    new = min(new, budget - (est.memory_per_device_bytes - target) / slope)
            if est.fits and new < budget:
                break  # a lower budget cannot give a faster plan
            if est.fits and auto.estimate.memory_bytes <= FIT_UNBOUND * budget:
                break  # the budget did not shape this plan: a larger one only searches again
            if est.fits and _objective_s(auto) <= (1.0 + FIT_GAIN) * auto.info.get("bound_any_budget_s", 0.0):
                break  # no budget at all gives a plan cheaper by more than FIT_GAIN
        if new <= 0.0 or abs(new - budget) <= FIT_SLACK * limit or over_at - fits_at <= FIT_SLACK * limit:
            break  # no budget left, or no change worth a solve
        left = deadline - time.perf_counter()
        if best is not None and left <= 0.0:
            break  # a plan fits, and the time for faster ones is spent
        last, budget = (budget, est.memory_per_device_bytes), new
        # Until a plan fits, each solve gets the whole time limit: a plan that fits is needed.
        again = prepared.finish_again(budget, starts, left if best is not None else time_limit_s)
        if again.status in NO_PLAN:
            break
        auto = _fastest_solution(again, prepared.alternatives, price)
    return best[1] if best is not None else auto


def _fastest_solution(plan: Plan, others: Sequence[Plan], price: _Pricer) -> Plan:
    """The fastest by the step schedule of the ILP's solution ``plan`` and the other plans its
    solve found (``PreparedPlan.alternatives``): one that fits before one that does not, and
    another plan only where it is faster than ``plan`` by more than ALTERNATIVE_GAIN. Those plans
    lie within the solver's gap of one another, or near it, and the objective's error beside
    the schedule can be larger (``objective.py``): on llama3-8b, 2 layers over 8x8, the rounded
    LP point, 0.07% dearer by the objective than the neighbourhood's plan, ran 12% slower."""
    first = best_est = price(plan)
    best = plan
    for other in others:
        est = price(other)
        gain = ALTERNATIVE_GAIN if best is plan else 0.0
        if (est.fits and not best_est.fits) or (est.fits == best_est.fits
                                                and est.step_s < best_est.step_s * (1.0 - gain)):
            best, best_est = other, est
    if best is not plan:
        log.info("another plan of the ILP's solve: step %.4f -> %.4f s (objective %.6g -> %.6g s)",
                 first.step_s, best_est.step_s, _objective_s(plan), _objective_s(best))
        best.info = {**best.info, "ilp_solution": _solution_row(plan)}
    return best


def _solution_row(solution: Plan) -> dict:
    """What the report keeps of the ILP's solution where another plan replaced it: its
    objective, status and gap to the bound, and its schedule."""
    return {"objective_s": _objective_s(solution), "status": solution.status, "mip_gap": solution.mip_gap,
            **solution.info["schedule"]}


def _price_by_schedule_objective(prepared: PreparedPlan, hand: Plan) -> None:
    """Price a hand plan whose free choices the serial objective made (``_baseline_with_ac``'s
    faithful plan) by the auto ILP's schedule objective instead, so that every plan's
    ``objective_s`` is of one kind: it orders the solver's starts and is reported beside the
    auto ILP's bound (the serial sum overlaps nothing: StableLM's defaults at 256 wide, 2 layers
    over 2x2, FSDP's at 1.93 ms, its step 0.79 ms, the auto ILP's price 0.98 ms)."""
    if hand.info.get("objective") != "serial" or prepared.model.schedule is None:
        return
    price = prepared.price(hand)
    if price is not None:
        hand.info.update(objective_s=price, objective="schedule", serial_objective_s=hand.info["objective_s"])


def _lighter_ac(ac: ACChoice) -> list[ACChoice]:
    """Checkpointing that recomputes less than ``ac``: every layer none, and every layer one rung
    of ``AC_LADDER`` lower (full layers selective, selective ones none)."""
    layers = [k for g in ac.groups for k in g.layers]
    lighter = [ACChoice.uniform(layers, ACPolicy.NONE),
               ACChoice(tuple(ACGroup(g.layers, g.none + g.selective, g.full, 0) for g in ac.groups))]
    return [c for c in dict.fromkeys(lighter) if c != ac]


def _lighten_ac(auto: Plan, price: _Pricer) -> Plan:
    """``auto``'s placements with less recomputation where the step schedule finds that faster
    and fitting. The objective prices recomputation as free in a block whose communication
    outlasts its compute, and leaves out the collectives it repeats (``objective.py``); the
    schedule runs both on the backward's critical path. llama3-8b, 8 layers over 8x8 (stop 24): the ILP's
    none x 3, selective x 4, full x 1 runs 123.6 ms (5.4 ms of recomputation, 8 ms more
    communication, 2.7 of it exposed), the same placements without checkpointing 115.5 ms in
    11.6 of 80 GiB. (A third row per backward block, recomputation then the block's gradient
    reductions, did not bind there: its prefetched gathers are longer.) Returns ``auto`` itself
    where no lighter variant wins."""
    if auto.ac is None:
        return auto
    # A variant must be faster by more than this relative margin (float rounding of the sums).
    tie = 1e-9
    best, best_est = auto, price(auto)
    for ac in _lighter_ac(auto.ac):
        variant = replace(auto, ac=ac, estimate=replace(auto.estimate), info=dict(auto.info))
        est = price(variant)
        if est.fits and (not best_est.fits or est.step_s < best_est.step_s * (1.0 - tie)):
            best, best_est = variant, est
    if best is not auto:
        log.info("checkpointing %s -> %s: step %.4f -> %.4f s", auto.ac.describe(), best.ac.describe(),
                 auto.info["schedule"]["step_s"], best_est.step_s)
        best.info["ilp_ac"] = auto.ac.describe()  # what the ILP chose, before the schedule lightened it
    return best


def _fastest_by_schedule(traced: Traced, mesh: Mesh, auto: Plan, hand: dict[str, Plan | None],
                         step_options: dict, limit: float | None = None, among: str = "admissible",
                         price: _Pricer | None = None) -> Plan:
    """Price ``auto`` and every hand plan by the step schedule (``plan.info["schedule"]``);
    the auto plan is the fastest of the ILP's solution and the admissible hand plans. A hand
    plan that wins is returned as the auto plan, with ``chosen_from`` naming it and
    ``ilp_solution`` the schedule of the solution it beat."""
    price = price or _Pricer(traced, mesh, step_options, limit)
    # A hand plan must be faster by more than this relative margin to replace the ILP's plan
    # (float rounding of the schedule's sums).
    tie = 1e-9
    price(auto)
    for b in hand.values():
        if b is not None and b.status not in NO_PLAN:
            price(b)
    best = auto
    for name in auto.info.get(among, []):
        b = hand.get(name)
        if b is None:
            continue  # a plan the budget fit solved before, a start but no hand plan
        s, t = b.info["schedule"], best.info["schedule"]
        # A plan that fits beats one that does not; then the faster.
        faster = s["step_s"] < t["step_s"] * (1.0 - tie)
        if (s["fits"] and not t["fits"]) or (s["fits"] == t["fits"] and faster):
            best = b
    if best is auto:
        auto.info["chosen_from"] = "ilp"
        return auto
    # The hand plan's price by its ILP's objective (the same as the auto ILP's), its gap to the
    # auto ILP's bound: the report's objective, bound and gap are the plan's own, and "optimal"
    # only where it costs no more than the solution it replaced (the schedule's winner may cost
    # more by the objective: llama3-70b over 8x8, fsdp_tp 1.868 s against the solution's 1.782).
    objective = _objective_s(best)
    bound = auto.info["bound_s"]
    gap = max(0.0, (objective - bound) / objective) if objective > 0.0 else 0.0
    status = auto.status if objective <= auto.info["objective_s"] * (1.0 + tie) else "feasible"
    info = {**auto.info, "schedule": best.info["schedule"], "chosen_from": best.name,
            "ilp_solution": _solution_row(auto), "objective_s": objective}
    return replace(best, name="auto", estimate=replace(best.estimate), info=info, status=status, mip_gap=gap)


def plan_named(traced: Traced, mesh: Mesh, name: str, **options) -> Plan:
    """The plan called ``name``: ``auto`` (started from the best hand plan, so never dearer) or
    a baseline; one clear error when it does not apply or nothing fits."""
    if name == "auto":
        plan: Plan | None = plan_with_baselines(traced, mesh, **options)[0]
    else:
        plan = make_plan(traced, mesh, baseline=name, **options)
    if plan is None:
        why = baseline_refusal(name, traced, mesh) or "some op of the model has no strategy in its layout"
        raise UserError(f"the {name} plan does not apply to mesh {mesh}: {why}.")
    if plan.status in NO_PLAN:
        raise UserError(f"plan {name}: {no_plan_reason(plan)}")
    return plan


@dataclass(frozen=True)
class _Start:
    """A plan the solver starts from: its choice at every representative and its step time."""

    choice: dict[fx.Node, int]
    objective_s: float
    ac: ACChoice | None = None
    name: str | None = None  # the hand plan's


def _ac_variants(traced: Traced, plan: Plan) -> list[ACChoice]:
    """The activation checkpointing of every rung of ``AC_LADDER`` (every layer the same) but
    the one ``plan`` runs: points of the auto ILP with ``plan``'s placements."""
    from shardwise.cost.step import regions_layers

    layers = sorted(regions_layers(traced))
    own = set(plan.ac.layer_policies().layers) if plan.ac is not None else {ACPolicy.NONE}
    return [ACChoice.uniform(layers, p) for p in AC_LADDER if own != {p}]


def _points(traced: Traced, ns: dict[fx.Node, NodeStrategies], clus: Clustering,
            plans: Sequence[Plan], budget: float) -> list[tuple[Plan, dict[fx.Node, int]]]:
    """The plans in ``plans`` that fit ``budget`` and run, at every representative, a strategy
    this ILP offers (followers: the one their producer implies), cheapest first, each with its
    choice at every representative. The first is the solver's start."""
    out = []
    for plan in sorted(plans, key=_objective_s):
        if plan.estimate.memory_bytes > budget or plan.fingerprint != graph_fingerprint(traced.gm):
            continue
        choice = _choices_of(plan, ns, clus)
        if choice is not None:
            out.append((plan, choice))
        else:
            log.debug("plan %s is no point of this ILP: not a start", plan.name)
    return out


def _objective_s(plan: Plan) -> float:
    """A hand plan's price by its ILP's objective (which is this ILP's: the same options)."""
    return plan.info.get("objective_s", plan.estimate.total_s)


def _never_worse(res: IlpResult, start: _Start) -> IlpResult:
    """The solver's result, or the start point where the solver found nothing better (its time
    ran out before it read the start, say), with the solver's bound and the gap to it."""
    # Plans within this relative margin of each other cost the same (float rounding of the sums).
    tie = 1e-9
    # The ILP's own price of the start point where the solver was given it (the same as the
    # start plan's estimate: the two are priced alike).
    price = res.start_s if res.start_s is not None else start.objective_s
    if res.status not in NO_PLAN and res.objective_s <= price * (1.0 + tie):
        return res
    bound = min(res.bound_s, price)
    gap = (price - bound) / price if price > 0.0 else 0.0
    return replace(res, status="feasible" if gap > tie else "optimal", objective_s=price,
                   mip_gap=gap, bound_s=bound, choice=start.choice, ac=start.ac)


def _choices_of(plan: Plan, ns: dict[fx.Node, NodeStrategies], clus: Clustering) -> dict[fx.Node, int] | None:
    """``plan``'s strategy index at every representative (a follower: the strategy reading what
    its producer yields), or None where ``plan`` is no point of this ILP: some node's placements
    are not among its strategies here, or a follower reads its producer in another placement."""
    choice: dict[fx.Node, int] = {}
    for r in clus.representatives:  # graph order: producers first
        st = ns.get(r)
        if st is None or st.alias_of is not None or r.op == "output":
            continue
        spec = plan.nodes.get(r.name)
        if spec is None:
            return None
        want = Strategy(spec.output, spec.inputs)
        if st.follows is not None:
            supplied = chosen_strategy(ns, clus, choice, st.follows).output[0]
            if want.inputs[:1] != (supplied,):
                return None
        index = next((i for i, s in enumerate(st.strategies) if s == want), None)
        if index is None:
            return None
        choice[r] = index
    return choice


def no_plan_reason(plan: Plan) -> str:
    """One sentence on why ``plan`` (whose status is in NO_PLAN) has no placements."""
    if plan.status == "unsolved":
        return (f"the solver found no plan within its {plan.info['time_limit_s']:g} s time limit; "
                "give it more time (--time-limit).")
    budget, floor = plan.info["memory_budget_bytes"], plan.info["min_memory_bytes"]
    if floor <= budget:  # each value could shrink enough, but not all together
        return (f"no plan fits {format_bytes(budget)} per device: values whose placements are tied to one "
                f"another (or constrained) cannot all be sharded as far as the floor of "
                f"{format_bytes(floor)} assumes.")
    least = "the fully-sharded minimum is" if plan.name == "auto" else f"the {plan.name} plan needs at least"
    return f"no plan fits {format_bytes(budget)} per device; {least} {format_bytes(floor)}."


def _fix_baseline_choices(spec: BaselineSpec, traced: Traced, ns: dict[fx.Node, NodeStrategies],
                          mesh: Mesh, clus: Clustering) -> bool:
    """Values placed as the baseline says (the batch split, the norms' boundaries), tp-sharded
    weights read sharded; False when some node has no strategy left (it does not apply)."""
    keep = node_filter(spec, traced)
    for n, st in ns.items():
        if st.alias_of is None and n.op == "call_function":
            kept = [s for s in st.strategies if keep(n, s.output[0], st.follows is not None)]
            if not kept:
                log.debug("baseline %s: no strategy of %s fits", spec.name, n.format_node())
                return False
            if len(kept) < len(st.strategies):
                st.strategies, st.follows = kept, None
    return spec.norm_layout is None or tensor_parallel_uses(spec, traced, ns, mesh, clus.rep)


def _fixed_placeholders(traced: Traced, spec: BaselineSpec | None,
                        constraints: Constraints | None) -> dict[str, Placements]:
    """Placeholder name -> the placements a baseline or the user fixes it in."""
    fixed: dict[str, Placements] = dict(spec.fixed) if spec is not None else {}
    if constraints is not None:
        for pname, ps in constraints.params.items():
            if pname not in traced.params:
                raise UserError(f"the constraint names parameter {pname!r}, which the model does not have.")
            _check_shard_dims(traced, traced.params[pname], f"parameter {pname!r}", ps)
            fixed[traced.params[pname]] = ps
        for iname, ps in constraints.inputs.items():
            if iname not in traced.inputs:
                raise UserError(f"the constraint names input {iname!r}; inputs are "
                                f"{', '.join(traced.inputs)}.")
            _check_shard_dims(traced, iname, f"input {iname!r}", ps)
            fixed[iname] = ps
    return fixed


def _check_shard_dims(traced: Traced, placeholder: str, what: str, ps: Placements) -> None:
    shape = tuple(traced.node(placeholder).meta["val"].shape)
    for p in ps:
        if isinstance(p, Shard) and not 0 <= p.dim < len(shape):
            raise UserError(f"the constraint shards {what} on dim {p.dim}, but its shape {list(shape)} "
                            f"has dims 0 to {len(shape) - 1}.")


def _uneven(shape: list[int], ps: Placements, mesh_shape: tuple[int, ...]) -> str | None:
    """Why placements ``ps`` cannot hold a tensor of ``shape``: a dim sharded over more devices
    than split it evenly (plans shard evenly), else None."""
    ways: dict[int, int] = {}
    for p, size in zip(ps, mesh_shape, strict=False):
        if isinstance(p, Shard):
            ways[p.dim] = ways.get(p.dim, 1) * size
    for dim, n in ways.items():
        if shape[dim] % n:
            return f"its dim {dim} of size {shape[dim]} does not split evenly over {n} devices"
    return None


def _user_name(traced: Traced, placeholder: str) -> str:
    """A placeholder as the user knows it: ``parameter 'NAME'`` or ``input 'NAME'``."""
    param = traced.param_of_placeholder().get(placeholder)
    return f"parameter {param!r}" if param is not None else f"input {placeholder!r}"


def _placeholder_filter(fixed: dict[str, Placements], mesh: Mesh) -> Callable[[fx.Node, Placements], bool]:
    def allowed(node: fx.Node, ps: Placements) -> bool:
        want = fixed.get(node.name)
        return want is None or ps == on_mesh(want, mesh.shape)

    return allowed


def _keep_output_strategies(ns: dict[fx.Node, NodeStrategies], clus: Clustering, node: fx.Node,
                            keep: Callable[[Placements], bool]) -> bool:
    """Keep only the strategies of ``node`` (through its representative, or its parent for a
    tuple element) whose placement of it passes ``keep``; False (nothing changed) if none does."""
    r = clus.rep[node]
    st, index = ns[r], 0
    if st.alias_of is not None:
        parent, index = st.alias_of
        st = ns[clus.rep[parent]]
    kept = [s for s in st.strategies if keep(s.output[index])]
    if not kept:
        return False
    if len(kept) < len(st.strategies):
        st.strategies, st.follows = kept, None
    return True


def _no_partial_outputs(traced: Traced, ns: dict[fx.Node, NodeStrategies], clus: Clustering) -> None:
    """Inference outputs are delivered whole or sharded, never as pending sums."""
    for name in traced.outputs:
        _keep_output_strategies(ns, clus, traced.node(name),
                                lambda ps: not any(isinstance(p, Partial) for p in ps))


def _constrain_outputs(traced: Traced, ns: dict[fx.Node, NodeStrategies], clus: Clustering,
                       wanted: dict[int, Placements], mesh: Mesh) -> None:
    """Output ``i`` (inference) delivered in ``wanted[i]``: its producer keeps only such strategies."""
    if traced.train:
        raise UserError("a training step's outputs are its loss (replicated) and gradients (placed as "
                        "their parameters); constrain the parameters instead.")
    for i, ps in wanted.items():
        if not 0 <= i < len(traced.outputs):
            raise UserError(f"the constraint names output {i}; the model has {len(traced.outputs)} "
                            f"output(s), numbered from 0.")
        want = on_mesh(ps, mesh.shape)
        if not _keep_output_strategies(ns, clus, traced.node(traced.outputs[i]), want.__eq__):
            raise UserError(f"no plan delivers output {i} as {placements_str(want)} on mesh {mesh} "
                            f"(it must divide evenly and cannot be a pending sum).")


def _output_placements(traced: Traced, plan: Plan, mesh: Mesh) -> list[Placements]:
    out_node = next(n for n in reversed(traced.gm.graph.nodes) if n.op == "output")
    grad_param = {g: p for p, g in traced.grads.items()}
    result = []
    for r in out_node.args[0]:
        if not isinstance(r, fx.Node):
            continue
        if traced.train and r.name == traced.loss:
            result.append((Replicate(),) * mesh.ndim)
        elif r.name in grad_param:
            result.append(plan.params[grad_param[r.name]])
        else:
            result.append(plan.nodes[r.name].output[0])
    return result


def edges(traced: Traced):
    """Every (producer, consumer, argument index) the plan prices, sinks included."""
    for v in traced.gm.graph.nodes:
        if v.op == "call_function" and not (v.target.__name__ == "getitem"):
            for j, u in enumerate(tensor_args(v)):
                yield u, v, j
    for pname, gname in traced.grads.items():
        yield traced.node(gname), traced.node(traced.params[pname]), GRAD_SINK
    if traced.loss is not None:
        loss = traced.node(traced.loss)
        yield loss, loss, LOSS_SINK


def destination(plan: Plan, v: fx.Node, j: int) -> Placements:
    """The placement edge (., v, j) reads its value in under ``plan``."""
    spec = plan.nodes[v.name]
    return read_in(spec.output[0], spec.inputs, j, len(plan.mesh_shape))


def read_in(output: Placements, inputs: tuple, j: int, mesh_ndim: int) -> Placements:
    """The placement a node placed ``output`` and reading ``inputs`` needs along its edge ``j``."""
    if j == GRAD_SINK:
        return output  # a gradient is synchronised into its parameter's placement
    if j == LOSS_SINK:
        return (Replicate(),) * mesh_ndim
    return inputs[j]


def estimate(traced: Traced, plan: Plan, costs: PlannerCosts | None = None,
             memory: MemoryModel | None = None) -> Estimate:
    """Price ``plan`` node by node: compute, communication, memory; fills plan.collectives."""
    costs = costs or PlannerCosts(tuple(plan.mesh_shape), get_hardware(plan.hardware))
    memory = memory or MemoryModel()
    mesh_shape = tuple(plan.mesh_shape)
    est = Estimate()
    for n in traced.gm.graph.nodes:
        spec = plan.nodes.get(n.name)
        if spec is not None and n.op == "call_function":
            est.compute_s += costs.compute_time(n, Strategy(spec.output, spec.inputs))
    est.comm_s, colls = plan_moves(traced, plan, costs)
    mem = 0.0
    for n in traced.gm.graph.nodes:
        spec = plan.nodes.get(n.name)
        per_byte = memory.bytes_per_byte(traced, n) if spec is not None else 0.0
        if per_byte:
            mem += local_bytes(n.meta["val"], spec.output[0], mesh_shape) * per_byte
    est.memory_bytes = int(mem)
    plan.estimate = est
    plan.collectives = colls
    return est


def plan_moves(traced: Traced, plan: Plan, costs: PlannerCosts) -> tuple[float, dict[str, CollectiveCount]]:
    """The seconds and collectives of every move ``plan`` makes, as the lowering makes them: a
    value moved to a placement once for all its readers there, and an activation's move for a
    reader of one phase from its copy cheapest to move (``reshard.start_of_move``): the value as
    made or a placement an earlier move of that phase reached or passed through."""
    comm_s = 0.0
    colls: dict[str, CollectiveCount] = defaultdict(CollectiveCount)
    moved: set[tuple[str, Placements]] = set()
    copies: dict[tuple[str, Phase], list[Placements]] = defaultdict(list)
    for u, v, j in edges(traced):
        src, dst = plan.nodes[u.name].output[0], destination(plan, v, j)
        if src == dst or (u.name, dst) in moved:
            continue
        moved.add((u.name, dst))
        val = u.meta["val"]
        if j >= 0 and u.op == "call_function" and leaves_copies(dst):
            kept = copies[(u.name, traced.phase(v))]
            src = start_of_move(src, kept, dst, tuple(val.shape), val.element_size(), costs.topology)
            kept += costs.reshard_hops(src, dst, val)
        rc = costs.reshard(src, dst, val)
        comm_s += rc.time_s
        for c in rc.collectives:
            colls[c.kind.value] += CollectiveCount(1, c.bytes)
    return comm_s, dict(colls)
