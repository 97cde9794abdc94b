"""The memory figures from buffer lifetimes (``cost/memory.py``), on hand-made lifetimes."""

from __future__ import annotations

from shardwise.cost.memory import (
    ALLOCATOR_STEPS,
    Lifetime,
    MemoryCategory,
    breakdown,
    peak_live,
    reserved_peak,
)

MIB = 1 << 20


def test_peak_live_and_its_breakdown():
    lts = [Lifetime("a", MemoryCategory.SAVED, 100, 0, 3),
           Lifetime("b", MemoryCategory.TRANSIENT, 50, 1, 1),
           Lifetime("c", MemoryCategory.TRANSIENT, 70, 2, 2),
           Lifetime("g", MemoryCategory.GRADS, 30, 2, 4)]
    assert peak_live(lts, 4) == (200, 2)  # a + c + g at item 2
    m = breakdown(lts, 2, 1000, "node", "backward", 0)
    assert (m.saved_activations_bytes, m.transients_bytes, m.grads_bytes) == (100, 70, 30)
    assert m.total_bytes == 1200 and m.largest[0] == ("a", MemoryCategory.SAVED, 100)
    assert m.to_json()["region"] == "layer 0"


def test_reserved_peak_replays_steps_with_lazy_optimizer_state():
    """A 200 MiB activation per step, a 100 MiB parameter, Adam's two 50 MiB moments made at
    the first optimizer step. Classic allocator: the moments are carved from the activation's
    cached 200 MiB block, so the next step's activation needs a new segment: 100 + 200 + 200.
    Expandable segments: the moments take the segment's free tail, the next activation maps
    only the 100 MiB it lacks: 100 + 200 + 100."""
    acts = [Lifetime("act", MemoryCategory.TRANSIENT, 200 * MIB, 0, 1)]
    classic, pools = reserved_peak(acts, [100 * MIB], [50 * MIB, 50 * MIB], 2, 1e12, False)
    assert classic == 500 * MIB and pools == {"compute": 500 * MIB}
    expandable, _ = reserved_peak(acts, [100 * MIB], [50 * MIB, 50 * MIB], 2, 1e12, True)
    assert expandable == 400 * MIB
    assert ALLOCATOR_STEPS >= 2  # the second step is the one the lazy state fragments


def test_reserved_peak_keeps_stream_pools_apart():
    acts = [Lifetime("gather", MemoryCategory.GATHERED_PARAMS, 100 * MIB, 0, 0, "comm:dp:all_gather"),
            Lifetime("act", MemoryCategory.TRANSIENT, 100 * MIB, 1, 1)]
    total, pools = reserved_peak(acts, [], [], 2, 1e12, False)
    assert total == 200 * MIB and pools == {"comm:dp:all_gather": 100 * MIB, "compute": 100 * MIB}
