"""The schedule's memory: what lives when (the rules FSDP2, torchtitan's SAC and PyTorch follow)
and the allocated peak's breakdown. Small llama graphs (2 layers) on fake tensors, FSDP over 4."""

from __future__ import annotations

import pytest

from shardwise.cost.memory import MemoryCategory
from shardwise.cost.schedule import EventKind
from shardwise.ir.flops import is_view
from shardwise.passes.remat import ACPolicy, is_attention, is_matmul
from shardwise.plan.cluster import regions
from tests.cost.test_schedule import _planned, _schedule

MIXED = {"param_bytes": 4, "grad_bytes": 4, "reduce_fp32": True}


def _lifetime(s, name):
    return next(lt for lt in s.lifetimes if lt.name == name)


def _first_backward(s):
    return min(lt.born for lt in s.lifetimes if lt.name.startswith("reduce_scatter_input"))


def test_breakdown_adds_up_to_the_allocated_peak():
    traced, s = _schedule(seq=1024, ac=ACPolicy.SELECTIVE, **MIXED)
    m = s.memory
    assert m.total_bytes == s.peak_bytes
    assert m.static_bytes == s.static_bytes
    assert m.at in {n.name for n in traced.gm.graph.nodes}
    assert min(m.grads_bytes, m.gathered_params_bytes, m.saved_activations_bytes, m.transients_bytes) >= 0
    assert sum(b for _, _, b in m.largest) <= m.total_bytes - m.static_bytes
    # the caching allocator holds at least what tensors use
    assert s.reserved_peak_bytes >= s.peak_bytes
    assert m.to_json()["total_bytes"] == s.peak_bytes


def test_attention_outputs_live_until_the_backward():
    """Flash attention's output and logsumexp (a tuple, read through getitem) are saved."""
    traced, s = _schedule(seq=1024, **MIXED)
    attn = next(n for n in traced.gm.graph.nodes if is_attention(n))
    lt = _lifetime(s, attn.name)
    assert lt.category == MemoryCategory.SAVED
    assert lt.last > _first_backward(s) - 1


def test_eager_selective_ac_caches_every_output_its_policy_saves():
    """torchtitan's SAC keeps the 7th matmul of a block (every odd one) although the backward
    never reads it; compiled blocks save only what their backward reads."""
    traced, eager = _schedule(seq=1024, ac=ACPolicy.SELECTIVE, **MIXED)
    _, compiled = _schedule(seq=1024, ac=ACPolicy.SELECTIVE, compile=True, **MIXED)
    _, plain = _schedule(seq=1024, **MIXED)
    region = regions(traced)
    fwd = [n for n in traced.gm.graph.nodes if region.get(n) == 0 and traced.phase(n).value == "forward"]
    last_mm = [n for n in fwd if is_matmul(n)][6]  # w2's, counted from the block's input
    assert _lifetime(eager, last_mm.name).category == MemoryCategory.SAVED
    assert _lifetime(compiled, last_mm.name).category == MemoryCategory.TRANSIENT
    assert _lifetime(plain, last_mm.name).category == MemoryCategory.TRANSIENT


def test_fsdp2_root_and_last_block_are_not_gathered_again_for_the_backward():
    """FSDP2 keeps the root's parameters gathered from forward to backward, torchtitan the last
    block's; the other blocks reshard after forward and gather again."""
    traced, s = _schedule(seq=1024, **MIXED)
    params = {traced.params[p] for p in traced.params}
    params |= {u.name for ph in params for u in traced.node(ph).users if is_view(u)}  # transposes
    gathers = [e for e in s.events if e.kind == EventKind.COLLECTIVE and e.phase == "backward"
               and e.name.startswith("all_gather:") and e.name.split(":", 1)[1] in params]
    assert {e.region for e in gathers} == {0}
    # the root's gathered weights (embedding and output, 128K x 4096 bf16) are alive at the end
    # of the backward
    emb = traced.params["tok_embeddings.weight"]
    lt = next(lt for lt in s.lifetimes if lt.name.startswith(emb + " ->"))
    assert lt.category == MemoryCategory.GATHERED_PARAMS and lt.stream == "compute"
    assert lt.last >= max(x.last for x in s.lifetimes if x.name.startswith("reduce_scatter_input")) - 1


def test_gradient_reduction_buffers():
    """FSDP2's reduce-scatter input holds a group's gradients unsharded in fp32, on the
    reduce-scatter stream; the reduced shards live there until the optimizer step."""
    traced, s = _schedule(seq=1024, **MIXED)
    staged = {lt.name: lt for lt in s.lifetimes if lt.name.startswith("reduce_scatter_input")}
    assert set(staged) == {"reduce_scatter_input:0", "reduce_scatter_input:1", "reduce_scatter_input:root"}
    # the layer's gradients the plan reduces (those it does not make sharded itself), in fp32
    _, plan, _ = _planned("4", None, "fsdp", seq=1024)
    reduced = [p for p in traced.params if p.startswith("layers.0.")
               and plan.nodes[traced.grads[p]].output[0] != plan.nodes[traced.params[p]].output[0]]
    assert reduced
    numel = sum(traced.node(traced.params[p]).meta["val"].numel() for p in reduced)
    assert staged["reduce_scatter_input:0"].size == numel * 4
    # staged from the end of the block's backward until the next group's reduction
    assert staged["reduce_scatter_input:1"].born < staged["reduce_scatter_input:0"].born
    assert staged["reduce_scatter_input:1"].last == staged["reduce_scatter_input:0"].born
    assert all(lt.stream.endswith(":reduce_scatter") for lt in staged.values())
    # every stored gradient: a group's reduced shards in one buffer, the others one each
    grads = [lt for lt in s.lifetimes if lt.name.startswith(("grads:", "grad:"))]
    n_all = sum(traced.node(ph).meta["val"].numel() for ph in traced.params.values())
    assert sum(lt.size for lt in grads) == pytest.approx(n_all / 4 * 4, rel=1e-3)  # fp32 shards over 4
    assert {lt.stream for lt in grads if lt.name.startswith("grads:")} == {"comm:dp:reduce_scatter"}


def test_reserved_counts_each_stream_pool():
    _, s = _schedule(seq=1024, **MIXED)
    assert set(s.reserved_by_stream) >= {"compute", "comm:dp:all_gather", "comm:dp:reduce_scatter"}
    _, classic = _schedule(seq=1024, expandable_segments=False, **MIXED)
    _, expandable = _schedule(seq=1024, expandable_segments=True, **MIXED)
    assert classic.peak_bytes == expandable.peak_bytes  # the same tensors
    for sched in (classic, expandable):
        assert sum(sched.reserved_by_stream.values()) <= sched.reserved_peak_bytes
        assert sched.reserved_peak_bytes >= sched.peak_bytes
