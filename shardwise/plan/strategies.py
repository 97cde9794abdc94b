"""Candidate placements for every node, from DTensor's sharding propagation.

For each call_function node we hand DTensor's strategy function an ``OpSchema`` whose tensor
arguments are ``OpStrategy`` objects listing every placement their producer may take, and keep
the ``OpSpec`` list it returns: (output placements, input placements) pairs. Placeholders get
every combination of ``Shard(d)`` / ``Replicate()`` per mesh dim. Shards that do not divide
evenly are dropped everywhere (DTensor supports them, but they make local shapes rank-dependent
and the cost model approximate). Ops DTensor has no rule for get our own rules (``RULES``) or,
failing that, the replicated fallback, and are listed so the plan can report them.

``getitem`` nodes take no decision of their own: they read element ``i`` of their parent's
chosen output (``NodeStrategies.alias_of``).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import operator
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy, TupleStrategy
from torch.distributed.tensor.placement_types import Placement
from torch.utils._pytree import tree_flatten, tree_map

from shardwise.ir.match import draws_random
from shardwise.ir.meta import flat_tensors
from shardwise.plan.placement import Placements, on_mesh
from shardwise.plan.plan import tensor_args

log = logging.getLogger(__name__)
aten = torch.ops.aten


@dataclass(frozen=True)
class Strategy:
    """One way to run a node: its output placements (one per tensor output) and the placements it
    needs each tensor argument in (``tensor_args`` order)."""

    output: tuple[Placements, ...]
    inputs: tuple[Placements, ...]


@dataclass
class NodeStrategies:
    node: fx.Node
    strategies: list[Strategy] = field(default_factory=list)
    alias_of: tuple[fx.Node, int] | None = None  # getitem: (parent, output index)
    follows: fx.Node | None = None  # strategy i reads its one input in the producer's placement
    fallback: bool = False

    def output_choices(self, index: int = 0) -> list[Placements]:
        """Distinct placements output ``index`` may take, in first-seen order."""
        return list(dict.fromkeys(s.output[index] for s in self.strategies))


def _tensor_meta(t: torch.Tensor) -> TensorMeta:
    return TensorMeta(t.shape, t.stride(), t.dtype)


def divides_evenly(placements: Placements, shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> bool:
    """Every Shard(d) splits dim d into equal pieces (counting earlier mesh dims sharding d too)."""
    sizes = list(shape)
    for p, m in zip(placements, mesh_shape, strict=True):
        if isinstance(p, Shard):
            d = p.dim % len(sizes) if sizes else 0
            if not sizes or sizes[d] % m:
                return False
            sizes[d] //= m
    return True


def placeholder_choices(t: torch.Tensor, mesh_shape: tuple[int, ...]) -> list[Placements]:
    """Every Shard/Replicate combination over the mesh that divides ``t`` evenly (size-1 mesh
    dims replicated, see ``placement.on_mesh``)."""
    splits = [Shard(d) for d in range(t.dim())]
    per_dim = [[Replicate()] + (splits if m > 1 else []) for m in mesh_shape]
    return [ps for ps in itertools.product(*per_dim) if divides_evenly(ps, tuple(t.shape), mesh_shape)]


# A mean loss over batch-split tokens is a pending average (DTensor's nll_loss rules): the data
# parallelism every framework runs (each rank its own tokens' loss, averaged).
AVG_PARTIAL_OPS = frozenset({torch.ops.aten.nll_loss_forward.default,
                             torch.ops.aten.nll_loss_backward.default})


def _sum_partials_only(s: Strategy, target: object = None) -> bool:
    """Pending sums are the only partials our graphs create (matmul contractions, reductions),
    and averages for a mean loss; DTensor's rules also offer other avg/max/min partials, which
    would only bloat the search."""
    ok = ("sum", "avg") if target in AVG_PARTIAL_OPS else ("sum",)
    return all(not isinstance(p, Partial) or p.reduce_op in ok
               for ps in (*s.output, *s.inputs) for p in ps)


def _partial_integers(s: Strategy, outs: list[torch.Tensor | None], ins: list[torch.Tensor]) -> bool:
    """Whether ``s`` has an integer or boolean tensor pending a sum. Made from a replicated one,
    a sum is split by dividing (``lower/spmd._to_partial``), which turns int64 positions into
    float32 ones (EXAONE-4's, Granite's, Cohere's and Gemma-3's auto plans at batch 8 x 1024 built
    their attention masks so, and moved half the bytes their plans priced); nor does a pending
    sum of comparisons mean anything."""
    placed = [*zip(s.output, outs, strict=False), *zip(s.inputs, ins, strict=False)]
    return any(v is not None and ps is not None and not v.dtype.is_floating_point
               and any(isinstance(p, Partial) for p in ps) for ps, v in placed)


def _valid(s: Strategy, out_shapes: list[tuple[int, ...] | None], in_shapes: list[tuple[int, ...]],
           mesh_shape: tuple[int, ...], target: object = None) -> bool:
    if not _sum_partials_only(s, target):
        return False
    if any(ps != on_mesh(ps, mesh_shape) for ps in (*s.output, *s.inputs)):
        return False
    for ps, shp in zip(s.output, out_shapes, strict=False):
        if shp is not None and not divides_evenly(ps, shp, mesh_shape):
            return False
    for ps, shp in zip(s.inputs, in_shapes, strict=False):
        if not divides_evenly(ps, shp, mesh_shape):
            return False
    return True


def _placements_of(spec) -> Placements | None:
    return tuple(spec.placements) if isinstance(spec, DTensorSpec) else None


# Our own rules, for ops DTensor has none for: op -> function(node, input choices, mesh) -> strategies.
RuleFn = Callable[[fx.Node, list[list[Placements]], DeviceMesh], list[Strategy]]
RULES: dict[object, RuleFn] = {}


def register_rule(*ops: object) -> Callable[[RuleFn], RuleFn]:
    def deco(fn: RuleFn) -> RuleFn:
        for op in ops:
            RULES[op] = fn
        return fn
    return deco


def _attention_input(node: fx.Node, i: int, p: Placement) -> Placement:
    """Placement of attention argument ``i`` when batch (S(0)) or heads (S(1)) are sharded:
    q/k/v/out/grads follow; a broadcast mask (size 1 on that dim) stays replicated."""
    if isinstance(p, Replicate):
        return p
    val = tensor_args(node)[i].meta["val"]
    return p if val.dim() > p.dim and val.shape[p.dim] > 1 else Replicate()


def _attention_rule(node: fx.Node, n_out: int) -> list[tuple[tuple, tuple]]:
    """Single-mesh-dim rows (outputs, inputs) for CPU flash attention (forward or backward) over
    [B, H, S, D] tensors: batch and heads shard, as in DTensor's rule for the CUDA kernels;
    everything replicated is always valid."""
    n_in = len(tensor_args(node))
    return [((p,) * n_out, tuple(_attention_input(node, i, p) for i in range(n_in)))
            for p in (Replicate(), Shard(0), Shard(1))]


@register_rule(aten._scaled_dot_product_flash_attention_for_cpu.default)
def _sdpa_cpu(node: fx.Node, choices: list[list[Placements]], mesh: DeviceMesh) -> list[Strategy]:
    """(out, logsumexp) from (q, k, v[, mask])."""
    return _combine_per_mesh_dim(_attention_rule(node, 2), mesh.ndim)


@register_rule(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
def _sdpa_cpu_bwd(node: fx.Node, choices: list[list[Placements]], mesh: DeviceMesh) -> list[Strategy]:
    """(dq, dk, dv) from (dout, q, k, v, out, logsumexp[, mask])."""
    return _combine_per_mesh_dim(_attention_rule(node, 3), mesh.ndim)


def _norm_rule(n_out: int, n_act: int, n_weight: int):
    """RMSNorm family: normalises over the last dim, so activations shard on any other dim (all
    alike) and the weight stays replicated; pending sums must be reduced first."""

    def rule(node: fx.Node, choices: list[list[Placements]], mesh: DeviceMesh) -> list[Strategy]:
        rank = tensor_args(node)[0].meta["val"].dim()
        per_dim = [((p,) * n_out, (p,) * n_act + (Replicate(),) * n_weight)
                   for p in [Replicate()] + [Shard(d) for d in range(rank - 1)]]
        return _combine_per_mesh_dim(per_dim, mesh.ndim)

    return rule


def register_norm_rules() -> None:
    """Rules for shardwise's own norm ops (DTensor knows nothing of them)."""
    import shardwise.ir.ops  # noqa: F401  (registers torch.ops.shardwise)

    ops = torch.ops.shardwise
    register_rule(ops.rms_norm.default)(_norm_rule(1, 1, 1))
    register_rule(ops.add_rms_norm.default)(_norm_rule(1, 2, 1))
    register_rule(ops.add_rms_norm2.default)(_norm_rule(2, 2, 1))


