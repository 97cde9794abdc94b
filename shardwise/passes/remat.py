"""Rematerialisation (activation checkpointing) of a joint forward+backward graph.

The backward of a training step reads forward values ("saved activations"), which therefore stay
alive from the forward until the backward. This pass recomputes some of them in the backward
instead, so the forward originals die early::

    before                                      after (policy full)
      h1 = add(h0, o)         (kept)              h1 = add(h0, o)
      r  = rsqrt(mean(h1^2))  (alive until bwd)   r  = rsqrt(mean(h1^2))     (dies in the forward)
      y  = mul(h1, r)         (alive until bwd)   y  = mul(h1, r)
      ...                                         ...
      g  = mul(dy, r)         (backward)          r' = rsqrt(mean(h1^2))     (copy, just before g)
                                                  g  = mul(dy, r')

Regions (``ir/regions.py``). The *backward* starts at the seed of autograd (``ones_like(loss)``):
nodes before it form the forward region, nodes after it the backward region. Forward-region
nodes the graph marks as backward (the ``detach`` of a value autograd saves) are forward values
like any other; forward nodes after the seed (a lowered program delivers its loss last) are
never rewritten.

Policies (``ACPolicy``), each a set of forward values that are kept (saved); every other forward
value that is safe to recompute and that the backward reads is recomputed from the kept ones:

- ``none``: nothing is recomputed.
- ``full``: keep each block's inputs only. The blocks are found on the graph, not by name: the
  *spine* is the chain of nodes that post-dominate the step's inputs (every path from the token
  ids to the loss passes through them: the embedding, the residual adds, the head); a spine
  node that closes a stretch holding an attention op (a fused kernel, or an eager attention's
  softmax: ``marks_attention``) is the middle of a transformer block
  (``h + attention(h)``, read by the block's MLP) and is recomputed; the other spine nodes
  (each layer's input, the head) are kept, everything else is recomputed. A model without
  residual connections is all spine: nothing to recompute.
- ``selective``: torchtitan's per-op policy (``torchtitan/models/llama3/infra/parallelize.py``,
  ``_save_list``): keep the block inputs, every matmul output except every second one (counted
  from each block's input, as torchtitan counts per checkpointed block), attention outputs and
  reduce_scatter outputs; recompute the rest.

Per-layer policies (``LayerPolicies``): one policy per decoder layer, as torchtitan's per-layer
AC wraps chosen ``TransformerBlock``s (``ac_freq``). The layers are found on the graph, as the
blocks are: a *layer start* is a block input whose stretch of the forward (up to the next spine
node) holds an attention op; forward node ``i`` belongs to the last layer start at or before it
(graph order is program order). Nodes before the first layer (the embedding, the rotary tables)
follow the first layer's policy and nodes after the last layer (the head, the loss) the last
layer's, so one policy for every layer is exactly that global policy. A forward value is kept or
recomputed by its own layer's policy; a recomputed value's inputs are recomputed where their own
layer allows it, else saved.

Collectives: an ``all_gather`` may be recomputed under both policies (that is what FSDP2's
reshard-after-forward does: parameters are gathered again in the backward); ``full`` also
recomputes ``reduce_scatter`` and ``all_reduce`` (torchtitan's full AC reruns the whole block,
its tensor-parallel collectives included); ``selective`` keeps them (its save list holds
reduce_scatter). ``all_to_all``/``broadcast`` are always kept. Every rank runs the same rewritten
program, so the collectives still run in the same order on every rank.

Rewrite: each backward-region node that reads a recomputed forward value reads a copy instead;
the copy (and the copies of its recomputed inputs, recursively) is inserted just before the
first backward node that needs it and shared by later readers (one copy chain per forward
value: a value that several blocks' backwards read, such as rotary tables, is recomputed once).

Safety (each a named predicate below; a node not proven safe is kept, never recomputed):
random ops (``nondeterministic_seeded``), ops with nondeterministic bits, uninitialised
allocations (``empty``), in-place ops and anything reading a value an in-place op writes (or a
view of it), ops outside ``aten``/``prims`` and shardwise's norms (runtime mesh coordinates,
fused collective-matmuls), values with data-dependent shapes, non-tensor values, and a
``wait_tensor`` unless its collective is recomputed with it (a collective is waited once).
Placeholders (parameters, inputs) and constants are always available and never copied.
"""

