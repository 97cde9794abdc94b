"""Graphs with explicit collectives for the sequence-parallel tests, and ways to run them.

``run_spmd`` executes one SPMD graph for every rank in lockstep in this process (collectives are
computed from all ranks' values), so rewrites are checked numerically without processes; the
slow tests run the same graphs on real gloo groups.

``tp_llama_forward`` is a hand-written Megatron-style tensor-parallel LLaMA forward (vocab-parallel
embedding, column-parallel q/k/v and w1/w3, row-parallel wo and w2 each followed by an explicit
all_reduce) over the weights of ``shardwise.models.llama`` or a transformers Llama.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx

import shardwise.ir.ops  # noqa: F401
from shardwise.models.llama import rope_tables, rotate_half

c10d = torch.ops._c10d_functional
sw = torch.ops.shardwise
EPS = 1e-5


def all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    return c10d.wait_tensor(c10d.all_reduce(x, "sum", group))


def all_gather0(x: torch.Tensor, parts: int, group: str) -> torch.Tensor:
    return c10d.wait_tensor(c10d.all_gather_into_tensor(x, parts, group))


def world_group() -> str:
    return dist.group.WORLD.group_name


def trace(fn: Callable, *args: torch.Tensor) -> fx.GraphModule:
    """``make_fx`` on fake tensors (the process group must be initialised, fake or real)."""
    return make_fx(fn, tracing_mode="fake")(*args)


def count(gm: fx.GraphModule, target: object) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is target)


# --- running an SPMD graph for every rank in one process ------------------------------------

def _collective(node: fx.Node, per_rank: list[tuple], ranks: int) -> list:
    t = node.target
    xs = [a[0] for a in per_rank]
    if t is c10d.wait_tensor.default:
        return xs
    if t is c10d.all_reduce.default:
        assert node.args[1] == "sum"
        total = sum(xs[1:], xs[0].clone())
        return [total.clone() for _ in range(ranks)]
    if t is c10d.reduce_scatter_tensor.default:
        assert node.args[1] == "sum" and node.args[2] == ranks
        total = sum(xs[1:], xs[0].clone())
        return [c.clone() for c in total.chunk(ranks, 0)]
    if t is c10d.all_gather_into_tensor.default:
        assert node.args[1] == ranks
        full = torch.cat(xs, 0)
        return [full.clone() for _ in range(ranks)]
    raise NotImplementedError(node.format_node())


def run_spmd(gm: fx.GraphModule | list[fx.GraphModule], per_rank_inputs: list[list[torch.Tensor]]) -> list:
    """Run ``gm`` (or one graph per rank, node for node alike) on every rank's inputs; collectives
    combine the ranks (sums in rank order). Returns each rank's output."""
    ranks = len(per_rank_inputs)
    gms = gm if isinstance(gm, list) else [gm] * ranks
    env: list[dict[fx.Node, object]] = [{} for _ in range(ranks)]
    placeholders = iter(range(len(per_rank_inputs[0])))
    for nodes in zip(*(g.graph.nodes for g in gms), strict=True):
        node = nodes[0]
        if node.op == "placeholder":
            i = next(placeholders)
            for r in range(ranks):
                env[r][nodes[r]] = per_rank_inputs[r][i]
            continue
        args = [fx.node.map_arg((nodes[r].args, nodes[r].kwargs), lambda a, r=r: env[r][a])
                for r in range(ranks)]
        if node.op == "output":
            return [a[0][0] for a in args]
        if str(node.target).startswith("_c10d_functional."):
            outs = _collective(node, [a[0] for a in args], ranks)
        else:
            outs = [nodes[r].target(*args[r][0], **args[r][1]) for r in range(ranks)]
        for r in range(ranks):
            env[r][nodes[r]] = outs[r]
    raise AssertionError("graph has no output")


def max_rel_err(a, b) -> float:
    """Largest |a - b| relative to the largest |a| over (possibly nested) outputs."""
    fa = [t for t in torch.utils._pytree.tree_leaves(a) if isinstance(t, torch.Tensor)]
    fb = [t for t in torch.utils._pytree.tree_leaves(b) if isinstance(t, torch.Tensor)]
    assert len(fa) == len(fb) and all(x.shape == y.shape for x, y in zip(fa, fb, strict=True))
    pairs = zip(fa, fb, strict=True)
    return max(((x - y).abs().max() / x.abs().max().clamp_min(1e-30)).item() for x, y in pairs)


# --- small hand-built graphs, one per rule ----------------------------------------------------