@register_rule(aten.einsum.default)
def _einsum(node: fx.Node, choices: list[list[Placements]], mesh: DeviceMesh) -> list[Strategy]:
    """The canonical graph's einsums (from ``passes/einsum.py``): DTensor's einsum rule, which it
    uses internally for mm/bmm but does not register for ``aten.einsum`` itself."""
    from torch.distributed.tensor._ops._einsum_strategy import gen_einsum_strategies

    equation = node.args[0]
    out = []
    for spec in gen_einsum_strategies(equation, mesh).strategies:
        out.append(Strategy((tuple(spec.output_spec.placements),),
                            tuple(tuple(s.placements) for s in spec.input_specs)))
    return out


register_norm_rules()


@register_rule(aten.lift_fresh_copy.default)
def _copy(node: fx.Node, choices: list[list[Placements]], mesh: DeviceMesh) -> list[Strategy]:
    """A copy of a constant the forward makes (``torch.tensor(...)``: GPT-Neo's and Falcon's
    masking value) is placed as the constant is."""
    return [Strategy((p,), (p,)) for p in choices[0]]


# Activation gradients DTensor has no rule for (it has their forwards'): Apertus's xIELU reads
# softplus, and transformers' ACT2FN offers the rest.
ACTIVATION_BACKWARD = (aten.elu_backward.default, aten.hardsigmoid_backward.default,
                       aten.hardswish_backward.default, aten.hardtanh_backward.default,
                       aten.leaky_relu_backward.default, aten.mish_backward.default,
                       aten.softplus_backward.default)


