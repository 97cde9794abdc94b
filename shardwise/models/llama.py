"""A LLaMA-style decoder family with named configurations.

The model is written the way PyTorch users write it (``nn.Linear`` projections, a decomposed
RMSNorm, rotary embeddings computed in ``forward`` from ``arange``, SDPA attention with grouped
KV heads, SwiGLU MLP), so the traced graph shows the patterns the canonicalisation passes must
recognise in real code.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LlamaConfig:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    # Default example shapes used when a caller does not give --batch / --seq.
    batch: int = 1
    seq: int = 2048
    dtype: torch.dtype = torch.bfloat16

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def with_overrides(self, **overrides: object) -> LlamaConfig:
        return dataclasses.replace(self, **{k: v for k, v in overrides.items() if v is not None})


# Published LLaMA 3 shapes (Meta model cards); tiny is small enough to run in unit tests.
CONFIGS: dict[str, LlamaConfig] = {
    "llama-tiny": LlamaConfig(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=256,
        rope_theta=10000.0, batch=4, seq=16, dtype=torch.float32,
    ),
    # Big enough that arithmetic, not per-op overhead, dominates a CPU training step (a few
    # hundred ms on one core), small enough to train in seconds: for CPU benchmarks and demos.
    "llama-small": LlamaConfig(
        dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=704, vocab_size=2048,
        rope_theta=10000.0, batch=8, seq=256, dtype=torch.float32,
    ),
    "llama3-8b": LlamaConfig(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128256,
        batch=16, seq=8192,
    ),
    "llama3-70b": LlamaConfig(
        dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672, vocab_size=128256,
        batch=16, seq=4096,
    ),
    "llama3-405b": LlamaConfig(
        dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim=53248, vocab_size=128256,
        batch=16, seq=4096,
    ),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Written out (not F.rms_norm) so the graph holds the decomposed form users write.
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.type_as(x)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_tables(seq: int, head_dim: int, theta: float, dtype: torch.dtype, device: torch.device):
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    pos = torch.arange(seq, device=device).float()
    freqs = torch.outer(pos, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        hd = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * hd, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=False)
        self.wo = nn.Linear(cfg.n_heads * hd, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        b, s, _ = x.shape
        hd = cfg.head_dim
        q = self.wq(x).view(b, s, cfg.n_heads, hd).transpose(1, 2)
        k = self.wk(x).view(b, s, cfg.n_kv_heads, hd).transpose(1, 2)
        v = self.wv(x).view(b, s, cfg.n_kv_heads, hd).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        rep = cfg.n_heads // cfg.n_kv_heads
        if rep > 1:
            k = k[:, :, None].expand(b, cfg.n_kv_heads, rep, s, hd).reshape(b, cfg.n_heads, s, hd)
            v = v[:, :, None].expand(b, cfg.n_kv_heads, rep, s, hd).reshape(b, cfg.n_heads, s, hd)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, cfg.n_heads * hd))


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """``forward(tokens)`` gives logits; ``forward(tokens, labels)`` gives the mean token loss."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        cfg = self.cfg
        h = self.tok_embeddings(tokens)
        cos, sin = rope_tables(tokens.shape[1], cfg.head_dim, cfg.rope_theta, h.dtype, h.device)
        for layer in self.layers:
            h = layer(h, cos, sin)
        logits = self.output(self.norm(h))
        if labels is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))
