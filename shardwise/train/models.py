"""Building models for training without holding their weights: parameters on meta, buffers real."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """Build modules whose parameters go to the meta device as they are registered (their init
    then runs on meta: no memory, no time) while buffers (rotary tables...) keep real values:
    what ``parallelize`` needs to shard a model that no rank could hold whole."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def build_model(name: str, *, layers: int | None = None, batch: int | None = None, seq: int | None = None,
                dtype: str | torch.dtype | None = None, meta: bool = True):
    """``(module, spec)``: a built-in or ``hf:`` model by name (see ``shardwise.models.get_model``),
    its parameters on meta (buffers real) unless ``meta=False``."""
    from shardwise.models import get_model

    spec = get_model(name, layers=layers, batch=batch, seq=seq, dtype=dtype)
    if not meta:
        return spec.build_module(), spec
    with params_on_meta():
        return spec.build_module(), spec


def meta_inputs(spec) -> list[torch.Tensor]:
    """A training step's example inputs for ``spec`` (a ``ModelSpec``) as meta tensors: the
    shapes ``parallelize`` traces, without data."""
    return [torch.empty(x.shape, dtype=x.dtype, device="meta") for x in spec.example_inputs(True)]