@register_rule(*ACTIVATION_BACKWARD)
def _activation_backward(node: fx.Node, choices: list[list[Placements]], mesh: DeviceMesh) -> list[Strategy]:
    """(grad_output, input or result) -> grad_output * f'(input), elementwise: per mesh dim all
    three Replicate or Shard of the same dim, or the gradients Partial and the input Replicate
    (linear in the gradient)."""
    rank = tensor_args(node)[0].meta["val"].dim()
    rows = [((Replicate(),), (Replicate(), Replicate())), ((Partial(),), (Partial(), Replicate()))]
    rows += [((Shard(d),), (Shard(d), Shard(d))) for d in range(rank)]
    return _combine_per_mesh_dim(rows, mesh.ndim)


@register_rule(aten.stack.default)
def _stack(node: fx.Node, choices: list[list[Placements]], mesh: DeviceMesh) -> list[Strategy]:
    """Every way to stack: per mesh dim all inputs Replicate, or Shard of the same dim (the
    output's dims from the new one on are one further), or Partial (stacking is linear); the
    output alike. DTensor's rule returns one strategy, the placement its inputs "follow", which
    leaves the planner no choice (Helium's and Cohere's interleaved rotary embeddings stack two
    halves: that one strategy sharded the heads over dp, so no hand plan applied). Its cat rule
    already lists every way."""
    n_in, rank = len(tensor_args(node)), tensor_args(node)[0].meta["val"].dim()
    dim = (node.args[1] if len(node.args) > 1 else 0) % (rank + 1)
    rows = [((Replicate(),), (Replicate(),) * n_in), ((Partial(),), (Partial(),) * n_in)]
    rows += [((Shard(d + 1 if d >= dim else d),), (Shard(d),) * n_in) for d in range(rank)]
    return _combine_per_mesh_dim(rows, mesh.ndim)