def spmd_inputs(fn: Callable, shapes: list[tuple[int, ...]], ranks: int,
                seed: int = 0) -> list[list[torch.Tensor]]:
    """Per-rank random inputs for ``fn``: parameters named ``p*`` are partial sums (different on
    every rank), the others (weights) are replicated (equal on every rank)."""
    import inspect

    names = list(inspect.signature(fn).parameters)
    g = torch.Generator().manual_seed(seed)
    shared = [torch.randn(s, generator=g) for s in shapes]
    return [[torch.randn(s, generator=g) if name.startswith("p") else t
             for name, s, t in zip(names, shapes, shared, strict=True)] for _ in range(ranks)]


def p1_fn(group: str):
    def f(p, w):
        return sw.rms_norm(all_reduce(p, group), w, EPS) * 2.0
    return f


def p1_view_fn(group: str, full: tuple[int, ...]):
    """all_reduce on a flat [tokens, H] value, norm on its [B, S, H] (or [1, S, H]) view."""
    def f(p, w):
        return sw.rms_norm(all_reduce(p, group).view(full).detach(), w, EPS) + 1.0
    return f


def chain_fn(group: str, layers: int, norm_shape: tuple[int, ...] | None = None):
    """P1 on the first all_reduce, then per layer two P2 (attention-like, mlp-like), and a P3
    (add_rms_norm) at the end; each partial sum depends on the previous normed value.
    ``norm_shape`` views every all_reduce before its norm (2-D all_reduces, 3-D norms)."""
    def f(p0, w, m):
        def v(t):
            return t if norm_shape is None else t.view(norm_shape)

        h = all_reduce(p0, group)
        normed = sw.rms_norm(v(h), w, EPS)
        h = v(h)
        for i in range(2 * layers):
            part = (normed.reshape(p0.shape) @ m) * (i + 1)
            normed, h = sw.add_rms_norm2(v(all_reduce(part, group)), h, w, EPS)
        part = normed.reshape(p0.shape) @ m
        return sw.add_rms_norm(v(all_reduce(part, group)), h, w, EPS)
    return f


def p3_add_fn(group: str):
    """P2 leaves the residual local; a plain add -> clone -> rms_norm (P3, unfused) reads it."""
    def f(p0, p1, p2, w):
        h = all_reduce(p0, group)
        normed = sw.rms_norm(h, w, EPS)
        normed, h = sw.add_rms_norm2(all_reduce(p1 + normed, group), h, w, EPS)
        s = h + all_reduce(p2 * normed, group)
        return sw.rms_norm(s.clone(), w, EPS)
    return f


def mixed_2d3d_fn(group: str, batch: int, seq: int):
    """A residual stream kept 2-D ([S, H], batch 1 dropped) meets a norm on [1, S, H]: the
    residual slice is repaired with a view."""
    def f(p0, p1, w):
        h2 = all_reduce(p0, group)  # [S, H]
        normed = sw.rms_norm(h2, w, EPS)
        normed, s2 = sw.add_rms_norm2(all_reduce(p1 * normed, group), h2, w, EPS)
        x3 = all_reduce(p1 * normed, group).view(batch, seq, -1)
        return sw.add_rms_norm(x3, s2.view(batch, seq, -1), w, EPS)
    return f


# --- a hand-written tensor-parallel LLaMA ----------------------------------------------------

@dataclass(frozen=True)
class TPConfig:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab: int
    eps: float
    theta: float


# Weight names per source: (embedding, layer prefix, q, k, v, o, w1 (gate), w2 (down), w3 (up),
# attention norm, ffn norm, final norm, output).
LLAMA_NAMES = ("tok_embeddings.weight", "layers.{i}.", "attention.wq.weight", "attention.wk.weight",
               "attention.wv.weight", "attention.wo.weight", "feed_forward.w1.weight",
               "feed_forward.w2.weight", "feed_forward.w3.weight", "attention_norm.weight",
               "ffn_norm.weight", "norm.weight", "output.weight")
HF_NAMES = ("model.embed_tokens.weight", "model.layers.{i}.", "self_attn.q_proj.weight",
            "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
            "mlp.gate_proj.weight", "mlp.down_proj.weight", "mlp.up_proj.weight",
            "input_layernorm.weight", "post_attention_layernorm.weight", "model.norm.weight",
            "lm_head.weight")


def _heads_of(cfg: TPConfig, rank: int, tp: int) -> list[int] | None:
    """The query heads rank ``rank`` computes; None when heads do not split (attention then runs
    whole on every rank and wo is split on its input features)."""
    if cfg.n_heads % tp:
        return None
    per = cfg.n_heads // tp
    return list(range(rank * per, (rank + 1) * per))


