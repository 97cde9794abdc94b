"""Gather into a buffer the program allocates: ``all_gather_into_tensor(x)`` ->
``all_gather_into_tensor_out(x, out=new_empty(x, [W * x.shape[0], ...]))``.

Why: on gloo, with PyTorch 2.13, c10d's allocating functional all_gather corrupts the heap when
several are in flight at once: a loop of six such gathers on two ranks, waited after the last,
aborted in malloc ("unaligned tcache chunk detected") within a few thousand steps in every run;
the same loop through the ``_out`` variant ran clean in each of its runs (3,000-4,000 steps),
as did one through ``dist.all_gather_into_tensor`` with its work registered (all_reduce and
reduce_scatter loops do not show it). A rank of ``shardwise train`` (auto plan, ``--ac full``)
once aborted with the same message in CI. ``sink_waits`` lets gathers run under the compute
that follows them, so a bound program must not depend on the allocating form being safe there::

    before                                   after
      g = all_gather_into_tensor(x, W, grp)    buf = new_empty(x, [W * n, ...])
                                               g = all_gather_into_tensor_out(x, W, grp, out=buf)
      y = wait_tensor(g)                       y = wait_tensor(g)

Safety: the ``_out`` variant computes the same value into ``buf`` and returns ``buf``, whose
wait is the one that was there; ``buf`` is fresh (``new_empty``: the input's dtype and device),
so no other op reads or writes it. The rewritten graph writes a buffer in place, so this is a
runtime pass: it runs after every pass that expects a functional graph.
"""

from __future__ import annotations

import torch
from torch import fx

from shardwise.ir.match import all_collectives
from shardwise.ir.meta import copy_meta, shape

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def find(gm: fx.GraphModule) -> list[fx.Node]:
    """The allocating all_gathers whose input's shape is known (static)."""
    return [c.op for c in all_collectives(gm.graph)
            if c.op.target is c10d.all_gather_into_tensor.default and shape(c.input) is not None]


def apply(gm: fx.GraphModule) -> int:
    """Give each allocating all_gather a buffer of its own; returns the number rewritten."""
    matches = find(gm)
    for op in matches:
        x, world, _group = op.args
        dims = list(shape(x))
        dims[0] *= int(world)
        with gm.graph.inserting_before(op):
            buf = gm.graph.call_function(aten.new_empty.default, (x, dims))
        copy_meta(buf, op)  # the same value: the gathered tensor
        op.target = c10d.all_gather_into_tensor_out.default
        op.kwargs = {"out": buf}
    if matches:
        gm.recompile()
    return len(matches)
