"""The hand-written plans people use, as constraints on the same ILP.

A baseline fixes what its authors fix — where each parameter lives, that every value carrying
the batch stays split over the data-parallel dims (each rank works on its own sequences), and
(for the tensor-parallel ones) whether the residual stream around the norms is replicated or
sharded on the sequence — and the ILP completes the rest at least cost, so a baseline is priced
by the same cost model as the auto plan and lowered by the same code:

- ``ddp``: every parameter replicated; the batch split over every mesh dim.
- ``fsdp``: every parameter sharded on dim 0 over every mesh dim; the batch split likewise.
- ``fsdp_tp``: on ``tp`` Megatron column-parallel (wq/wk/wv/w1/w3, the output head: Shard(0) of
  the ``[out, in]`` weight), row-parallel (wo/w2: Shard(1)), and the same roles under each
  family's own module names (``COLUMN``, ``ROW``), the embedding split over the vocabulary,
  norms replicated, the residual stream and the norms' outputs replicated, every tp-sharded
  weight read sharded; on the other dims FSDP (Shard(0); Shard(1) for a weight tp
  splits on dim 0, the bytes of FSDP2's strided shard: ``_fsdp_of_tp_shard``) with the batch split.
- ``fsdp_tp_sp``: ``fsdp_tp`` with the residual stream and the norms' outputs sharded on the
  sequence dim over ``tp`` (so row-parallel outputs are reduce-scattered into it and
  column-parallel inputs all-gathered from it).

A baseline that cannot be expressed on the mesh (no ``tp`` dim, a batch the data-parallel dims
do not divide, a weight ``tp`` does not divide) is ``None``.

What each rule reproduces of torchtitan (``torchtitan/models/llama3/infra/parallelize.py``):

- the data-parallel batch rule, the flattened tokens included, and the loss as a pending
  average (``LOSS_OPS``): each rank computes its own tokens' logits and loss, as FSDP/DDP do;
- ``fsdp``'s Shard(0) parameters: ``fully_shard`` (FSDP2 shards dim 0); its
  ``reshard_after_forward`` (gathered again in the backward), the one-layer prefetch and the
  mixed precision (bf16 compute, fp32 master weights and gradients, ``reduce_dtype=float32``
  reduce-scatters) are how ``cost/schedule.py`` runs the plan (``cost/step.torchtitan_options``);
- ``fsdp_tp_sp``'s tensor parallelism: ``ColwiseParallel`` wq/wk/wv/w1/w3, ``RowwiseParallel``
  wo/w2 with a sequence-sharded output (reduce_scatter), ``SequenceParallel`` norms, the
  embedding ``RowwiseParallel`` with a sequence-sharded output, the output head
  ``ColwiseParallel`` (vocabulary-sharded logits).
- Not reproduced: ``loss_parallel`` (the vocabulary-parallel cross entropy). DTensor's sharding
  rules have no vocabulary-sharded ``log_softmax``, so the logits are redistributed to be
  token-sharded for the loss (an all_to_all); no rank holds the full logits either way.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import fx
from torch.distributed.tensor import Partial, Replicate, Shard

from shardwise.ir.flops import is_view
from shardwise.ir.match import arg_node, cast_dtype, is_op, mul_other, through_casts
from shardwise.ir.trace import Phase, Traced
from shardwise.mesh import Mesh
from shardwise.plan.placement import Placements, on_mesh, placements_str
from shardwise.plan.plan import tensor_args
from shardwise.plan.strategies import divides_evenly, flat_tensor_vals

BASELINES = ("ddp", "fsdp", "fsdp_tp", "fsdp_tp_sp")
TP = "tp"
aten = torch.ops.aten

# Megatron roles by the name of the module a parameter belongs to (built-in llama; HF Llama,
# Mistral, Qwen2, Gemma, Phi-3's fused qkv_proj and gate_up_proj; GPT-2, GPT-Neo, GPT-BigCode and
# StarCoder2's c_attn/c_fc/c_proj; Bloom, Falcon, GPT-NeoX and Persimmon's query_key_value,
# dense_h_to_4h, dense_4h_to_h and dense; Phi's fc1/fc2). Column-parallel splits a weight's output
# features (and its bias), row-parallel its input features; the dim each is stored on is read off
# the graph (``_in_dim``): Linear stores [out, in], GPT-2's Conv1D [in, out].
COLUMN = re.compile(r"(?:^|\.)(wq|wk|wv|w1|w3|q_proj|k_proj|v_proj|qkv_proj|query_key_value|c_attn|gate_proj|"
                    r"up_proj|gate_up_proj|c_fc|fc1|dense_h_to_4h|output|lm_head|embed_out)\.(weight|bias)$")
ROW = re.compile(r"(?:^|\.)(wo|w2|o_proj|out_proj|dense|down_proj|c_proj|fc2|dense_4h_to_h)\.weight$")
# Embedding tables are split over the vocabulary (torchtitan's RowwiseParallel embedding).
VOCAB = re.compile(r"(?:^|\.)(tok_embeddings|embed_tokens|wte|word_embeddings|embed_in)\.weight$")
# The ops that multiply by a weight: a Linear's reads it through a transpose, a Conv1D's as stored.
_MATMUL_OPS = (aten.einsum.default, aten.mm.default, aten.addmm.default, aten.matmul.default)

# The loss: data parallelism (torchtitan's, any framework's) computes it on each rank's tokens
# and averages it, a pending average over the data-parallel dims.
LOSS_OPS = frozenset({aten.nll_loss_forward.default})
# The ops a decomposed RMSNorm ends in: their outputs are "the norm's output".
_NORM_OPS = (aten.rsqrt,)
# A LayerNorm applies its weight and bias inside the op: its (first) output is what projections read.
_LAYER_NORM_OPS = (aten.native_layer_norm.default,)


@dataclass(frozen=True)
class BaselineSpec:
    """Fixed placements: node name -> allowed output placements (a set)."""

    name: str
    fixed: dict[str, Placements]
    norm_layout: Placements | None = None  # the tensor-parallel ones: at the norms' boundaries
    # Data parallelism: every value that carries the batch (dim 0) is split on these mesh dims.
    dp_dims: tuple[int, ...] = ()
    batch_nodes: frozenset[str] = frozenset()


def _tp_role(param: str, ndim: int, in_dim: int) -> Placements:
    """Where tensor parallelism splits parameter ``param`` (``ndim`` dims; a 2-D weight's input
    features on ``in_dim``, ``_in_dim``): column-parallel its output features, row-parallel its
    input features, an embedding its vocabulary, anything else replicated."""
    if VOCAB.search(param):
        return (Shard(0),)
    if COLUMN.search(param):
        return (Shard(1 - in_dim if ndim == 2 else 0),)
    if ROW.search(param) and ndim == 2:
        return (Shard(in_dim),)
    return (Replicate(),)


def _in_dim(traced: Traced, placeholder: str) -> int:
    """The dim of a 2-D weight that holds its input features: 0 where a forward matmul reads it
    as stored (GPT-2's Conv1D, ``[in, out]``), else 1 (a Linear's ``[out, in]``, read through a
    transpose; and any parameter no matmul reads)."""
    node = traced.node(placeholder)
    as_stored = any(is_op(u, *_MATMUL_OPS) and traced.phase(u) is Phase.FORWARD for u in node.users)
    return 0 if as_stored else 1


def _fsdp_of_tp_shard(ps: Placements, dp_dims: list[int], shape: tuple[int, ...],
                      mesh_shape: tuple[int, ...]) -> Placements:
    """FSDP2 over a weight that tensor parallelism splits on dim 0 splits the tp shard's dim 0
    again (``_StridedShard(0, split_factor=tp)`` over dp): its all_gather over dp moves one tp
    shard, 1/tp of the weight. DTensor's ``(Shard(0), Shard(0))`` nests the dp split outside the
    tp split instead, and a gather over dp undoes the tp split first: it moves the whole weight
    (llama3-70b over 8x8: 9.8 ms a gather of w1 instead of 1.3 ms; the fsdp_tp step 5.46 s
    instead of 1.83 s). ``Shard(1)`` over dp gathers the same bytes into the same gathered
    layout, ``(Replicate(), Shard(0))``, and reduce-scatters the same bytes of its gradient;
    only which elements a rank stores differs. Where dim 1 does not divide, ``ps`` as it is."""
    strided = on_mesh(tuple(Shard(1) if i in dp_dims else p for i, p in enumerate(ps)), mesh_shape)
    return strided if divides_evenly(strided, shape, mesh_shape) else ps


def baseline_spec(name: str, traced: Traced, mesh: Mesh) -> BaselineSpec | None:
    """The fixed placements of baseline ``name`` on ``mesh``, or None when it does not apply."""
    spec = _spec_or_refusal(name, traced, mesh)
    return spec if isinstance(spec, BaselineSpec) else None


def baseline_refusal(name: str, traced: Traced, mesh: Mesh) -> str | None:
    """Why baseline ``name`` does not apply on ``mesh`` (a clause: "it needs ..."), or None."""
    spec = _spec_or_refusal(name, traced, mesh)
    return spec if isinstance(spec, str) else None


def _spec_or_refusal(name: str, traced: Traced, mesh: Mesh) -> BaselineSpec | str:
    tp = mesh.dim(TP)
    uses_tp = name in ("fsdp_tp", "fsdp_tp_sp")
    if uses_tp and tp is None:
        return "it needs a mesh dim named tp"
    dp_dims = [i for i in range(mesh.ndim) if not (uses_tp and i == tp)]
    fixed: dict[str, Placements] = {}
    for pname, ph in traced.params.items():
        val = traced.node(ph).meta["val"]
        per_dim: list = [None] * mesh.ndim
        for d in dp_dims:
            per_dim[d] = Replicate() if name == "ddp" else Shard(0)
        if uses_tp:
            per_dim[tp] = _tp_role(pname, val.dim(), _in_dim(traced, ph))[0]
        ps = on_mesh(tuple(per_dim), mesh.shape)
        if uses_tp and per_dim[tp] == Shard(0) and val.dim() == 2:
            ps = _fsdp_of_tp_shard(ps, dp_dims, tuple(val.shape), mesh.shape)
        if not divides_evenly(ps, tuple(val.shape), mesh.shape):
            if name == "ddp" or uses_tp and per_dim[tp] != Replicate():
                layout = ",".join(placements_str(ps))
                return f"it splits {pname} {list(val.shape)} as {layout}, which the mesh does not divide"
            # FSDP of a weight the mesh does not divide: keep that one replicated (as FSDP does
            # for small odd-shaped parameters by padding; we do not pad).
            ps = tuple(Replicate() if i in dp_dims else p for i, p in enumerate(ps))
        fixed[ph] = ps
    for inp in traced.inputs:
        val = traced.node(inp).meta["val"]
        ps = on_mesh(tuple(Shard(0) if i in dp_dims else Replicate() for i in range(mesh.ndim)), mesh.shape)
        if not divides_evenly(ps, tuple(val.shape), mesh.shape):
            return f"it splits the input {list(val.shape)} by its batch, which the mesh does not divide"
        fixed[inp] = ps
    norm_layout = None
    if uses_tp:
        norm_layout = on_mesh(tuple(Shard(1) if (i == tp and name == "fsdp_tp_sp")
                                    else (Shard(0) if i in dp_dims else Replicate())
                                    for i in range(mesh.ndim)), mesh.shape)
    dp = tuple(d for d in dp_dims if mesh.shape[d] > 1)
    return BaselineSpec(name, fixed, norm_layout, dp, batch_nodes(traced) if dp else frozenset())


def batch_nodes(traced: Traced) -> frozenset[str]:
    """Computed values that carry the batch: they depend on the inputs and their dim 0 is the
    batch or the flattened tokens (losses and weight gradients do not qualify; views follow
    whatever they view)."""
    if not traced.inputs:
        return frozenset()
    shape = traced.node(traced.inputs[0]).meta["val"].shape
    # The batch dim, or the batch and sequence flattened into tokens (the logits and the loss
    # read [tokens, vocab]): torchtitan's data parallelism keeps both split, so no rank ever
    # holds another rank's logits.
    batch = {shape[0], math.prod(shape[:2])} if len(shape) >= 2 else {shape[0]}
    reached = {traced.node(i) for i in traced.inputs}
    # A weight gradient (or its transpose) is no batch value, even when a weight dim happens to
    # equal the token count.
    weight_shapes = {s for ph in traced.params.values()
                     for t in [tuple(traced.node(ph).meta["val"].shape)] for s in (t, t[::-1])}
    out = set()
    for n in traced.gm.graph.nodes:
        if n.op != "call_function" or not any(a in reached for a in n.all_input_nodes):
            continue
        reached.add(n)
        val = n.meta.get("val")
        if (isinstance(val, torch.Tensor) and val.dim() >= 1 and val.shape[0] in batch and not is_view(n)
                and tuple(val.shape) not in weight_shapes):
            out.add(n.name)
    return frozenset(out)


def norm_nodes(traced: Traced) -> list[fx.Node]:
    """Forward nodes at the norms' boundaries: each norm's input (the residual stream), its
    normalised value (the multiply after ``rsqrt``, a shardwise norm op or a LayerNorm) and that
    value scaled by the norm's weight (what the projections read; a LayerNorm's own output)."""
    weights = set(traced.params.values())
    out = []
    for n in traced.gm.graph.nodes:
        if traced.phase(n) is not Phase.FORWARD or n.op != "call_function":
            continue
        rsqrt = next((a for a in n.all_input_nodes if is_op(a, *_NORM_OPS)), None)
        if (str(n.target).startswith("shardwise.") and "norm" in str(n.target)) or is_op(n, *_LAYER_NORM_OPS):
            out += [n, *[x for x in tensor_args(n)[:1] if is_op(x, aten.add)]]
        elif rsqrt is not None and (x := mul_other(n, rsqrt)) is not None:
            if is_op(x, aten.sub.Tensor) and is_op(arg_node(x, 1), aten.mean.dim):
                x = arg_node(x)  # a LayerNorm written out (Cohere's): (x - mean) * rsqrt(var + eps)
            x = through_casts(x)  # HF norms upcast their input ...
            # ... and cast back to the model's dtype before the weight multiply (or the weight up).
            heads = [n, *(u for u in n.users if cast_dtype(u) is not None)]
            scaled = [u for h in heads for u in h.users if traced.phase(u) is Phase.FORWARD
                      and getattr(through_casts(mul_other(u, h)), "name", None) in weights]
            # The residual stream where it is a sum (the embedding before the first norm keeps
            # its own placements: a vocabulary-parallel lookup yields partial sums).
            out += [x] if is_op(x, aten.add) else []
            out += [n, *scaled]
    return out


def node_filter(spec: BaselineSpec, traced: Traced) -> Callable[[fx.Node, Placements, bool], bool]:
    """A predicate on (node, output placements) implementing the baseline's fixed choices."""
    at_norms = {n.name for n in norm_nodes(traced)} if spec.norm_layout is not None else set()

    def allowed(node: fx.Node, ps: Placements, follower: bool) -> bool:
        """Followers (placed by their producer) are exempt from the batch rule: what they follow
        may not carry the batch in dim 0 (a flattened token axis, viewed back)."""
        want = spec.fixed.get(node.name)
        if want is not None:
            return ps == want
        if not follower and node.name in spec.batch_nodes and any(ps[d] != Shard(0) for d in spec.dp_dims):
            return False
        if node.target in LOSS_OPS and any(not isinstance(ps[d], Partial) for d in spec.dp_dims):
            return False  # each rank's loss over its own tokens, averaged (never gathered logits)
        if node.name in at_norms:
            val = flat_tensor_vals(node)[0]
            target = tuple(p if not (isinstance(p, Shard) and p.dim >= val.dim()) else Replicate()
                           for p in spec.norm_layout)
            return ps == target
        return True

    return allowed


def tensor_parallel_uses(spec: BaselineSpec, traced: Traced, ns: dict, mesh: Mesh, rep: dict) -> bool:
    """Megatron reads its tp-sharded weights sharded: keep only the strategies of each op that
    computes with such a weight (reached through followers such as ``t``) that read it in its
    stored tp placement. Returns False when some op has no such strategy (baseline inapplicable).
    """
    tp = mesh.dim(TP)
    for ph in spec.fixed:
        if ph not in traced.params.values() or isinstance(spec.fixed[ph][tp], Replicate):
            continue
        stack = [traced.node(ph)]
        while stack:
            u = stack.pop()
            placement = ns[rep[u]].strategies[0].output[0][tp] if ns[rep[u]].strategies else None
            for v in u.users:
                if v.op != "call_function":
                    continue
                st = ns[rep[v]]
                if st.follows is not None and len(st.strategies) == 1:
                    stack.append(v)  # a view of the weight: look at who computes with it
                    continue
                j = tensor_args(v).index(u)
                kept = [s for s in st.strategies if s.inputs[j][tp] == placement]
                if not kept:
                    return False
                if len(kept) < len(st.strategies):
                    st.strategies, st.follows = kept, None
    return True
