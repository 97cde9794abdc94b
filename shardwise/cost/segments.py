"""Time of the kernels a segmentation emits, priced from the bytes they pass through memory.

    pointwise / reduction:  time = boundary_bytes / (mem_bw * mem_eff) + launch_s
    matmul:                 time = max(boundary_bytes / (mem_bw * mem_eff),
                                       flops / (peak(dtype) * compute_eff)) + launch_s
    view-only:              0  (no kernel is launched)
    collective:             0 here: its time is communication, priced by ``cost/comm.py``

A fused memory-bound kernel keeps its intermediates on chip, so its traffic is its boundary
bytes (``passes/segment``), not the sum of its nodes' reads and writes: this is what forwarding
and merging save. The hardware is passed in (``cost.hardware.get_hardware(name)``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardwise.passes.segment import SegClass, Segment, Segmentation

if TYPE_CHECKING:
    from shardwise.cost.hardware import Hardware

# Classes whose cost is not device-memory traffic (see the module docstring).
UNPRICED_CLASSES = frozenset({SegClass.VIEW, SegClass.COLLECTIVE})


def segment_time(seg: Segment, hw: Hardware) -> float:
    """Seconds one segment takes on ``hw`` (roofline on its boundary bytes and FLOPs)."""
    if seg.cls in UNPRICED_CLASSES:
        return 0.0
    t = hw.memory_time(seg.boundary_bytes)
    if seg.cls is SegClass.MATMUL and seg.dtype is not None:
        t = max(t, hw.flops_time(seg.flops, seg.dtype))
    return t + hw.launch_s


def segmentation_time(segmentation: Segmentation, hw: Hardware) -> float:
    """Seconds for all segments run one after another."""
    return sum(segment_time(s, hw) for s in segmentation.segments)


def memory_bound_time(segmentation: Segmentation, hw: Hardware) -> float:
    """Seconds of the memory-bound (non-matmul) segments: what forwarding and fusion reduce."""
    return sum(segment_time(s, hw) for s in segmentation.segments
               if s.cls in (SegClass.POINTWISE, SegClass.REDUCTION))
