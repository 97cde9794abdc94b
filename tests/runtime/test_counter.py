"""The collective counter: executed collectives and graph collectives are counted alike, with the
shared byte convention (all_gather: gathered output; reduce_scatter: full input; others: input)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.fx.experimental.proxy_tensor import make_fx

from shardwise.mesh import ensure_fake_world
from shardwise.runtime.counter import CollectiveCounter, as_json, count_graph, same_counts

c10d = torch.ops._c10d_functional


def _collectives(x: torch.Tensor) -> list[torch.Tensor]:
    group = dist.group.WORLD.group_name
    return [
        c10d.wait_tensor(c10d.all_gather_into_tensor(x, 2, group)),
        c10d.wait_tensor(c10d.reduce_scatter_tensor(x, "sum", 2, group)),
        c10d.wait_tensor(c10d.all_reduce(x, "sum", group)),
        c10d.wait_tensor(c10d.all_reduce(x, "avg", group)),
    ]


# x is [4, 6] fp32 = 96 bytes.
EXPECTED = {
    "all_gather": {"count": 1, "bytes": 2 * 96},
    "reduce_scatter": {"count": 1, "bytes": 96},
    "all_reduce": {"count": 2, "bytes": 2 * 96},
}


def test_counter_records_executed_collectives():
    ensure_fake_world(2)
    with CollectiveCounter() as counter:
        _collectives(torch.randn(4, 6))
    assert as_json(counter.counts) == EXPECTED


def test_graph_count_equals_executed_count():
    ensure_fake_world(2)
    gm = make_fx(_collectives)(torch.randn(4, 6))
    assert as_json(count_graph(gm)) == EXPECTED
    with CollectiveCounter() as counter:
        gm(torch.randn(4, 6))
    assert same_counts(counter.counts, count_graph(gm))


def test_counter_ignores_other_ops():
    with CollectiveCounter() as counter:
        torch.randn(3, 3) @ torch.randn(3, 3)
    assert counter.counts == {}
