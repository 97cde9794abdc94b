"""loss_in_bucket: a ddp step's loss and its mean's token count are reduced inside its last
gradient bucket (one collective for the step) and the step computes the same on gloo ranks; a
loss that is no mean joins alone, bit for bit; what the pass must leave alone."""

from __future__ import annotations

import pytest
import torch

from shardwise.ir.match import CollectiveKind, Reduction, all_collectives
from shardwise.mesh import Mesh
from shardwise.passes import bucket, early_loss_weight, loss_in_bucket, simplify
from shardwise.runtime.launch import rel_err
from tests.helpers import SLOW_MACHINE_TIMEOUT_S
from tests.passes.test_bucket import _programs

aten = torch.ops.aten
DDP = ("ddp", Mesh((2,), ("dp",)))


def _all_reduces(gm) -> int:
    return sum(c.kind is CollectiveKind.ALL_REDUCE for c in all_collectives(gm.graph))


def _last_bucket_members(gm) -> list:
    flat = [c.input for c in all_collectives(gm.graph)
            if c.reduce_op == "sum" and c.input.target is aten.cat.default][-1]
    return flat.args[0]


def _prepare(gm, **bucket_sizes) -> None:
    bucket.apply(gm, **bucket_sizes)
    early_loss_weight.apply(gm)
    simplify.apply(gm)


def _nll(gm, target):
    return next(n for n in gm.graph.nodes if n.target is target)


# The default buckets (all of llama-tiny's gradients in one) and buckets of 256 KiB (several: the
# count arrives with the last, and every earlier bucket's gradients are divided after it).
@pytest.mark.parametrize("bucket_bytes", [bucket.DEFAULT_BUCKET_BYTES, 2**18])
def test_a_ddp_steps_loss_and_token_count_join_the_bucket_and_the_step_is_unchanged_on_gloo(bucket_bytes):
    from shardwise.runtime import run_many

    plain, rewritten = _programs(*DDP)
    gm = rewritten.gm
    _prepare(gm, bucket_bytes=bucket_bytes, first_bucket_bytes=min(bucket_bytes, bucket.FIRST_BUCKET_BYTES))
    before, members = _all_reduces(gm), len(_last_bucket_members(gm))
    assert loss_in_bucket.apply(gm) == 1
    gm.graph.lint()  # every division of a gradient stands before its readers
    # One collective fewer per bucket than before: the loss and the count travel at the end of
    # the last bucket, and each rank differentiates the sum of its tokens' losses.
    buckets = before - 2
    assert buckets == 1 if bucket_bytes == bucket.DEFAULT_BUCKET_BYTES else buckets >= 2
    assert _all_reduces(gm) == buckets and len(_last_bucket_members(gm)) == members + 2
    assert _nll(gm, aten.nll_loss_forward.default).args[3] == Reduction.SUM
    assert _nll(gm, aten.nll_loss_backward.default).args[4] == Reduction.SUM
    results = run_many([plain, rewritten], check=True, timeout_s=SLOW_MACHINE_TIMEOUT_S)
    assert results[1].max_rel_err <= 1e-5
    for got, want in zip(results[1].outputs, results[0].outputs, strict=True):
        assert rel_err(got, want) <= 1e-6


def test_a_loss_that_is_no_mean_joins_alone_with_the_same_bits_on_gloo():
    from shardwise.runtime import run_many

    programs = _programs(*DDP)
    for prog in programs:  # a summed cross entropy, averaged over the ranks
        _nll(prog.gm, aten.nll_loss_forward.default).update_arg(3, int(Reduction.SUM))
        _nll(prog.gm, aten.nll_loss_backward.default).update_arg(4, int(Reduction.SUM))
        prog.gm.recompile()
    gm = programs[1].gm
    _prepare(gm)
    before, members = _all_reduces(gm), len(_last_bucket_members(gm))
    assert loss_in_bucket.apply(gm) == 1
    # The loss and a 1 per rank (its average's count) join; the token count keeps its own.
    assert _all_reduces(gm) == before - 1 and len(_last_bucket_members(gm)) == members + 2
    assert not any(c.reduce_op == "avg" for c in all_collectives(gm.graph))
    results = run_many(programs, timeout_s=SLOW_MACHINE_TIMEOUT_S)
    for got, want in zip(results[1].outputs, results[0].outputs, strict=True):
        assert torch.equal(got, want)


def test_a_loss_read_by_the_step_or_without_a_sum_bucket_stays():
    _, ddp = _programs(*DDP)
    bucket.apply(ddp.gm)
    # Before simplify the backward's seed reads the reduced loss: it must arrive mid-step.
    assert loss_in_bucket.apply(ddp.gm) == 0
    _, fsdp = _programs("fsdp", Mesh((2,), ("dp",)))
    _prepare(fsdp.gm)
    # FSDP's gradients are reduce-scattered: no all_reduce bucket to join.
    assert loss_in_bucket.apply(fsdp.gm) == 0
