"""The caching-allocator simulation on hand-made traces whose reserved bytes are counted by hand
(the rules are ``c10/cuda/CUDACachingAllocator.cpp``'s, cited in ``cost/allocator.py``)."""

from __future__ import annotations

import pytest

from shardwise.cost.allocator import (
    CachingAllocator,
    Request,
    allocation_size,
    replay,
    round_size,
)

MIB = 1 << 20


def test_rounding_and_segment_sizes():
    assert round_size(1) == 512 and round_size(513) == 1024 and round_size(4096) == 4096
    assert allocation_size(1000) == 2 * MIB            # small: a 2 MiB segment
    assert allocation_size(5 * MIB) == 20 * MIB        # 1-10 MiB: a 20 MiB segment
    assert allocation_size(11 * MIB + 1) == 12 * MIB   # larger: rounded up to 2 MiB
    a = CachingAllocator()
    a.malloc(1000)
    a.malloc(5 * MIB)
    a.malloc(11 * MIB + 1)        # carved from the 20 MiB segment's 15 MiB remainder
    assert a.stats.reserved == (2 + 20) * MIB
    a.malloc(11 * MIB + 1)        # 4 MiB left there: a new 12 MiB segment, not split (the
    assert a.stats.reserved == (2 + 20 + 12) * MIB  # remainder is under 1 MiB): all of it in use
    assert a.stats.allocated == 1024 + 5 * MIB + (11 * MIB + 512) + 12 * MIB


def test_freed_block_is_reused_and_split():
    a = CachingAllocator()
    a.free(a.malloc(100 * MIB))
    x = a.malloc(30 * MIB)        # split: 70 MiB stays cached
    y = a.malloc(70 * MIB)        # the remainder, exactly
    assert a.stats.reserved == 100 * MIB and a.stats.segments == 1
    assert x.size == 30 * MIB and y.size == 70 * MIB


def test_large_block_not_split_for_a_remainder_under_1mib():
    a = CachingAllocator()
    a.free(a.malloc(100 * MIB))
    b = a.malloc(100 * MIB - 512 * 1024)   # remainder 0.5 MiB: not worth a block
    assert b.size == 100 * MIB and a.stats.allocated == 100 * MIB
    # the same request with expandable segments keeps any remainder of 512 B or more
    e = CachingAllocator(expandable_segments=True)
    e.free(e.malloc(100 * MIB))
    assert e.malloc(100 * MIB - 512 * 1024).size == 100 * MIB - 512 * 1024


def test_fragmentation_reserves_more_than_the_allocated_peak():
    a = CachingAllocator()
    a.free(a.malloc(100 * MIB))
    x = a.malloc(50 * MIB)
    a.malloc(50 * MIB)
    a.free(x)                     # 50 MiB free at the start of the segment, 50 in use after it
    a.malloc(60 * MIB)            # fits no cached block: a new 60 MiB segment
    assert a.stats.peak_allocated == 110 * MIB
    assert a.stats.peak_reserved == 160 * MIB


def test_free_neighbours_coalesce():
    a = CachingAllocator()
    a.free(a.malloc(100 * MIB))
    x, y = a.malloc(50 * MIB), a.malloc(50 * MIB)
    a.free(x)
    a.free(y)                     # merged back into one 100 MiB block
    a.malloc(100 * MIB)
    assert a.stats.reserved == 100 * MIB and a.stats.segments == 1


def test_blocks_serve_only_their_stream():
    a = CachingAllocator()
    a.free(a.malloc(100 * MIB, "comm:dp"))
    a.malloc(100 * MIB, "compute")           # the comm stream's cached block is not reused
    assert a.stats.reserved == 200 * MIB
    a.malloc(100 * MIB, "comm:dp")           # but the comm stream reuses it
    assert a.stats.reserved == 200 * MIB


def test_best_fit_takes_the_smallest_block_that_fits():
    a = CachingAllocator()
    big, small = a.malloc(100 * MIB), a.malloc(40 * MIB)
    a.free(big)
    a.free(small)
    x = a.malloc(30 * MIB)        # from the 40 MiB block, leaving the 100 MiB one whole
    assert x.segment is small.segment
    a.malloc(100 * MIB)
    assert a.stats.reserved == 140 * MIB


def test_expandable_segments_grow_in_20mib_pages_and_tile():
    a = CachingAllocator(expandable_segments=True)
    x = a.malloc(30 * MIB)        # maps 2 pages: 40 MiB
    assert a.stats.reserved == 40 * MIB
    y = a.malloc(30 * MIB)        # the 10 MiB free tail grows by one page
    assert a.stats.reserved == 60 * MIB
    a.free(x)
    a.free(y)
    a.malloc(60 * MIB)            # the two merged: no new memory
    assert a.stats.reserved == 60 * MIB
    # the classic allocator makes two 30 MiB segments, and a third for 60 MiB
    c = CachingAllocator()
    cx, cy = c.malloc(30 * MIB), c.malloc(30 * MIB)
    c.free(cx)
    c.free(cy)
    c.malloc(60 * MIB)
    assert c.stats.reserved == 120 * MIB


def test_cached_segments_are_released_before_exceeding_capacity():
    a = CachingAllocator(capacity=150 * MIB)
    a.free(a.malloc(100 * MIB))
    a.malloc(120 * MIB)           # 220 MiB would exceed 150: the free 100 MiB segment goes
    assert a.stats.reserved == 120 * MIB and a.stats.segments == 1
    unlimited = CachingAllocator()
    unlimited.free(unlimited.malloc(100 * MIB))
    unlimited.malloc(120 * MIB)
    assert unlimited.stats.reserved == 220 * MIB


def test_replay_orders_allocations_before_frees_at_each_position():
    # a is read last at position 1, where b is made: both live at once (b is the output of a
    # kernel reading a); c is made at 2, after a is gone, and reuses its block
    reqs = [Request(100 * MIB, 0, 1), Request(100 * MIB, 1, 2), Request(100 * MIB, 2, 2)]
    stats = replay(reqs, CachingAllocator())
    assert stats.peak_allocated == 200 * MIB
    assert stats.peak_reserved == 200 * MIB
    a = CachingAllocator()
    b = a.malloc(MIB)
    a.free(b)
    with pytest.raises(AssertionError, match="double free"):
        a.free(b)


@pytest.mark.parametrize("expandable", [False, True])
def test_segments_stay_tiled_through_random_mallocs_and_frees(expandable):
    """Random mallocs and frees, splitting and merging blocks: each segment's blocks tile it in
    order, its ``last`` is the block its chain ends at, its free blocks are exactly those on
    the free lists, and the reserved bytes are the segments' sizes."""
    import random

    rng = random.Random(1)
    a = CachingAllocator(expandable_segments=expandable)
    live = []
    for _ in range(2000):
        if live and rng.random() < 0.45:
            a.free(live.pop(rng.randrange(len(live))))
        else:
            size = rng.choice([rng.randint(1, 4096), rng.randint(1, 4 * MIB), rng.randint(MIB, 40 * MIB)])
            live.append(a.malloc(size, rng.choice(["compute", "comm"])))
        on_lists = {id(e[3]) for lst in a._free.values() for e in lst}
        for seg in a._segments:
            blocks = list(seg.blocks())
            assert seg.last is (blocks[-1] if blocks else None)
            assert [b.offset for b in blocks] == [sum(b.size for b in blocks[:i]) for i in range(len(blocks))]
            assert sum(b.size for b in blocks) == seg.size
            assert {id(b) for b in blocks if not b.allocated} <= on_lists
        assert a.stats.reserved == sum(seg.size for seg in a._segments)
