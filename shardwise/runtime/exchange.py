"""An all_reduce as pairwise exchanges (recursive doubling), for gloo.

Over a group of W = 2^k ranks, round j sends the whole buffer to the rank whose group index
differs in bit j, receives that rank's buffer, and adds it. After k rounds every rank holds the
sum, and the same bits on every rank: in each round both partners add the same two values, and
``a + b == b + a`` in floating point. The first round is launched with the collective and runs
under the compute that follows (gloo's transport thread moves the bytes); ``finish`` waits for it,
adds, and runs the remaining rounds.

Why: a step whose last gradient bucket is reduced after the backward waits for that
all_reduce (DDP's as well), and on two ranks of one host gloo's all_reduce of a 0.1-1 MiB bucket
took 2-4 ms inside a training step where one exchange and an add take well under half of it
(``benchmarks/exchange.py`` compares the two on their own). Inside a whole step on two ranks of
a 2-core machine, though, the step was ~10% slower with the exchanges than with gloo's
all_reduce, so the pass is one a user asks for, not a default (``passes/__init__.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

# c10d functional reduce-op names this all_reduce computes.
REDUCE_OPS = ("sum", "avg")


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclass
class Pending:
    """An exchange in flight: the buffer being reduced, the partner's copy arriving into
    ``incoming``, and the round it belongs to."""

    buffer: torch.Tensor
    incoming: torch.Tensor
    works: list
    group: dist.ProcessGroup
    round: int
    average: bool
    tag: int


def _exchange(p: Pending) -> None:
    """Launch round ``p.round``: send the buffer to the partner, receive the partner's."""
    partner = p.group.rank() ^ (1 << p.round)
    p.works = [dist.isend(p.buffer, group=p.group, group_dst=partner, tag=p.tag),
               dist.irecv(p.incoming, group=p.group, group_src=partner, tag=p.tag)]


def start(x: torch.Tensor, reduce_op: str, group_name: str, in_place: bool, tag: int) -> Pending:
    """Launch ``all_reduce(x, reduce_op)`` over the group: ``x`` itself is reduced where
    ``in_place`` (the caller's buffer is private), else a copy. ``tag`` tells this exchange's
    messages from those of others in flight between the same ranks."""
    group = _resolve_process_group(group_name)
    buffer = x if in_place else x.clone(memory_format=torch.contiguous_format)
    p = Pending(buffer, torch.empty_like(buffer), [], group, 0, reduce_op == "avg", tag)
    if group.size() > 1:
        _exchange(p)
    return p


def finish(p: Pending) -> torch.Tensor:
    """Wait for the exchange and finish the reduction: the all_reduce's value."""
    size = p.group.size()
    while (1 << p.round) < size:
        for w in p.works:
            w.wait()
        p.buffer.add_(p.incoming)
        p.round += 1
        if (1 << p.round) < size:
            _exchange(p)
    if p.average:
        p.buffer.div_(size)
    return p.buffer
