"""A small simulation of PyTorch's CUDA caching allocator: reserved bytes from a malloc/free trace.

``torch.cuda.max_memory_reserved`` (what torchtitan reports as peak memory) counts the segments
the caching allocator holds from the driver, not the bytes tensors occupy: freed blocks stay
cached for reuse, a cached block serves only its own stream, and a block larger than a request
is split, so the reserved peak can exceed the allocated one (fragmentation). This module
replays a sequence of ``malloc(size, stream)`` / ``free`` through the rules of
``c10/cuda/CUDACachingAllocator.cpp`` (``DeviceCachingAllocator``); the constants below are its
own, cited by name:

- sizes are rounded up to ``kMinBlockSize`` = 512 B (``round_size``; ``roundup_power2_divisions``
  off, its default);
- requests of at most ``kSmallSize`` = 1 MiB use the small pool, larger ones the large pool
  (``get_pool``);
- a request takes the smallest cached free block of its pool *and stream* that fits, the lowest
  address among equals (``get_free_block``: ``pool.blocks.lower_bound`` over (stream, size,
  address); "Once freed, blocks can be re-allocated on the same stream, but not on any other
  stream");
- without one, a new segment is allocated (``alloc_block``) of ``get_allocation_size``: 2 MiB
  (``kSmallBuffer``) for small requests, 20 MiB (``kLargeBuffer``) for requests under 10 MiB
  (``kMinLargeAlloc``), else the request rounded up to 2 MiB (``kRoundLarge``);
- a block larger than the request is split when the remainder is worth keeping
  (``should_split``: small pool remainder >= 512 B; large pool remainder > 1 MiB, with
  ``max_split_size`` unlimited, its default);
- a freed block merges with free neighbours of its segment (``free_block``/``try_merge_blocks``);
- segments are never returned (no ``empty_cache``); when a new segment would exceed the device
  capacity, the cached segments with no block in use are released first and the allocation
  retried (``release_cached_blocks`` on a failed ``cudaMalloc``).

With ``expandable_segments`` (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, which
torchtitan's launch script sets) each stream and pool has one segment that grows: a request no
cached block fits maps pages at the segment's end (``try_allocate_expandable_block``), merged
with a free block already there; pages are 2 MiB for the small pool and 20 MiB for the large one
(Note [Expandable Segments]); a split keeps any remainder of at least 512 B (``should_split``).

Streams are names; what matters is only that blocks of one stream are never handed to another.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

MIB = 1 << 20
K_MIN_BLOCK_SIZE = 512          # kMinBlockSize: "all sizes are rounded to at least 512 bytes"
K_SMALL_SIZE = 1 * MIB          # kSmallSize: "largest 'small' allocation is 1 MiB"
K_SMALL_BUFFER = 2 * MIB        # kSmallBuffer: "'small' allocations are packed in 2 MiB blocks"
K_LARGE_BUFFER = 20 * MIB       # kLargeBuffer: "'large' allocations may be packed in 20 MiB blocks"
K_MIN_LARGE_ALLOC = 10 * MIB    # kMinLargeAlloc: "allocations between 1 and 10 MiB may use kLargeBuffer"
K_ROUND_LARGE = 2 * MIB         # kRoundLarge: "round up large allocations to 2 MiB"
# Note [Expandable Segments]: "we use 2MiB pages for our small pool and 20MiB pages for our
# large pool".
EXPANDABLE_SMALL_PAGE = 2 * MIB
EXPANDABLE_LARGE_PAGE = 20 * MIB


def round_size(size: int) -> int:
    """``round_size``: at least 512 B, a multiple of 512 B."""
    return max(K_MIN_BLOCK_SIZE, -(-size // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE)


def allocation_size(size: int) -> int:
    """``get_allocation_size``: the segment a (rounded) request no cached block fits creates."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return -(-size // K_ROUND_LARGE) * K_ROUND_LARGE


@dataclass(eq=False)
class _Block:
    segment: _Segment
    offset: int
    size: int
    allocated: bool = False
    prev: _Block | None = None
    next: _Block | None = None


