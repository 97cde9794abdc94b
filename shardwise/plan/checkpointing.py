r"""Activation checkpointing as a decision of the placement ILP.

Per cluster of identical decoder layers g (``plan/cluster.py``: L_g copies, one representative
per position), integers count how many of its layers run each policy (``passes/remat.py``):

    n[g,none] + n[g,selective] + n[g,full] = L_g,     n[g,P] in {0..L_g}

(a decoder layer outside every cluster is a group of one). A fixed policy (``--ac``) fixes the
counts: n[g,P] = L_g, the others 0.

What a policy does to one layer comes from the remat pass run on the canonical graph with that
policy for every layer: S_P, the allocations the backward still reads (eager selective AC also
caches what its save list keeps, until the block's recomputation, as the schedule prices it),
and R_P, the forward nodes run again in the backward. For a representative r of a layer
position, S(r) = {P : r in S_P} and R(r) = {P : r in R_P}.

Memory. r's bytes depend on its placement p (y[r,p], a sum of x, exactly one is 1): every copy
that saves it holds local_bytes(r, p), so the cluster holds

    sum_{P in S(r)} n[g,P] * sum_p bytes(r,p) y[r,p]

a product of an integer and binaries. Linearised exactly with one continuous column per
placement, the counts spread over the placement that is chosen:

    sum_p w[r,p] = sum_{P in S(r)} n[g,P],     0 <= w[r,p] <= L_g y[r,p]

At integral y the one chosen p takes the whole count and the others 0, so
sum_p bytes(r,p) w[r,p] is the product. (McCormick on each n[g,P] * y[r,p] is as exact with
three columns and four rows per pair; this shares one column per placement among the
policies.) When S(r) holds every policy the term is linear (L_g copies), when it is empty there
is none, and when r's bytes are the same in every placement it is bytes * sum n: no w.

Time. Recomputing r with strategy s takes its kernel's time t(r,s) again, in its layer's
backward (``plan/objective.py``'s backward block; the serial objective adds it): the same
construction on the strategies instead of the placements, with R(r) for S(r).

The model replaces the ILP's saved-activation term (``MemoryModel``) for the nodes of the
decoder layers (``excluded``); the head and the tail (embedding, final norm, output, loss) are
counted by it as before, as saved. Not modelled: ``--compile``'s fused recomputation (priced
eager), the recomputed collectives, and a recomputed node whose inputs lie in a layer of
another policy (the remat pass then saves the inputs); the planner prices the chosen plan by
the step schedule, which does model them, and searches the ILP's budget until the schedule's
peak fits (``planner._fit_by_schedule``).

Size (``benchmarks/ac_plan.py --size``): on llama3-8b over 8 GPUs, one group of 32 layers adds
278 columns and 333 rows to the ILP's 7,106 and 4,068.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import fx

from shardwise.ir.flops import is_view
from shardwise.ir.regions import alias_root
from shardwise.ir.trace import Phase, Traced
from shardwise.passes.remat import ACPolicy, recompute_plan
from shardwise.plan.cluster import TAIL, Clustering, regions
from shardwise.plan.costs import PlannerCosts, local_bytes
from shardwise.plan.placement import Placements
from shardwise.plan.plan import ACChoice, ACGroup
from shardwise.plan.solver import add_terms
from shardwise.plan.strategies import NodeStrategies

POLICIES = tuple(ACPolicy)
# Relative spread below which a node's bytes (or time) count as equal in every placement
# (strategy), so its term is linear in the counts.
SAME_TOL = 1e-9


@dataclass
class _Group:
    """A cluster of identical layers: their region indices and, per position, the
    representative."""

    layers: list[int]
    reps: list[fx.Node]


@dataclass
class _Spread:
    """Continuous columns that spread a count over the choices of one node: ``cols[i]`` holds
    the count where choice i (whose binaries are ``ends[i]``) is taken, else 0; ``policies``:
    the policies whose counts it spreads; ``group``: their group."""

    cols: list[int]
    ends: list[list[int]]
    policies: tuple[ACPolicy, ...]
    group: int


@dataclass
class CheckpointingModel:
    """Builds the activation checkpointing columns and rows of the placement ILP (see module
    docstring). ``fixed``: a policy every layer runs (no decision). ``compile``: eager
    selective AC's cache is not held (compiled blocks save what their backward reads)."""

    traced: Traced
    clus: Clustering
    costs: PlannerCosts
    fixed: ACPolicy | None = None
    compile: bool = False
    groups: list[_Group] = field(default_factory=list)
    counts: list[dict[ACPolicy, int]] = field(default_factory=list)  # group -> policy -> column
    spreads: list[_Spread] = field(default_factory=list)
    stats: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        gm = self.traced.gm
        self.region = regions(self.traced)
        self.saved: dict[ACPolicy, set[fx.Node]] = {}
        self.recomputed: dict[ACPolicy, set[fx.Node]] = {}
        for p in POLICIES:
            rp = recompute_plan(gm, p)
            held = set(rp.saved) | (set() if self.compile else rp.selective_kept)
            self.saved[p] = {alias_root(n) for n in held}
            self.recomputed[p] = set(rp.recompute)
        self.groups = self._groups()
        self._group_of = {r: gi for gi, g in enumerate(self.groups) for r in g.reps}

    # ---- which layers ----------------------------------------------------------------------
    def _in_layer(self, n: fx.Node) -> bool:
        return (n.op == "call_function" and self.traced.phase(n) is Phase.FORWARD
                and 0 <= self.region.get(n, -1) < TAIL)

    def _groups(self) -> list[_Group]:
        """The forward clusters of layers, and a group of one for each layer in none."""
        out: list[_Group] = []
        grouped: set[int] = set()
        for copies in self.clus.clusters:
            if self.traced.phase(copies[0][0]) is not Phase.FORWARD:
                continue
            layers = [self.region.get(c[0], -1) for c in copies]
            if any(not 0 <= k < TAIL for k in layers):
                continue
            reps = list(dict.fromkeys(self.clus.rep[n] for n in copies[0] if self._in_layer(n)))
            out.append(_Group(sorted(layers), reps))
            grouped.update(layers)
        alone: dict[int, list[fx.Node]] = {}
        for n in self.traced.gm.graph.nodes:
            if self._in_layer(n) and self.region[n] not in grouped:
                alone.setdefault(self.region[n], []).append(n)
        out += [_Group([k], nodes) for k, nodes in sorted(alone.items())]
        return out

    def kept_moved(self, r: fx.Node) -> tuple[list[int], int] | None:
        """Which copies of representative r keep a moved copy of its value for the backward
        (``ilp._saved_moves``): those of its group's layers whose policy does not recompute r,
        as (their count columns, the group's layers); None where every copy keeps it (outside
        the layers, or recomputed under no policy). Valid once ``build`` made the counts."""
        gi = self._group_of.get(r)
        pols = [p for p in POLICIES if r not in self.recomputed[p]]
        if gi is None or len(pols) == len(POLICIES):
            return None
        return [self.counts[gi][p] for p in pols], len(self.groups[gi].layers)

    def excluded(self) -> frozenset[str]:
        """Names of the nodes whose saved bytes this model counts (the ILP's ``MemoryModel``
        leaves them out)."""
        return frozenset(n.name for n in self.traced.gm.graph.nodes if self._in_layer(n))

    # ---- the columns and rows --------------------------------------------------------------
    def build(self, m, ns: dict[fx.Node, NodeStrategies], xs: dict[fx.Node, list[list[int]]],
              supply: Callable[[fx.Node], dict[Placements, list[int]]],
              charge_recompute: Callable[[int, float, fx.Node], None]) -> dict[int, float]:
        """Add the counts, the spread columns and their rows to the ILP model ``m``
        (``ilp._Model``); charge recomputation through ``charge_recompute(col, seconds, node)``;
        return the memory row's terms (bytes per unit of each column)."""
        cols0, rows0 = len(m.cost), len(m.row_lb)
        mem: dict[int, float] = {}
        for gi, g in enumerate(self.groups):
            L = len(g.layers)
            cnt = {}
            for p in POLICIES:
                lo, hi = (0.0, float(L)) if self.fixed is None else (float(L * (p is self.fixed)),) * 2
                cnt[p] = m.var(0.0, ub=hi, lb=lo)
            m.row(float(L), float(L), {c: 1.0 for c in cnt.values()})
            self.counts.append(cnt)
            for r in g.reps:
                self._memory(m, gi, r, supply, mem)
                self._recompute(m, gi, r, ns, xs, charge_recompute)
        self.stats = {"columns": len(m.cost) - cols0, "rows": len(m.row_lb) - rows0,
                      "groups": len(self.groups)}
        return mem

    def _memory(self, m, gi: int, r: fx.Node, supply, mem: dict[int, float]) -> None:
        """r's saved bytes, every copy of its group (see the module docstring)."""
        if is_view(r) or alias_root(r) is not r or not isinstance(r.meta.get("val"), torch.Tensor):
            return  # a view lives in its base's allocation, a tuple in its elements: counted there
        pols = tuple(p for p in POLICIES if r in self.saved[p])
        if not pols:
            return
        L = len(self.groups[gi].layers)
        sup = supply(r)
        val = r.meta["val"]
        size = {p: float(local_bytes(val, p, self.costs.mesh_shape)) for p in sup}
        if len(pols) == len(POLICIES):  # saved whatever the policy: L copies, linear in y
            for p, vs in sup.items():
                for v in vs:
                    mem[v] = mem.get(v, 0.0) + L * size[p]
            return
        self._spread(m, gi, pols, list(sup.values()), list(size.values()),
                     lambda c, b: add_terms(mem, {c: b}))

    def _recompute(self, m, gi: int, r: fx.Node, ns, xs, charge_recompute) -> None:
        """r's kernel run again in the backward of its group's layers that recompute it."""
        pols = tuple(p for p in POLICIES if r in self.recomputed[p])
        st = ns.get(r)
        if not pols or st is None or st.alias_of is not None or r not in xs:
            return
        times = [self.costs.compute_time(r, s) for s in st.strategies]
        if max(times, default=0.0) <= 0.0:
            return
        self._spread(m, gi, pols, xs[r], times, lambda c, t: charge_recompute(c, t, r))

    def _spread(self, m, gi: int, pols: tuple[ACPolicy, ...], ends: list[list[int]], values: list[float],
                put: Callable[[int, float], None]) -> None:
        """sum_{P in pols} n[g,P] * value(chosen), exactly (see the module docstring)."""
        L = float(len(self.groups[gi].layers))
        lo, hi = min(values), max(values)
        if hi - lo <= SAME_TOL * max(abs(hi), 1e-30):  # the same whatever is chosen
            for p in pols:
                put(self.counts[gi][p], hi)
            return
        cols = []
        for vs, value in zip(ends, values, strict=True):
            w = m.var(0.0, ub=L, integer=False)
            cols.append(w)
            m.row(-math.inf, 0.0, {w: 1.0, **{v: -L for v in vs}})  # w <= L y
            if value:
                put(w, value)
        row = dict.fromkeys(cols, 1.0)
        for p in pols:
            row[self.counts[gi][p]] = row.get(self.counts[gi][p], 0.0) - 1.0
        m.row(0.0, 0.0, row)  # sum w = sum n
        self.spreads.append(_Spread(cols, ends, pols, gi))

    # ---- points ----------------------------------------------------------------------------
    def complete(self, val: np.ndarray, ac: ACChoice | None) -> None:
        """Fill the counts and the spread columns of a point whose x are set in ``val``, for
        the activation checkpointing ``ac`` (none where None). At fractional x too (an LP's
        point, ``solver.MemoryPart``): each spread column takes its placement's share of the
        count, n y[r,p], within its row w <= L y and summing to n."""
        by_layer = ac.layer_policies().layers if ac is not None else ()
        ordered = sorted({k for g in self.groups for k in g.layers})
        policy_of = dict(zip(ordered, by_layer, strict=False)) if len(by_layer) == len(ordered) else {}
        for g, cnt in zip(self.groups, self.counts, strict=True):
            for p, col in cnt.items():
                val[col] = float(sum(policy_of.get(k, ACPolicy.NONE) is p for k in g.layers))
        for s in self.spreads:
            n = sum(val[self.counts[s.group][p]] for p in s.policies)
            for col, vs in zip(s.cols, s.ends, strict=True):
                val[col] = n * val[vs].sum()

    def choice(self, sol: np.ndarray) -> ACChoice:
        """The counts at the solution ``sol``."""
        out = []
        for g, cnt in zip(self.groups, self.counts, strict=True):
            n = {p: int(round(float(sol[c]))) for p, c in cnt.items()}
            out.append(ACGroup(tuple(g.layers), n[ACPolicy.NONE], n[ACPolicy.SELECTIVE], n[ACPolicy.FULL]))
        return ACChoice(tuple(out))
