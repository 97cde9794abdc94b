"""Built-in models and the ``hf:`` adapter behind one name-based entry point.

``get_model(name, layers=..., batch=..., seq=..., dtype=...)`` returns a ``ModelSpec``: how to
build the module (under whatever mode the caller is in: fake for tracing, real for running) and
how to make example inputs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from shardwise.errors import UserError
from shardwise.models.llama import CONFIGS, Llama

DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
HF_PREFIX = "hf:"


@dataclass(frozen=True)
class ModelSpec:
    name: str
    build: Callable[[], nn.Module]
    batch: int
    seq: int
    vocab_size: int
    dtype: torch.dtype
    n_layers: int
    width: int  # the residual stream's size (hidden_size, Llama's dim)

    def example_inputs(self, train: bool, seed: int = 0) -> tuple[torch.Tensor, ...]:
        """Token ids (and labels when training); random but reproducible from ``seed``."""
        g = torch.Generator().manual_seed(seed)
        shape = (self.batch, self.seq)
        tokens = torch.randint(0, self.vocab_size, shape, generator=g)
        if not train:
            return (tokens,)
        return tokens, torch.randint(0, self.vocab_size, shape, generator=g)

    def build_module(self) -> nn.Module:
        """Build the module with parameters created directly in ``dtype`` (no copy)."""
        old = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            return self.build()
        finally:
            torch.set_default_dtype(old)


def known_models() -> list[str]:
    return sorted(CONFIGS) + ["hf:path/to/config.json"]


def parse_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    if name is None or isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise UserError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}.")
    return DTYPES[name]


def get_model(
    name: str,
    *,
    layers: int | None = None,
    batch: int | None = None,
    seq: int | None = None,
    dtype: str | torch.dtype | None = None,
) -> ModelSpec:
    for what, v in (("layers", layers), ("batch", batch), ("seq", seq)):
        if v is not None and v <= 0:
            raise UserError(f"--{what} must be a positive integer, got {v}.")
    dt = parse_dtype(dtype)
    if name.startswith(HF_PREFIX):
        from shardwise.models.hf import build_hf, load_config

        cfg = load_config(name[len(HF_PREFIX):], layers=layers)
        dt = dt or torch.float32
        return ModelSpec(
            name=name, build=lambda: build_hf(cfg, dt), batch=batch or 2, seq=seq or 16,
            vocab_size=cfg.vocab_size, dtype=dt, n_layers=cfg.num_hidden_layers, width=cfg.hidden_size,
        )
    if name not in CONFIGS:
        raise UserError(f"unknown model {name!r}; known models: {', '.join(known_models())}.")
    cfg = CONFIGS[name].with_overrides(n_layers=layers, batch=batch, seq=seq, dtype=dt)
    return ModelSpec(
        name=name, build=lambda: Llama(cfg), batch=cfg.batch, seq=cfg.seq,
        vocab_size=cfg.vocab_size, dtype=cfg.dtype, n_layers=cfg.n_layers, width=cfg.dim,
    )