def _combine_per_mesh_dim(per_dim, ndim: int) -> list[Strategy]:
    """Cartesian product of single-mesh-dim (outputs, inputs) rules over ``ndim`` mesh dims."""
    out = []
    for combo in itertools.product(per_dim, repeat=ndim):
        n_out, n_in = len(combo[0][0]), len(combo[0][1])
        out.append(Strategy(
            tuple(tuple(c[0][i] for c in combo) for i in range(n_out)),
            tuple(tuple(c[1][i] for c in combo) for i in range(n_in)),
        ))
    return out


def _replicated(node: fx.Node, mesh_ndim: int) -> Strategy:
    rep = (Replicate(),) * mesh_ndim
    n_out = max(1, len(_out_vals(node)))
    return Strategy((rep,) * n_out, (rep,) * len(tensor_args(node)))


def _out_vals(node: fx.Node) -> list[torch.Tensor | None]:
    v = node.meta.get("val")
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (tuple, list)):
        return [x if isinstance(x, torch.Tensor) else None for x in v]
    return []


def _strategy_specs(result) -> list[OpSpec] | None:
    """The OpSpecs of a strategy function's result (None for per-output tuple strategies, which
    our graphs do not need)."""
    return None if isinstance(result, TupleStrategy) else list(result.strategies)


def _dtensor_strategies(node: fx.Node, arg_choices: dict[fx.Node, list[Placements]],
                        mesh: DeviceMesh) -> list[Strategy] | None:
    """Ask DTensor's propagator for the op's strategies; None when it has no rule."""

    prop = DTensor._op_dispatcher.sharding_propagator
    op = node.target
    single = prop.op_single_dim_strategy_funcs.get(op)
    func = prop.op_strategy_funcs.get(op)
    if single is None and func is None:
        return None

    def schema_for(choices: dict[fx.Node, list[Placements]]) -> OpSchema:
        def to_strategy(a):
            if isinstance(a, fx.Node):
                v = a.meta.get("val")
                if isinstance(v, torch.Tensor):
                    tm = _tensor_meta(v)
                    return OpStrategy([OpSpec(DTensorSpec(mesh, p, tensor_meta=tm)) for p in choices[a]])
                return v
            return a

        args = tree_map(to_strategy, node.args, is_leaf=lambda x: isinstance(x, fx.Node))
        kwargs = tree_map(to_strategy, node.kwargs, is_leaf=lambda x: isinstance(x, fx.Node))
        args = tuple(TupleStrategy(tuple(a)) if isinstance(a, list) and a
                     and all(isinstance(x, OpStrategy) for x in a) else a for a in args)
        return OpSchema(op, args, kwargs, schema_info=prop.op_to_schema_info.get(op)
                        or prop.op_to_schema_info_for_single_dim_strategy.get(op))

    if single is not None:
        return _single_dim_strategies(node, schema_for(arg_choices), single, mesh)
    targs = tensor_args(node)
    try:
        specs = _strategy_specs(func(schema_for(arg_choices)))
    except (IndexError, AssertionError):
        # Some rules (nll_loss) index every input's strategy list by one input's position: ask
        # once per placement of each input (the backward's pivot is its second), the others
        # offered replicated.
        rep = (Replicate(),) * mesh.ndim
        specs = []
        for pivot in dict.fromkeys(targs):
            for p in arg_choices[pivot]:
                one = {a: [rep] for a in targs}
                one[pivot] = [p]
                try:
                    specs.extend(_strategy_specs(func(schema_for(one))) or [])
                except (IndexError, AssertionError):
                    continue
    except Exception:
        if len(targs) != 1:
            raise
        # One input placement the rule cannot take (a view splitting a sharded dim unevenly)
        # fails the whole list: ask once per placement and keep the ones it takes.
        specs = []
        for p in arg_choices[targs[0]]:
            try:
                specs.extend(_strategy_specs(func(schema_for({targs[0]: [p]}))) or [])
            except Exception:  # noqa: BLE001  (this placement has no strategy; the others may)
                continue
    if specs is None:
        return None
    n_in = len(tensor_args(node))
    strategies = []
    for spec in specs:
        outs = spec.output_specs
        out_ps = (tuple(_placements_of(o) or (Replicate(),) * mesh.ndim for o in outs)
                  if isinstance(outs, (tuple, list)) else (_placements_of(outs),))
        if spec.input_specs is None:
            ins = (out_ps[0],) * n_in
        else:
            ins = tuple(_placements_of(s) for s in spec.input_specs)
        if len(ins) != n_in or any(p is None for p in ins) or any(p is None for p in out_ps):
            continue
        strategies.append(Strategy(out_ps, ins))
    return strategies


