"""Python's cyclic garbage collector paused while the compiler traces, plans and schedules a step.

Tracing and planning allocate millions of small objects (fx nodes, placements, the ILP's terms,
the schedule's events), most of which live to the end of the step. CPython's collector counts
allocations and traverses its young generations every few hundred, and every tracked object
every so often: time that frees next to nothing here, as reference counting frees what dies.
On leaving the outermost block, what it made is promoted to the oldest generation untraversed
(``gc.freeze`` then ``gc.unfreeze``), so that the next young collection does not walk all of it
at once; cycles among it are freed by a later full collection. Where the process keeps frozen
objects of its own, the block leaves them so and skips the promotion.

Measured on this project's 2-core machine (stop 55; the planner froze the heap while it planned
before, ``gc.freeze``): the collector's time over a whole run of ``benchmarks/plan.py``'s cases
(trace, plan, then more allocation), llama3-8b 2 layers 1.50 -> 0.70 s (what is left is torch's
import), 32 layers 2.65 -> 0.78 s, llama3-70b 4.22 -> 0.66 s; the 32-layer plan 7.8 -> 6.1 s and
70B's 28.8 -> 24.9 s, peak RSS 0.52 -> 0.53 and 0.79 -> 0.79 GiB (one run each, alternating);
``shardwise estimate`` of llama3-70b's fsdp_tp plan with full checkpointing 6.33-6.45 -> 5.70-5.76 s
(the step schedule paused too), its output the same.
PyTorch's distributed checkpointing pauses the collector for the same reason
(``torch.distributed.checkpoint.state_dict``).

``paused_gc()`` is a context manager and a decorator; nested uses leave the collector to the
outermost, which restores the state it found, also on error.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """No cyclic garbage collection in the block (or the decorated function)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            if not gc.get_freeze_count():
                # What the block made is young still: promote it to the oldest generation
                # untraversed (freeze, then unfreeze into it), or the next young collection
                # would walk all of it at once.
                gc.freeze()
                gc.unfreeze()
            gc.enable()