from __future__ import annotations

import enum
import logging
import operator
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import fx

from shardwise.errors import UserError
from shardwise.ir.match import (
    C10D_KINDS,
    DROPOUT_ARG,
    CollectiveKind,
    input_closure,
    is_getitem,
    is_op,
    is_wait,
    schema_arg,
)
from shardwise.ir.regions import (
    alias_root,
    backward_start,
    input_placeholders,
    is_scalar,
    is_view_op,
    spine,
)
from shardwise.ir.trace import forward_nodes

log = logging.getLogger(__name__)
aten = torch.ops.aten
# ``node.meta`` key of a copy: the name of the forward node it recomputes (costing prices it).
RECOMPUTED_FROM = "remat_source"


class ACPolicy(enum.Enum):
    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"


@dataclass(frozen=True)
class LayerPolicies:
    """A policy per decoder layer, in forward order (see the module docstring)."""

    layers: tuple[ACPolicy, ...]

    def uniform(self) -> ACPolicy | None:
        """The one policy every layer runs, else None. A choice naming no layer (the planner found
        no decoder layer by its parameters' names) checkpoints nothing: none."""
        kinds = set(self.layers) or {ACPolicy.NONE}
        return kinds.pop() if len(kinds) == 1 else None

    def counts(self) -> dict[ACPolicy, int]:
        return {p: self.layers.count(p) for p in ACPolicy}

    def describe(self) -> str:
        """E.g. ``full x 12, none x 20`` (or the one policy's name)."""
        one = self.uniform()
        if one is not None:
            return one.value
        return ", ".join(f"{p.value} x {n}" for p, n in self.counts().items() if n)


# What ``recompute_plan`` and the step options take: one policy, or one per layer.
AnyPolicy = ACPolicy | LayerPolicies


def simplify_policy(policy: AnyPolicy) -> AnyPolicy:
    """A ``LayerPolicies`` whose layers all run one policy is that policy."""
    if isinstance(policy, LayerPolicies):
        one = policy.uniform()
        return one if one is not None else policy
    return policy


def policy_name(policy: AnyPolicy) -> str:
    """``none``/``selective``/``full``, or the per-layer mix (``full x 12, none x 20``)."""
    return policy.value if isinstance(policy, ACPolicy) else policy.describe()


def parse_policy(policy: ACPolicy | str) -> ACPolicy:
    """``policy`` as an ``ACPolicy``; an unknown name is a ``UserError`` (one sentence)."""
    if isinstance(policy, ACPolicy):
        return policy
    try:
        return ACPolicy(str(policy).strip().lower())
    except ValueError:
        names = ", ".join(p.value for p in ACPolicy)
        raise UserError(f"unknown activation checkpointing policy {policy!r}; use one of {names}.") from None


# ---------------------------------------------------------------------------------------------
# Per-op knowledge.
# ---------------------------------------------------------------------------------------------

# Matmul-class ops (selective keeps every other one). Packets, so every overload matches.
MATMUL_PACKETS = frozenset({aten.mm, aten.bmm, aten.addmm, aten.baddbmm, aten.matmul, aten.einsum,
                            aten.linear, aten._scaled_mm})
# Attention ops whose outputs selective keeps (torchtitan's save list names the CUDA flash and
# efficient kernels; the CPU and cuDNN variants are the same computation).
ATTENTION_PACKETS = frozenset({
    aten._scaled_dot_product_flash_attention, aten._scaled_dot_product_efficient_attention,
    aten._scaled_dot_product_flash_attention_for_cpu, aten._scaled_dot_product_cudnn_attention,
    aten._flash_attention_forward, aten._efficient_attention_forward,
})
# Collectives each policy may run again in the backward (see the module docstring).
RECOMPUTED_COLLECTIVES: dict[ACPolicy, frozenset[CollectiveKind]] = {
    ACPolicy.NONE: frozenset(),
    ACPolicy.SELECTIVE: frozenset({CollectiveKind.ALL_GATHER}),
    ACPolicy.FULL: frozenset({CollectiveKind.ALL_GATHER, CollectiveKind.REDUCE_SCATTER,
                              CollectiveKind.ALL_REDUCE}),
}
# Allocations whose contents are undefined: a copy would hold other garbage than the original.
UNINITIALISED_PACKETS = frozenset({aten.empty, aten.empty_like, aten.new_empty, aten.empty_strided,
                                   aten.new_empty_strided})
