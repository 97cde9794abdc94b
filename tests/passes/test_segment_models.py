"""Segmentation of traced models: exact reproduction on llama-tiny, forwarding savings on an hf:
Llama config, and the per-segment cost model."""

from __future__ import annotations

import pytest
import torch

from shardwise.cost.hardware import get_hardware
from shardwise.cost.segments import UNPRICED_CLASSES, segment_time, segmentation_time
from shardwise.ir.flops import node_flops
from shardwise.ir.trace import trace_model
from shardwise.passes.segment import SegClass, segment
from tests.helpers import hf_model_name, real_inputs_for
from tests.passes.test_segment import assert_well_formed

VOCAB = 256  # llama-tiny's vocabulary


@pytest.fixture(scope="module")
def tiny_train():
    return trace_model("llama-tiny", train=True)


@pytest.mark.parametrize("forwarding", [True, False])
def test_segments_reproduce_llama_tiny_training_step_exactly(tiny_train, forwarding):
    gm = tiny_train.gm
    s = segment(gm, forwarding=forwarding)
    assert_well_formed(s)
    args = real_inputs_for(gm, seed=0, vocab=VOCAB)
    want, got = gm(*args), s.run(*args)
    assert len(want) == len(got) == 1 + len(tiny_train.grads)
    for w, g in zip(want, got, strict=True):
        assert torch.equal(w, g)


def test_forwarding_on_llama_tiny_counts_every_rule(tiny_train):
    s = segment(tiny_train.gm)
    # RoPE's arange chains (factory + unary) and the weight transposes (broadcast) are forwarded
    assert all(v > 0 for v in s.forwarded.values()), s.forwarded
    assert all(n not in seg.inputs and n not in seg.outputs
               for seg in s.segments for n in s.forwarding.kinds)


def test_forwarding_saves_boundary_bytes_on_hf_llama():
    traced = trace_model(hf_model_name("llama"), train=True, layers=1)
    with_fwd, without = segment(traced.gm), segment(traced.gm, forwarding=False)
    assert_well_formed(with_fwd)
    assert with_fwd.boundary_bytes < without.boundary_bytes


def test_segment_time_is_roofline_on_boundary_bytes(tiny_train):
    hw = get_hardware("h100")
    s = segment(tiny_train.gm)
    for seg in s.segments:
        t = segment_time(seg, hw)
        if seg.cls in UNPRICED_CLASSES:
            assert t == 0.0
            continue
        mem = hw.memory_time(seg.boundary_bytes) + hw.launch_s
        if seg.cls is SegClass.MATMUL:
            flops = sum(node_flops(n) for n in seg.nodes)
            assert flops > 0
            assert t == pytest.approx(max(mem, hw.flops_time(flops, seg.dtype) + hw.launch_s))
        else:
            assert t == pytest.approx(mem)
    assert segmentation_time(s, hw) == pytest.approx(sum(segment_time(x, hw) for x in s.segments))
    # fewer boundary bytes never cost more
    assert segmentation_time(s, hw) <= segmentation_time(segment(tiny_train.gm, forwarding=False), hw)