@dataclass(eq=False)
class _Segment:
    stream: str
    small: bool
    size: int
    expandable: bool = False
    index: int = 0  # creation order: stands for its address in best-fit ties
    first: _Block | None = None
    last: _Block | None = None  # kept, not walked to: an expandable segment grows at its end

    def blocks(self) -> Iterable[_Block]:
        b = self.first
        while b is not None:
            yield b
            b = b.next


@dataclass
class AllocatorStats:
    """Current and peak bytes in use by tensors (allocated) and held from the driver (reserved)."""

    allocated: int = 0
    reserved: int = 0
    peak_allocated: int = 0
    peak_reserved: int = 0
    segments: int = 0
    reserved_by_stream: dict[str, int] = field(default_factory=dict)


@dataclass
class CachingAllocator:
    """Replays mallocs and frees (see the module docstring). ``capacity``: device bytes beyond
    which cached segments are released before a new one is made (None: unlimited)."""

    expandable_segments: bool = False
    capacity: int | None = None
    stats: AllocatorStats = field(default_factory=AllocatorStats)
    _free: dict[tuple[str, bool], list[tuple[int, int, int, _Block]]] = field(default_factory=dict)
    _segments: list[_Segment] = field(default_factory=list)
    _expandable: dict[tuple[str, bool], _Segment] = field(default_factory=dict)
    _seq: int = 0

    # ---- the free lists (one per stream and pool, ordered by size then address) ------------
    def _key(self, b: _Block) -> tuple[int, int, int]:
        return (b.size, b.segment.index, b.offset)

    # A free list's entries are (size, segment index, offset, block): no two free blocks share
    # the first three, so plain tuple order never compares blocks, and a key of those three
    # sorts before its own entry.
    def _insert_free(self, b: _Block) -> None:
        lst = self._free.setdefault((b.segment.stream, b.segment.small), [])
        bisect.insort(lst, (*self._key(b), b))

    def _remove_free(self, b: _Block) -> None:
        lst = self._free[(b.segment.stream, b.segment.small)]
        i = bisect.bisect_left(lst, self._key(b))
        assert lst[i][3] is b
        del lst[i]

    def _best_fit(self, size: int, stream: str, small: bool) -> _Block | None:
        """``get_free_block``: the smallest cached block of this stream and pool that fits."""
        lst = self._free.get((stream, small), [])
        i = bisect.bisect_left(lst, (size, -1, -1))
        return lst[i][3] if i < len(lst) else None

    # ---- malloc / free -------------------------------------------------------------------
    def malloc(self, size: int, stream: str = "compute") -> _Block:
        """A block of at least ``size`` bytes for ``stream``."""
        size = round_size(size)
        small = size <= K_SMALL_SIZE
        block = self._best_fit(size, stream, small)
        if block is not None:
            self._remove_free(block)
        elif self.expandable_segments:
            block = self._expand(size, stream, small)
        else:
            block = self._new_segment(size, stream, small)
        if self._should_split(block, size, small):
            rest = _Block(block.segment, block.offset + size, block.size - size, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = rest
            else:
                block.segment.last = rest
            block.next = rest
            block.size = size
            self._insert_free(rest)
        block.allocated = True
        self.stats.allocated += block.size
        self.stats.peak_allocated = max(self.stats.peak_allocated, self.stats.allocated)
        return block

    def free(self, block: _Block) -> None:
        """``free_block``: cache the block, merged with its segment's free neighbours."""
        assert block.allocated, "double free"
        block.allocated = False
        self.stats.allocated -= block.size
        for nb in (block.prev, block.next):
            if nb is not None and not nb.allocated:
                self._remove_free(nb)
                self._merge(block, nb)
        self._insert_free(block)

    def _merge(self, dst: _Block, src: _Block) -> None:
        """``try_merge_blocks``: ``dst`` absorbs its free neighbour ``src``."""
        if src is dst.prev:
            dst.offset = src.offset
            dst.prev = src.prev
            if src.prev is not None:
                src.prev.next = dst
            else:
                dst.segment.first = dst
        else:
            dst.next = src.next
            if src.next is not None:
                src.next.prev = dst
            else:
                dst.segment.last = dst
        dst.size += src.size

    def _should_split(self, block: _Block, size: int, small: bool) -> bool:
        remaining = block.size - size
        if small or self.expandable_segments:
            return remaining >= K_MIN_BLOCK_SIZE
        return remaining > K_SMALL_SIZE

    def _reserve(self, nbytes: int, stream: str) -> None:
        if self.capacity is not None and self.stats.reserved + nbytes > self.capacity:
            self._release_cached()
        self.stats.reserved += nbytes
        self.stats.reserved_by_stream[stream] = self.stats.reserved_by_stream.get(stream, 0) + nbytes
        self.stats.peak_reserved = max(self.stats.peak_reserved, self.stats.reserved)

    def _new_segment(self, size: int, stream: str, small: bool) -> _Block:
        """``alloc_block``: a new segment of ``get_allocation_size``, one free block."""
        seg_size = allocation_size(size)
        self._reserve(seg_size, stream)
        seg = _Segment(stream, small, seg_size, index=self._next_index())
        seg.first = seg.last = _Block(seg, 0, seg_size)
        self._segments.append(seg)
        self.stats.segments += 1
        return seg.first

    def _expand(self, size: int, stream: str, small: bool) -> _Block:
        """``try_allocate_expandable_block``: map pages at the end of the stream's segment,
        merged with a free block already there."""
        seg = self._expandable.get((stream, small))
        if seg is None:
            seg = _Segment(stream, small, 0, expandable=True, index=self._next_index())
            self._expandable[(stream, small)] = seg
            self._segments.append(seg)
            self.stats.segments += 1
        last = seg.last
        tail = last if last is not None and not last.allocated else None
        need = size - (tail.size if tail is not None else 0)
        page = EXPANDABLE_SMALL_PAGE if small else EXPANDABLE_LARGE_PAGE
        mapped = math.ceil(need / page) * page
        self._reserve(mapped, stream)
        if tail is not None:
            self._remove_free(tail)
            tail.size += mapped
            block = tail
        else:
            block = _Block(seg, seg.size, mapped, prev=last)
            if last is not None:
                last.next = block
            else:
                seg.first = block
            seg.last = block
        seg.size += mapped
        return block

    def _next_index(self) -> int:
        self._seq += 1
        return self._seq

    def _release_cached(self) -> None:
        """``release_cached_blocks``: give back every segment with no block in use."""
        keep = []
        for seg in self._segments:
            if seg.expandable or any(b.allocated for b in seg.blocks()):
                keep.append(seg)
                continue
            for b in seg.blocks():
                self._remove_free(b)
            self.stats.reserved -= seg.size
            self.stats.reserved_by_stream[seg.stream] -= seg.size
            self.stats.segments -= 1
        self._segments = keep


@dataclass(frozen=True)
class Request:
    """One buffer of a trace: ``size`` bytes on ``stream``, allocated before step position
    ``born`` runs and freed after position ``last``."""

    size: int
    born: int
    last: int
    stream: str = "compute"


def replay(requests: list[Request], allocator: CachingAllocator) -> AllocatorStats:
    """Allocate and free ``requests`` in step order (at each position: its allocations in list
    order, then the frees of what was last read there) through ``allocator``."""
    if not requests:
        return allocator.stats
    born: dict[int, list[int]] = {}
    dies: dict[int, list[int]] = {}
    for k, r in enumerate(requests):
        born.setdefault(r.born, []).append(k)
        dies.setdefault(max(r.last, r.born), []).append(k)
    live: dict[int, _Block] = {}
    for pos in sorted(born.keys() | dies.keys()):  # the positions where something happens
        for k in born.get(pos, ()):
            live[k] = allocator.malloc(requests[k].size, requests[k].stream)
        for k in dies.get(pos, ()):
            allocator.free(live.pop(k))
    return allocator.stats
