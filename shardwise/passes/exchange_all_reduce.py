"""On gloo, an all_reduce over 2^k ranks runs as k pairwise exchanges (``runtime/exchange.py``).

The collective's launch and its wait become the exchange's ``start`` and ``finish``, at the same
places, so what ``sink_waits`` overlapped stays overlapped::

    before                                   after
      r = all_reduce_(flat, sum, grp)          p = start(flat, sum, grp, in_place=True, tag=0)
      a = f(...)                               a = f(...)
      y = wait(r)                              y = finish(p)

Safety: the value is the all_reduce's (the same sum, added in another order; the same bits on
every rank, see ``runtime/exchange.py``). Only a sum or a mean of a floating tensor (and a sum
of an integer one), over a gloo group whose size is a power of two, whose only reader is its
wait; an in-place all_reduce (``inplace_all_reduce``) reduces its buffer in place, a functional
one a copy. Every rank rewrites the same collectives, in the same order, with the same tags,
so the exchanges pair up. Other backends keep their collective (NCCL's all_reduce is the fast
path there). Its targets are Python functions: it rewrites a program bound to real process
groups (``parallelize(..., passes=("exchange_all_reduce",))``, ``train --passes``). Not one of
``RUNTIME_PASSES``: inside a whole training step on two ranks of a 2-core machine it was slower
than gloo's all_reduce (``passes/__init__.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import fx
from torch.distributed.distributed_c10d import _resolve_process_group

from shardwise.ir.match import Collective, CollectiveKind, all_collectives
from shardwise.runtime import exchange

c10d = torch.ops._c10d_functional


@dataclass(frozen=True)
class Exchange:
    reduce: Collective  # the all_reduce (functional or in place); its wait reads it alone
    in_place: bool


def _backend(group_name: str) -> str | None:
    try:
        return dist.get_backend(_resolve_process_group(group_name))
    except (RuntimeError, ValueError, KeyError):  # not a group of this process
        return None


def find(gm: fx.GraphModule, backends: Sequence[str] = ("gloo",)) -> list[Exchange]:
    out = []
    for c in all_collectives(gm.graph):
        if c.kind is not CollectiveKind.ALL_REDUCE or c.reduce_op not in exchange.REDUCE_OPS:
            continue
        val = c.input.meta.get("val")
        if not isinstance(val, torch.Tensor) or (c.reduce_op == "avg" and not val.dtype.is_floating_point):
            continue
        if c.wait is None or len(c.op.users) != 1:
            continue
        if not exchange.is_power_of_two(c.group_size or 0) or _backend(c.group_name) not in backends:
            continue
        out.append(Exchange(c, c.op.target is c10d.all_reduce_.default))
    return out


def apply(gm: fx.GraphModule, backends: Sequence[str] = ("gloo",)) -> int:
    """Rewrite each all_reduce over a group of ``backends``; returns the number rewritten."""
    matches = find(gm, backends)
    for tag, m in enumerate(matches):
        c = m.reduce
        with gm.graph.inserting_before(c.op):
            start = gm.graph.call_function(exchange.start,
                                           (c.input, c.reduce_op, c.group_name, m.in_place, tag))
        c.wait.target, c.wait.args = exchange.finish, (start,)
        gm.graph.erase_node(c.op)
    if matches:
        gm.recompile()
    return len(matches)