# Namespaces whose functional ops are pure functions of their inputs.
PURE_NAMESPACES = frozenset({"aten", "prims"})
# shardwise's own ops that are pure (the norms; fused collective-matmuls carry a collective).
PURE_SHARDWISE_OPS = frozenset({"rms_norm", "add_rms_norm", "add_rms_norm2"})
# Tags of ops whose result is not a function of their inputs alone.
UNSAFE_TAGS = frozenset({torch.Tag.nondeterministic_seeded, torch.Tag.nondeterministic_bitwise})


def _packet(node: fx.Node) -> object:
    return getattr(node.target, "overloadpacket", None)


def is_matmul(node: fx.Node) -> bool:
    """A matmul-class ATen op."""
    return node.op == "call_function" and _packet(node) in MATMUL_PACKETS


def is_attention(node: fx.Node) -> bool:
    """A fused attention kernel (its tuple node: output, logsumexp, ...)."""
    return node.op == "call_function" and _packet(node) in ATTENTION_PACKETS


def marks_attention(node: fx.Node) -> bool:
    """Where a block's attention is, for finding blocks and layers: a fused kernel, or the
    softmax of an eager attention (transformers' for architectures without SDPA, such as
    Gemma-2; the loss's is a log_softmax)."""
    return is_attention(node) or is_op(node, aten._softmax.default)


def collective_kind(node: fx.Node) -> CollectiveKind | None:
    """The kind of a c10d functional collective op node, else None."""
    return C10D_KINDS.get(node.target) if node.op == "call_function" else None


# ---------------------------------------------------------------------------------------------
# Safety predicates.
# ---------------------------------------------------------------------------------------------


def is_mutating(node: fx.Node) -> bool:
    """An op that writes one of its inputs (in-place or out= variant)."""
    t = node.target
    return node.op == "call_function" and isinstance(t, torch._ops.OpOverload) and t._schema.is_mutable


def is_random(node: fx.Node) -> bool:
    """An op whose result depends on random state or is not bitwise reproducible (attention is
    tagged random for its dropout: with ``dropout_p == 0`` it is not)."""
    t = node.target
    if not isinstance(t, torch._ops.OpOverload) or not any(tag in UNSAFE_TAGS for tag in t.tags):
        return False
    return not (is_attention(node) and schema_arg(node, DROPOUT_ARG, 0.0) == 0.0)


def is_uninitialised(node: fx.Node) -> bool:
    """An allocation whose contents are undefined (``empty`` and friends)."""
    return node.op == "call_function" and _packet(node) in UNINITIALISED_PACKETS


