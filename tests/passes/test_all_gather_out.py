"""all_gather_out: every allocating all_gather gathers into a buffer of its own, the waits where
they were, and the step with its waits sunk computes the same on gloo ranks."""

from __future__ import annotations

import pytest
import torch

from shardwise.ir.match import CollectiveKind, all_collectives
from shardwise.mesh import Mesh
from shardwise.passes import all_gather_out, sink_waits
from shardwise.runtime import run_many
from tests.helpers import SLOW_MACHINE_TIMEOUT_S
from tests.passes.test_bucket import _programs

c10d = torch.ops._c10d_functional


@pytest.mark.slow
def test_fsdp_step_with_sunk_gathers_into_buffers_computes_the_same_on_gloo():
    plain, rewritten = _programs("fsdp", Mesh((2,), ("dp",)))
    gm = rewritten.gm
    gathers = sum(c.kind is CollectiveKind.ALL_GATHER for c in all_collectives(gm.graph))
    assert sink_waits.apply(gm) > 0
    assert all_gather_out.apply(gm) == gathers > 0
    ops = [c.op for c in all_collectives(gm.graph) if c.kind is CollectiveKind.ALL_GATHER]
    assert len(ops) == gathers  # still seen as gathers (collective counts, later passes)
    for op in ops:
        assert op.target is c10d.all_gather_into_tensor_out.default
        buf = op.kwargs["out"]
        assert buf.target is torch.ops.aten.new_empty.default and list(buf.users) == [op]
        assert tuple(buf.args[1]) == tuple(op.meta["val"].shape)
    assert all_gather_out.apply(gm) == 0  # nothing left to rewrite
    results = run_many([plain, rewritten], check=True, timeout_s=SLOW_MACHINE_TIMEOUT_S)
    for got, want in zip(results[1].outputs, results[0].outputs, strict=True):
        assert torch.equal(got, want)


def test_a_gather_of_unknown_shape_is_left_alone():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    ag = g.call_function(c10d.all_gather_into_tensor.default, (x, 2, "0"))
    g.output(g.call_function(c10d.wait_tensor.default, (ag,)))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    assert all_gather_out.apply(gm) == 0 and ag.target is c10d.all_gather_into_tensor.default
