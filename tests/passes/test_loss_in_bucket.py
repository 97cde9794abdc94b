"""loss_in_bucket: a ddp step's loss is reduced inside its last gradient bucket (one collective
fewer) and the step computes the same on gloo ranks; what it must leave alone."""

from __future__ import annotations

import torch

from shardwise.ir.match import CollectiveKind, all_collectives
from shardwise.mesh import Mesh
from shardwise.passes import bucket, early_loss_weight, loss_in_bucket, simplify
from tests.helpers import SLOW_MACHINE_TIMEOUT_S
from tests.passes.test_bucket import _programs


def _all_reduces(gm) -> int:
    return sum(c.kind is CollectiveKind.ALL_REDUCE for c in all_collectives(gm.graph))


def test_a_ddp_steps_loss_joins_the_gradient_bucket_and_the_step_is_unchanged_on_gloo():
    from shardwise.runtime import run_many

    plain, rewritten = _programs("ddp", Mesh((2,), ("dp",)))
    gm = rewritten.gm
    bucket.apply(gm)
    early_loss_weight.apply(gm)
    simplify.apply(gm)
    before = _all_reduces(gm)
    flat = next(c.input for c in all_collectives(gm.graph) if c.reduce_op == "sum" and c.input.users
                and c.input.target is torch.ops.aten.cat.default)
    members = len(flat.args[0])
    assert loss_in_bucket.apply(gm) == 1
    # The loss and a 1 per rank (its average's count) travel at the end of the bucket.
    assert _all_reduces(gm) == before - 1 and len(flat.args[0]) == members + 2
    assert not any(c.reduce_op == "avg" for c in all_collectives(gm.graph))
    results = run_many([plain, rewritten], check=True, timeout_s=SLOW_MACHINE_TIMEOUT_S)
    for got, want in zip(results[1].outputs, results[0].outputs, strict=True):
        assert torch.equal(got, want)


def test_a_loss_read_by_the_step_or_without_a_sum_bucket_stays():
    _, ddp = _programs("ddp", Mesh((2,), ("dp",)))
    bucket.apply(ddp.gm)
    # Before simplify the backward's seed reads the reduced loss: it must arrive mid-step.
    assert loss_in_bucket.apply(ddp.gm) == 0
    _, fsdp = _programs("fsdp", Mesh((2,), ("dp",)))
    bucket.apply(fsdp.gm)
    early_loss_weight.apply(fsdp.gm)
    simplify.apply(fsdp.gm)
    # FSDP's gradients are reduce-scattered: no all_reduce bucket to join.
    assert loss_in_bucket.apply(fsdp.gm) == 0