def _single_dim_strategies(node: fx.Node, schema: OpSchema, info, mesh: DeviceMesh) -> list[Strategy]:
    """Ops with a single-mesh-dim rule: expand its per-dim (outputs, inputs) rows over the mesh.

    DTensor's own expansion needs concrete input placements; we want every combination, so we
    materialise the rows once (placeholders filled with plain ``Shard``) and take their product.
    """
    from torch.distributed.tensor._ops.single_dim_strategy import _PreparedSingleDimStrategy

    def one_spec(s):
        if isinstance(s, OpStrategy):
            sp = s.strategies[0].output_spec
            spec = DTensorSpec(mesh, (Shard(0),) * mesh.ndim, tensor_meta=sp.tensor_meta)
            return OpStrategy([OpSpec(spec)])
        if isinstance(s, TupleStrategy):
            return TupleStrategy(tuple(one_spec(c) for c in s.children))
        return s

    probe = OpSchema(schema.op, tuple(one_spec(a) for a in schema.args_schema),
                     {k: one_spec(v) for k, v in schema.kwargs_schema.items()},
                     schema_info=schema.schema_info)
    vals = _out_vals(node)
    out_meta = (_tensor_meta(vals[0]) if isinstance(node.meta.get("val"), torch.Tensor)
                else [_tensor_meta(v) if v is not None else None for v in vals])
    prepared = _PreparedSingleDimStrategy(info, probe, out_meta)
    n_out = prepared.num_outputs
    rows = [r for r in prepared.expanded_strategies if all(p is not None for p in r[n_out:])]
    rep = Replicate()
    out = []
    for combo in itertools.product(rows, repeat=mesh.ndim):
        outs = tuple(tuple(r[i] if r[i] is not None else rep for r in combo) for i in range(n_out))
        ins = tuple(tuple(r[n_out + j] for r in combo) for j in range(len(rows[0]) - n_out))
        out.append(Strategy(outs, ins))
    return out


@contextlib.contextmanager
def _no_redistribute_costs():
    """DTensor's strategy functions price every input redistribution with their own cost model;
    we price edges ourselves, so skip that work (it is most of the enumeration time)."""
    import torch.distributed.tensor._ops as ops_pkg

    def zeros(input_strategy, *args, **kwargs):
        return [0.0] * len(input_strategy.strategies)

    def zero(*args, **kwargs):
        return 0.0

    saved = []
    for name, mod in list(sys.modules.items()):
        if not name.startswith(ops_pkg.__name__):
            continue
        for attr, repl in (("generate_redistribute_costs", zeros), ("redistribute_cost", zero)):
            if hasattr(mod, attr):
                saved.append((mod, attr, getattr(mod, attr)))
                setattr(mod, attr, repl)
    try:
        yield
    finally:
        for mod, attr, fn in saved:
            setattr(mod, attr, fn)


_INTERNED: dict[Placements, Placements] = {}


def intern(ps: Placements) -> Placements:
    """One object per distinct placements tuple, so hot loops can key caches on ``id``."""
    return _INTERNED.setdefault(ps, ps)