def is_pure_op(node: fx.Node) -> bool:
    """A call of a pure function of its inputs: ``getitem``, an ATen/prims op, a shardwise norm."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return True
    t = node.target
    if not isinstance(t, torch._ops.OpOverload):
        return False  # Python builtins on SymInts, runtime helpers
    ns = t.namespace
    if ns == "shardwise":
        return t._schema.name.split("::")[-1] in PURE_SHARDWISE_OPS
    return ns in PURE_NAMESPACES


def has_tensor_value(node: fx.Node) -> bool:
    """The node computes a tensor, or a tuple/list of tensors (not a SymInt or None)."""
    v = node.meta.get("val")
    if isinstance(v, torch.Tensor):
        return True
    return isinstance(v, (tuple, list)) and any(isinstance(x, torch.Tensor) for x in v)


def _shares_memory(node: fx.Node) -> bool:
    """A view op, or a ``getitem`` (an element of a tuple result)."""
    return is_view_op(node) or node.target is operator.getitem


def written_values(graph: fx.Graph) -> set[fx.Node]:
    """Values an in-place op writes, with every view that shares their memory (closed both ways:
    the base of a written view and the views of a written base)."""
    out: set[fx.Node] = set()
    for n in graph.nodes:
        if is_mutating(n):
            out.add(n)
            out.update(a for a in n.all_input_nodes)
    changed = True
    while changed:
        changed = False
        for n in graph.nodes:
            if n in out or not _shares_memory(n):
                continue
            base = n.all_input_nodes[:1]
            if base and base[0] in out:
                out.add(n)
                changed = True
        for n in list(out):
            if _shares_memory(n) and n.all_input_nodes and n.all_input_nodes[0] not in out:
                out.add(n.all_input_nodes[0])
                changed = True
    return out


def safe_to_recompute(node: fx.Node, written: set[fx.Node]) -> bool:
    """Running ``node`` again later gives the same value (ignoring collectives' pairing, checked by
    the caller)."""
    if node.op != "call_function" or not has_tensor_value(node):
        return False
    if "unbacked_bindings" in node.meta:  # a data-dependent shape: a copy would bind new symbols
        return False
    if node in written or any(a in written for a in node.all_input_nodes):
        return False
    if collective_kind(node) is not None or is_wait(node):
        return True  # decided with the policy (pairing and kinds)
    return is_pure_op(node) and not is_random(node) and not is_uninitialised(node)


# ---------------------------------------------------------------------------------------------
# The plan.
# ---------------------------------------------------------------------------------------------


@dataclass
class RematPlan:
    """What a policy does to a graph: ``recompute`` lists the forward nodes copied into the
    backward (graph order), ``saved`` the forward values the backward still reads after the
    rewrite (graph order; placeholders and constants excluded: they are not activations).
    ``reason`` says why nothing is recomputed when that is so; ``start`` is the backward's first
    node (None without a backward)."""

    policy: AnyPolicy
    recompute: list[fx.Node] = field(default_factory=list)
    saved: list[fx.Node] = field(default_factory=list)
    kept: set[fx.Node] = field(default_factory=set, repr=False)
    # What selective layers keep by their save list (eager SAC caches it until the recompute).
    selective_kept: set[fx.Node] = field(default_factory=set, repr=False)
    start: fx.Node | None = None
    reason: str = ""


@dataclass
class _Regions:
    fwd: set[fx.Node]
    start: fx.Node
    forward: list[fx.Node]  # nodes before the seed, graph order
    backward: list[fx.Node]  # the seed and what follows, graph order (output excluded)

    @property
    def forward_set(self) -> set[fx.Node]:
        return set(self.forward)

    def readers(self) -> list[fx.Node]:
        """Backward-region nodes that may read copies (forward nodes placed late are not)."""
        return [n for n in self.backward if n not in self.fwd]


def _regions(gm: fx.GraphModule) -> _Regions | None:
    fwd = forward_nodes(gm)
    start = backward_start(gm, fwd)
    if start is None:
        return None
    nodes = list(gm.graph.nodes)
    i = nodes.index(start)
    return _Regions(fwd, start, nodes[:i], [n for n in nodes[i:] if n.op != "output"])


def block_inputs(spine_nodes: set[fx.Node], forward: list[fx.Node]) -> set[fx.Node]:
    """The spine nodes that enter a block: all but those that close a stretch of the forward
    holding an attention op (the residual add after attention, the middle of a transformer
    block: its MLP reads it, and recomputes it from the block's input). Without attention ops
    every spine node is a block input."""
    attention = [i for i, n in enumerate(forward) if marks_attention(n)]
    out: set[fx.Node] = set()
    prev = -1
    for i, n in enumerate(forward):
        if n not in spine_nodes:
            continue
        if not any(prev < a < i for a in attention):
            out.add(n)
        prev = i
    return out


def layer_starts(spine_nodes: set[fx.Node], forward: list[fx.Node]) -> list[fx.Node]:
    """The block inputs that start a decoder layer: those whose stretch of the forward up to the
    next spine node holds an attention op (graph order)."""
    inputs = block_inputs(spine_nodes, forward)
    attention = [i for i, n in enumerate(forward) if marks_attention(n)]
    on_spine = [(i, n) for i, n in enumerate(forward) if n in spine_nodes]
    return [n for (i, n), (j, _) in zip(on_spine, on_spine[1:], strict=False)
            if n in inputs and any(i < a < j for a in attention)]


def layer_of(forward: list[fx.Node], starts: list[fx.Node]) -> dict[fx.Node, int]:
    """Forward node -> the index of its layer: the last layer start at or before it (nodes
    before the first start: 0; see the module docstring)."""
    start_set = set(starts)
    out: dict[fx.Node, int] = {}
    k = -1
    for n in forward:
        if n in start_set:
            k += 1
        out[n] = max(k, 0)
    return out


def _policy_of(policy: AnyPolicy, forward: list[fx.Node],
               spine_nodes: set[fx.Node]) -> dict[fx.Node, ACPolicy]:
    """Each forward node's policy (its layer's, see the module docstring)."""
    policy = simplify_policy(policy)
    if isinstance(policy, ACPolicy):
        return dict.fromkeys(forward, policy)
    starts = layer_starts(spine_nodes, forward)
    if len(starts) != len(policy.layers):
        raise UserError(f"the activation checkpointing choice names {len(policy.layers)} layers but the "
                        f"graph has {len(starts)}; plan again for this model.")
    return {n: policy.layers[k] for n, k in layer_of(forward, starts).items()}


def _kept_by_policy(policy: ACPolicy, forward: list[fx.Node], spine_nodes: set[fx.Node]) -> set[fx.Node]:
    """Forward nodes the policy saves even though they could be recomputed: the block inputs,
    and under selective torchtitan's save list."""
    kept = block_inputs(spine_nodes, forward)
    if policy is ACPolicy.SELECTIVE:
        # torchtitan counts a block's matmuls and recomputes the 2nd, 4th, ...: keep 1st, 3rd...
        count = 0
        for n in forward:
            if n in kept:
                count = 0  # a new block
            if is_matmul(n):
                if count % 2 == 0:
                    kept.add(n)
                count += 1
        kept.update(n for n in forward if is_attention(n))
    return kept


