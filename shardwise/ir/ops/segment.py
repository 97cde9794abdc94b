"""``shardwise::segment_set``: a no-op hint that forces a kernel boundary.

Semantics: ``segment_set(x) == x`` (the reference implementation returns a copy, since a custom op
may not alias its input). The segmenter (``passes/segment``) never merges the consumers of a
``segment_set`` into the segment that produces it, so its result crosses device memory; the
value itself is unchanged. It does no arithmetic: 0 FLOPs.
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import register_flop_formula


@torch.library.custom_op("shardwise::segment_set", mutates_args=())
def segment_set(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@segment_set.register_fake
def _segment_set_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@register_flop_formula(torch.ops.shardwise.segment_set)
def _segment_set_flop(*args, **kwargs) -> int:
    return 0