def _plain(ps: Placements, replicated: bool) -> Placements:
    """DTensor's vocab-parallel embedding reads its indices as a "mask partial" (a replicated
    tensor it masks locally) and yields one; to the plan these are Replicate in and a pending
    sum out (and a pending sum wherever else one is read), which is what the lowering runs."""
    from torch.distributed.tensor._ops._embedding_ops import _MaskPartial

    if not any(isinstance(p, _MaskPartial) for p in ps):
        return ps
    return tuple((Replicate() if replicated else Partial()) if isinstance(p, _MaskPartial) else p for p in ps)


def _mask_partial_dims(s: Strategy) -> int:
    """Mesh dims on which a vocab-parallel lookup leaves a masked partial. DTensor cannot lower
    more than one (comparing two masks is data-dependent on fake tensors), so plans use one."""
    from torch.distributed.tensor._ops._embedding_ops import _MaskPartial

    return max((sum(isinstance(p, _MaskPartial) for p in ps) for ps in s.output), default=0)


def _without_mask_partials(node: fx.Node, s: Strategy) -> Strategy:
    is_embedding = node.target is aten.embedding.default
    return Strategy(tuple(_plain(p, False) for p in s.output),
                    tuple(_plain(p, is_embedding and j == 1) for j, p in enumerate(s.inputs)))


def _interned(s: Strategy) -> Strategy:
    return Strategy(tuple(intern(p) for p in s.output), tuple(intern(p) for p in s.inputs))


def enumerate_strategies(gm: fx.GraphModule, mesh: DeviceMesh,
                         placeholder_filter: Callable[[fx.Node, Placements], bool] | None = None,
                         rep: dict[fx.Node, fx.Node] | None = None) -> dict[fx.Node, NodeStrategies]:
    """Strategies of every node in ``gm``; see the module docstring.

    With ``rep`` (from clustering), only representatives are enumerated; other nodes reuse their
    representative's choices.
    """
    with _no_redistribute_costs():
        result = _enumerate(gm, mesh, placeholder_filter, rep)
    for ns in result.values():
        ns.strategies = [_interned(s) for s in ns.strategies]
    return result


def _enumerate(gm, mesh, placeholder_filter, rep) -> dict[fx.Node, NodeStrategies]:
    mesh_shape = tuple(mesh.shape)
    result: dict[fx.Node, NodeStrategies] = {}
    choices: dict[fx.Node, list[Placements]] = {}
    asked: dict[tuple, tuple[list[Strategy], bool]] = {}
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        if rep is not None and rep.get(node, node) is not node:
            if rep[node] in choices:
                choices[node] = choices[rep[node]]
            continue
        ns = NodeStrategies(node)
        result[node] = ns
        val = node.meta.get("val")
        if node.op == "placeholder":
            opts = placeholder_choices(val, mesh_shape) if isinstance(val, torch.Tensor) else []
            if placeholder_filter is not None:
                opts = [p for p in opts if placeholder_filter(node, p)]
            ns.strategies = [Strategy((p,), ()) for p in opts]
        elif node.op == "get_attr":  # a constant the trace captured: every rank holds it whole
            whole = (Replicate(),) * len(mesh_shape)
            ns.strategies = [Strategy((whole,), ())] if isinstance(val, torch.Tensor) else []
        elif node.target is operator.getitem:
            parent, idx = node.args
            ns.alias_of = (parent, idx)
            parent_rep = rep.get(parent, parent) if rep is not None else parent
            ns.strategies = [Strategy((s.output[idx],), ()) for s in result[parent_rep].strategies]
        elif node.op == "call_function":
            ns.strategies = _node_strategies(node, choices, mesh, ns, asked)
            _make_follower(ns, choices)
        if isinstance(val, torch.Tensor):
            choices[node] = ns.output_choices()
    return result


def _make_follower(ns: NodeStrategies, choices: dict[fx.Node, list[Placements]]) -> None:
    """A node with one tensor input that can read it in every placement its producer may yield
    takes no decision of its own: it keeps one strategy per producer placement and follows it.

    This is the planner's one restriction of DTensor's space: no redistribution right before a
    view or single-input op (the same collective then happens after it, on its output).
    """
    targs = tensor_args(ns.node)
    if len(targs) != 1 or ns.fallback or targs[0] not in choices:
        return
    src = targs[0]
    by_input: dict[Placements, Strategy] = {}
    for s in ns.strategies:
        by_input.setdefault(s.inputs[0], s)
    if not all(p in by_input for p in choices[src]):
        return
    ns.strategies = [by_input[p] for p in choices[src]]
    ns.follows = src