def _recomputable(policy: dict[fx.Node, ACPolicy], forward: list[fx.Node], kept: set[fx.Node],
                  written: set[fx.Node]) -> set[fx.Node]:
    """Forward nodes their policy lets the backward recompute (see the module docstring)."""
    ok: set[fx.Node] = set()
    for n in forward:  # graph order: a getitem's or wait's producer is decided first
        if policy[n] is ACPolicy.NONE or n in kept or not safe_to_recompute(n, written):
            continue
        kind = collective_kind(n)
        allowed = RECOMPUTED_COLLECTIVES[policy[n]]
        if kind is not None:
            # Recomputed only with its wait, and only when nothing but waits reads it.
            if kind in allowed and n.users and all(is_wait(u) for u in n.users):
                ok.add(n)
            continue
        if is_wait(n):
            if n.all_input_nodes and n.all_input_nodes[0] in ok:
                ok.add(n)
            continue
        if is_getitem(n) and n.args[0] not in ok:
            continue  # the tuple is kept, so is its element
        ok.add(n)
    return ok


def recompute_plan(gm: fx.GraphModule, policy: AnyPolicy | str) -> RematPlan:
    """Which forward nodes ``policy`` (one, or one per layer) recomputes in the backward of
    ``gm``, and what the backward still reads from the forward afterwards."""
    policy = simplify_policy(policy) if isinstance(policy, LayerPolicies) else parse_policy(policy)
    plan = RematPlan(policy)
    regions = _regions(gm)
    if regions is None:
        plan.reason = "the graph has no backward (not a training step)"
        return plan
    plan.start = regions.start
    fset = regions.forward_set
    readers = regions.readers()
    if policy is ACPolicy.NONE:
        plan.saved = _saved(regions, set(), fset)
        plan.reason = "policy none"
        return plan
    exit_node = next(a for a in regions.start.all_input_nodes if a in regions.fwd and is_scalar(a))
    spine_nodes = spine(regions.forward, exit_node, input_placeholders(gm))
    per_node = _policy_of(policy, regions.forward, spine_nodes)
    by_policy = {p: _kept_by_policy(p, regions.forward, spine_nodes) for p in set(per_node.values())}
    kept = {n for n in regions.forward if n in by_policy[per_node[n]]}
    ok = _recomputable(per_node, regions.forward, kept, written_values(gm.graph))
    plan.selective_kept = {n for n in kept if per_node[n] is ACPolicy.SELECTIVE}
    # The copies: every recomputable forward value a backward reader needs, and (recursively)
    # its recomputable inputs.
    need = input_closure(readers, ok)
    plan.recompute = [n for n in regions.forward if n in need]
    plan.kept = kept
    plan.saved = _saved(regions, need, fset)
    if not plan.recompute:
        plan.reason = "no forward value the backward reads is safe to recompute under this policy"
    return plan


