"""exchange_all_reduce: gloo all_reduces over 2^k ranks run as pairwise exchanges, with the
all_reduce's values and the same bits on every rank (real gloo ranks), and what it leaves alone."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_reduce
from torch.fx.experimental.proxy_tensor import make_fx

from shardwise.passes import exchange_all_reduce, inplace_all_reduce
from tests.helpers import spawn


def _step(x, w):
    # A functional all_reduce read later (its wait sinks below the matmul), a private buffer
    # reduced in place, a mean, and a max (left alone).
    s = all_reduce(x * 2.0, "sum", dist.group.WORLD)
    y = torch.mm(w, w)
    m = all_reduce(x, "avg", dist.group.WORLD)
    top = all_reduce(x, "max", dist.group.WORLD)
    return s + y.sum(), m, top


def _rank(rank: int, world: int) -> tuple[int, list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(rank)
    x, w = torch.randn(4096, generator=g), torch.randn(16, 16)
    gm = make_fx(_step)(x, w)
    want = gm(x, w)
    inplace_all_reduce.apply(gm)
    rewritten = exchange_all_reduce.apply(gm)
    got = gm(x, w)
    return rewritten, [t.clone() for t in got], [t.clone() for t in want]


@pytest.mark.parametrize("world", [2, 4])
def test_sums_and_means_are_exchanged_and_agree_on_every_rank(world):
    results = spawn(_rank, world)
    for rewritten, got, want in results:
        assert rewritten == 2  # the sum and the mean; the max keeps its collective
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-5)
    for _, got, _ in results[1:]:
        for a, b in zip(got, results[0][1], strict=True):
            assert torch.equal(a, b)  # the same bits everywhere: replicas stay in sync


def _refused(rank: int, world: int, backends: tuple[str, ...]) -> int:
    gm = make_fx(_step)(torch.randn(8), torch.randn(4, 4))
    return exchange_all_reduce.apply(gm, backends=backends)


@pytest.mark.parametrize(("world", "backends"), [(3, ("gloo",)), (2, ("nccl",))])
def test_a_group_of_no_power_of_two_or_of_another_backend_keeps_its_all_reduce(world, backends):
    assert spawn(_refused, world, backends) == [0] * world