def shard_weights(full: dict[str, torch.Tensor], names: tuple[str, ...], cfg: TPConfig,
                  rank: int, tp: int) -> list[torch.Tensor]:
    """This rank's weights in the order ``tp_llama_forward`` takes them."""
    emb, pre, q, k, v, o, w1, w2, w3, an, fn, norm, out = names
    hd = cfg.dim // cfg.n_heads
    rep = cfg.n_heads // cfg.n_kv_heads
    vocab_rows = slice(rank * cfg.vocab // tp, (rank + 1) * cfg.vocab // tp)
    ffn = slice(rank * cfg.ffn_dim // tp, (rank + 1) * cfg.ffn_dim // tp)
    heads = _heads_of(cfg, rank, tp)
    ws = [full[emb][vocab_rows]]
    for i in range(cfg.n_layers):
        p = pre.format(i=i)
        if heads is None:
            qw, kw, vw = full[p + q], full[p + k], full[p + v]
            cols = slice(rank * cfg.dim // tp, (rank + 1) * cfg.dim // tp)
            ow = full[p + o][:, cols]
        else:
            kv = [h // rep for h in heads]
            rows_q = torch.cat([torch.arange(h * hd, (h + 1) * hd) for h in heads])
            rows_kv = torch.cat([torch.arange(h * hd, (h + 1) * hd) for h in kv])
            qw, kw, vw = full[p + q][rows_q], full[p + k][rows_kv], full[p + v][rows_kv]
            ow = full[p + o][:, rows_q]
        ws += [full[p + an], qw, kw, vw, ow, full[p + fn], full[p + w1][ffn], full[p + w3][ffn],
               full[p + w2][:, ffn]]
    return ws + [full[norm], full[out]]


def tp_llama_forward(cfg: TPConfig, rank: int, tp: int, group: str, norm: Callable):
    """The per-rank forward ``f(tokens, *weights) -> logits`` (weights from ``shard_weights``);
    ``norm(x, weight, eps)`` is the RMSNorm as the source model writes it."""
    hd = cfg.dim // cfg.n_heads
    heads = _heads_of(cfg, rank, tp)
    lo, hi = rank * cfg.vocab // tp, (rank + 1) * cfg.vocab // tp

    def f(tokens, *ws):
        b, s = tokens.shape
        mine = (tokens >= lo) & (tokens < hi)
        local = torch.where(mine, tokens - lo, torch.zeros_like(tokens))
        h = all_reduce(F.embedding(local, ws[0]) * mine.unsqueeze(-1).to(ws[0].dtype), group)
        cos, sin = rope_tables(s, hd, cfg.theta, h.dtype, h.device)
        nq = cfg.n_heads if heads is None else len(heads)
        for i in range(cfg.n_layers):
            an, wq, wk, wv, wo, fn, w1, w3, w2 = ws[1 + 9 * i: 10 + 9 * i]
            x = norm(h, an, cfg.eps)
            q = (x @ wq.t()).view(b, s, nq, hd).transpose(1, 2)
            k = (x @ wk.t()).view(b, s, -1, hd).transpose(1, 2)
            vv = (x @ wv.t()).view(b, s, -1, hd).transpose(1, 2)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            rep = nq // k.shape[1] if heads is None else 1
            if rep > 1:
                k, vv = k.repeat_interleave(rep, 1), vv.repeat_interleave(rep, 1)
            o = F.scaled_dot_product_attention(q, k, vv, is_causal=True).transpose(1, 2).reshape(b, s, -1)
            if heads is None:
                o = o[..., rank * cfg.dim // tp:(rank + 1) * cfg.dim // tp]
            h = h + all_reduce(o @ wo.t(), group)
            x = norm(h, fn, cfg.eps)
            h = h + all_reduce((F.silu(x @ w1.t()) * (x @ w3.t())) @ w2.t(), group)
        return norm(h, ws[-2], cfg.eps) @ ws[-1].t()
    return f


def llama_norm(x, w, eps):
    """``shardwise.models.llama.RMSNorm.forward`` written out."""
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)


def hf_norm(x, w, eps):
    """transformers ``LlamaRMSNorm`` run with ``w`` as its weight."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    mod = LlamaRMSNorm(w.shape[0], eps)
    return torch.func.functional_call(mod, {"weight": w}, (x,))


def count_norm_fed_all_reduces(gm: fx.GraphModule) -> int:
    """all_reduces whose value reaches a norm op through reshapes or a residual add."""
    from shardwise.ir.match import source_through_reshapes

    norms = (sw.rms_norm.default, sw.add_rms_norm.default, sw.add_rms_norm2.default)
    n = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not c10d.all_reduce.default:
            continue
        wait = next(iter(node.users))
        frontier = list(wait.users)
        seen = set()
        while frontier:
            u = frontier.pop()
            if u in seen:
                continue
            seen.add(u)
            if u.op == "call_function" and u.target in norms:
                n += 1
                break
            if u.op == "call_function" and (u.target is torch.ops.aten.add.Tensor
                                            or source_through_reshapes(u)[1]):
                frontier.extend(u.users)
    return n