def _saved(regions: _Regions, recomputed: set[fx.Node], fset: set[fx.Node]) -> list[fx.Node]:
    """Forward values read across the boundary once ``recomputed`` are copied: what the backward
    reads directly, and what the copies read (their kept inputs)."""
    saved: set[fx.Node] = set()
    for r in regions.backward:
        rewritten = r not in regions.fwd
        for a in r.all_input_nodes:
            if a in fset and not (rewritten and a in recomputed):
                saved.add(a)
    for n in recomputed:
        saved.update(a for a in n.all_input_nodes if a not in recomputed)
    return [n for n in regions.forward
            if n in saved and n.op not in ("placeholder", "get_attr") and has_tensor_value(n)]


def recomputed_from(node: fx.Node) -> str | None:
    """The forward node a copy made by this pass recomputes (None for any other node)."""
    return node.meta.get(RECOMPUTED_FROM)


def saved_bytes(gm: fx.GraphModule, nodes: Iterable[fx.Node]) -> int:
    """Bytes the values of ``nodes`` keep alive (from their ``meta["val"]``): each allocation
    once, however many views of it are listed; views of placeholders and constants (a
    parameter's transpose) count 0, they live for the whole step anyway."""
    roots = {alias_root(n) for n in nodes}
    total = 0
    for r in roots:
        if r.op in ("placeholder", "get_attr"):
            continue
        v = r.meta.get("val")
        for t in v if isinstance(v, (tuple, list)) else (v,):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


# ---------------------------------------------------------------------------------------------
# The rewrite.
# ---------------------------------------------------------------------------------------------


def _copy_chain(graph: fx.Graph, value: fx.Node, before: fx.Node, recompute: set[fx.Node],
                copies: dict[fx.Node, fx.Node]) -> fx.Node:
    """The copy of ``value`` (made with its missing inputs' copies just before ``before``)."""
    if value in copies:
        return copies[value]
    # Iterative post-order: chains through a block can be longer than Python's recursion limit.
    stack: list[tuple[fx.Node, bool]] = [(value, False)]
    while stack:
        n, ready = stack.pop()
        if n in copies:
            continue
        if not ready:
            stack.append((n, True))
            stack.extend((a, False) for a in n.all_input_nodes if a in recompute and a not in copies)
            continue
        with graph.inserting_before(before):
            c = graph.node_copy(n, lambda a: copies.get(a, a))
        c.meta = dict(n.meta)  # val, seq_nr, stack_trace...: the copy computes the same value
        c.meta[RECOMPUTED_FROM] = n.name
        copies[n] = c
    return copies[value]


def rewrite(gm: fx.GraphModule, plan: RematPlan) -> int:
    """Make every backward reader of a recomputed value read its copy; returns copies made."""
    if not plan.recompute or plan.start is None:
        return 0
    regions = _regions(gm)
    if regions is None or regions.start is not plan.start:
        raise ValueError("the remat plan was made for another graph")
    recompute = set(plan.recompute)
    copies: dict[fx.Node, fx.Node] = {}
    for reader in regions.readers():
        for a in list(reader.all_input_nodes):
            if a in recompute:
                reader.replace_input_with(a, _copy_chain(gm.graph, a, reader, recompute, copies))
    return len(copies)


def apply(gm: fx.GraphModule, policy: AnyPolicy | str = "full") -> int:
    """Recompute forward values in the backward per ``policy`` (one, or one per layer); returns
    the nodes copied."""
    plan = recompute_plan(gm, policy)
    if not plan.recompute:
        log.debug("remat: nothing to do (%s)", plan.reason)
        return 0
    n = rewrite(gm, plan)
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    return n
