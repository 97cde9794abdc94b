"""The bucket pass: a step's gradient reductions and parameter gathers grouped into few
collectives, values unchanged
(run on real gloo ranks against the unbucketed program), and what it must leave alone."""

from __future__ import annotations

import pytest
import torch

from shardwise.ir.match import CollectiveKind, all_collectives
from shardwise.ir.trace import trace_model
from shardwise.lower import lower
from shardwise.mesh import Mesh
from shardwise.passes import bucket
from shardwise.passes.pipeline import canonicalize
from shardwise.plan import make_plan
from shardwise.runtime import run_many
from tests.helpers import SLOW_MACHINE_TIMEOUT_S

SHAPE = {"layers": 2, "batch": 4, "seq": 8}


def _programs(baseline: str, mesh: Mesh, passes=(), train: bool = True):
    traced = trace_model("llama-tiny", train=train, **SHAPE)
    canonicalize(traced)
    plan = make_plan(traced, mesh, baseline=baseline)
    plain, rewritten = lower(traced, plan), lower(traced, plan)
    for prog in (plain, rewritten):
        prog.apply_passes(list(passes))
    return plain, rewritten


def _count(gm, kind: CollectiveKind) -> int:
    return sum(c.kind is kind for c in all_collectives(gm.graph))


@pytest.mark.slow
def test_ddp_and_fsdp_reductions_bucket_and_the_step_is_unchanged():
    ddp_plain, ddp = _programs("ddp", Mesh((2,), ("dp",)))
    fsdp_plain, fsdp = _programs("fsdp", Mesh((2,), ("dp",)))
    before = _count(ddp_plain.gm, CollectiveKind.ALL_REDUCE)
    assert before >= len(ddp.traced.params) - 1  # one per gradient (the embedding's is gathered)
    merged = bucket.apply(ddp.gm)
    after = _count(ddp.gm, CollectiveKind.ALL_REDUCE)
    # The gradients' reductions became one; the loss's (read by the step itself) stays.
    assert merged == before - after and after <= before - len(ddp.traced.params) + 2
    scatters = _count(fsdp_plain.gm, CollectiveKind.REDUCE_SCATTER)
    gathers = _count(fsdp_plain.gm, CollectiveKind.ALL_GATHER)
    merged = bucket.apply(fsdp.gm)
    assert _count(fsdp.gm, CollectiveKind.REDUCE_SCATTER) == 1
    # The parameter gathers (through their transposes) bucket too; what gathers activations stays.
    left = _count(fsdp.gm, CollectiveKind.ALL_GATHER)
    assert left <= gathers - len(fsdp.traced.params) + 1
    assert merged == scatters - 1 + gathers - left
    results = run_many([ddp_plain, ddp, fsdp_plain, fsdp], check=True, timeout_s=SLOW_MACHINE_TIMEOUT_S)
    for plain, rewritten in (results[:2], results[2:]):
        assert rewritten.max_rel_err <= 1e-5
        for got, want in zip(rewritten.outputs, plain.outputs, strict=True):
            assert torch.equal(got, want)  # sums of the same numbers, in the same order


@pytest.mark.slow
def test_small_buckets_on_a_2x2_mesh_after_the_other_passes():
    plain, rewritten = _programs("fsdp_tp_sp", Mesh((2, 2), ("dp", "tp")),
                                 passes=("sequence_parallel", "collective_matmul"))
    n = bucket.apply(rewritten.gm, bucket_bytes=4096)
    assert n > 0
    results = run_many([plain, rewritten], check=True, timeout_s=SLOW_MACHINE_TIMEOUT_S)
    assert results[1].max_rel_err <= 1e-5


def test_reductions_read_inside_the_step_are_left_alone():
    """Tensor-parallel all_reduces feed the next layer: moving them would change nothing but they
    are not the step's last word, so the pass keeps them; an inference graph has no gradient
    reductions at all."""
    _, tp = _programs("fsdp_tp", Mesh((1, 2), ("dp", "tp")), train=False)
    before = _count(tp.gm, CollectiveKind.ALL_REDUCE)
    assert before > 0
    assert bucket.apply(tp.gm) == 0 and _count(tp.gm, CollectiveKind.ALL_REDUCE) == before


def test_the_first_gradient_bucket_is_small_like_ddps():
    """The backward's first gradients go out in a small bucket (DDP's 1 MiB first bucket), so
    their reduction starts while the rest of the backward runs; later buckets fill up to the cap.
    Capped below one gradient's size, the first bucket is that gradient alone (left as it is)."""
    _, ddp = _programs("ddp", Mesh((2,), ("dp",)))
    (whole,) = bucket.find_buckets(ddp.gm)  # the tiny model's gradients fit in one
    split = bucket.find_buckets(ddp.gm, first_bucket_bytes=4096)
    assert [b.kind for b in split] == [CollectiveKind.ALL_REDUCE]
    assert split[0].members == whole.members[1:]