def _node_strategies(node: fx.Node, choices: dict[fx.Node, list[Placements]], mesh: DeviceMesh,
                     ns: NodeStrategies, cache: dict[tuple, tuple[list[Strategy], bool]]) -> list[Strategy]:
    """The node's strategies, asked once per distinct question (op, arguments' shapes and
    choices): a layer's forward and backward repeat the same elementwise ops many times."""
    mesh_shape = tuple(mesh.shape)
    targs = tensor_args(node)
    # An input whose representative comes later in the graph (clustered copies can interleave
    # near layer boundaries) has no choices yet: offer it every placement; edges price the rest.
    choices = {a: choices[a] if a in choices else placeholder_choices(a.meta["val"], mesh_shape)
               for a in targs}
    key = _question(node, choices)
    hit = cache.get(key)
    if hit is None:
        hit = cache[key] = _ask(node, choices, mesh, targs)
    found, ns.fallback = hit
    return list(found)


def _question(node: fx.Node, choices: dict[fx.Node, list[Placements]]) -> tuple:
    """What a node's strategies depend on: op, outputs, and each argument (a tensor by shape,
    strides, dtype and the placements its producer offers)."""
    def leaf(a):
        if isinstance(a, fx.Node):
            v = a.meta.get("val")
            if isinstance(v, torch.Tensor):
                return (tuple(v.shape), v.stride(), v.dtype, tuple(choices[a]))
            return ("value", repr(v))
        return a if isinstance(a, (int, float, bool, str, type(None), torch.dtype)) else repr(a)

    args, spec = tree_flatten((node.args, node.kwargs))
    outs = tuple((tuple(v.shape), v.dtype) if v is not None else None for v in _out_vals(node))
    return (node.target, str(spec), tuple(leaf(a) for a in args), outs)


def _ask(node: fx.Node, choices: dict[fx.Node, list[Placements]], mesh: DeviceMesh,
         targs: list[fx.Node]) -> tuple[list[Strategy], bool]:
    """(strategies, fell back to replicated) from our rules or DTensor's."""
    mesh_shape = tuple(mesh.shape)
    ins, outs = [a.meta["val"] for a in targs], _out_vals(node)
    in_shapes = [tuple(v.shape) for v in ins]
    out_shapes = [tuple(v.shape) if v is not None else None for v in outs]
    found: list[Strategy] | None = None
    if draws_random(node):
        # A random draw (a dropout mask) is made whole on every rank, from a generator every
        # rank seeds alike (``train/module.py`` checks it), and read by its consumers as a free
        # slice: each rank holds the numbers one process draws for its piece. Drawn sharded,
        # every shard would repeat the same numbers.
        return [_replicated(node, len(mesh_shape))], False
    if node.target in RULES:
        found = RULES[node.target](node, [choices[a] for a in targs], mesh)
    else:
        try:
            found = _dtensor_strategies(node, choices, mesh)
        except Exception as e:  # DTensor's rule rejected these inputs: fall back, and say so
            log.debug("no DTensor strategy for %s: %s", node.format_node(), e)
            found = None
    if found is not None:
        found = [_without_mask_partials(node, s) for s in found if _mask_partial_dims(s) <= 1]
        found = [s for s in dict.fromkeys(found) if _valid(s, out_shapes, in_shapes, mesh_shape, node.target)
                 and not _partial_integers(s, outs, ins)]
    if not found:
        # factory ops (no tensor inputs) are simply replicated; others fall back, and say so
        return [_replicated(node, len(mesh_shape))], bool(targs)
    return found, False


def flat_tensor_vals(node: fx.Node) -> list[torch.Tensor]:
    return flat_tensors(node.meta.get("val"))
