"""Buffers traced as fake graph constants get their module's real values."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from shardwise.errors import UserError
from shardwise.ir.trace import trace
from shardwise.runtime.launch import real_constants


class TwoMasks(nn.Module):
    """Two buffers of one shape and dtype with different values (as GPT-Neo's global and local
    attention masks), each read by its own op."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("full", torch.ones(4, 4))
        self.register_buffer("window", torch.tril(torch.ones(4, 4)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.full + 2 * x * self.window).sum()


def test_each_constant_gets_the_buffer_it_was_traced_from():
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = TwoMasks()
        traced = trace(fake, torch.randn(4, 4), train=False, fake_mode=mode)
    assert sorted(traced.constant_buffers.values()) == ["full", "window"]
    real = TwoMasks()
    values = real_constants(traced.gm, real, traced)
    assert {traced.constant_buffers[k]: v.tolist() for k, v in values.items()} == {
        "full": real.full.tolist(), "window": real.window.tolist()}
    # By shape and dtype alone the two are ambiguous: refused, not guessed.
    with pytest.raises(UserError, match="matches 2 different buffers"):
        real_constants(traced.gm, real)
