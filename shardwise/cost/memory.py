"""The memory of a step: its buffers' lifetimes, the allocated peak and what is alive there, and
the reserved peak of PyTorch's caching allocator replaying them.

``cost/schedule.py`` lays the step out and says, for every buffer, its size, the stream whose
pool it comes from and the schedule items from its allocation to its last reader (a
``Lifetime``); this module turns those into figures:

- ``peak_live``: the most bytes alive at once (allocated; the static state added by the caller)
  and where;
- ``breakdown``: what is alive there, by category (``MemoryCategory``), and the largest buffers;
- ``reserved_peak``: the buffers of ``ALLOCATOR_STEPS`` steps replayed through
  ``cost/allocator.py``: the parameters allocated first, the optimizer's moments made at the
  first optimizer step (``torch.optim`` creates them lazily), then each step's buffers in
  order. Reserved bytes are what ``torch.cuda.max_memory_reserved`` reads and what OOMs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardwise.plan.cluster import HEAD, TAIL

# How many training steps the allocator replay runs: the first allocates the optimizer state
# lazily (``torch.optim`` makes Adam's moments at its first step) into memory the step cached,
# the next ones reach the steady state torchtitan reads its figures in (step 90).
ALLOCATOR_STEPS = 3
# Adam(W) keeps two moments per parameter, each its own tensor (exp_avg, exp_avg_sq).
ADAM_STATES = 2


class MemoryCategory:
    """What a live buffer is, for the peak's breakdown."""

    STATIC = "static"                     # parameters and optimizer state, all step long
    GRADS = "grads"                       # stored (reduced) gradients, until the optimizer step
    GATHERED_PARAMS = "gathered_params"   # parameters moved to the placement a reader needs
    SAVED = "saved_activations"           # forward values the backward reads
    TRANSIENT = "transients"              # everything else: values between producer and reader
    ALL = (GRADS, GATHERED_PARAMS, SAVED, TRANSIENT)


# How many of the largest live buffers the breakdown lists.
BREAKDOWN_LARGEST = 8


@dataclass(frozen=True)
class Lifetime:
    """One buffer of the step: allocated before item ``born`` runs, freed after item ``last``."""

    name: str
    category: str
    size: int
    born: int
    last: int
    stream: str = "compute"


@dataclass(frozen=True)
class MemoryBreakdown:
    """The allocated peak and what is alive there: the node running at the peak (its phase and
    region) and the bytes per category; ``largest``: (name, category, bytes) of the biggest."""

    at: str
    phase: str
    region: int
    static_bytes: int
    grads_bytes: int
    gathered_params_bytes: int
    saved_activations_bytes: int
    transients_bytes: int
    largest: list[tuple[str, str, int]] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return (self.static_bytes + self.grads_bytes + self.gathered_params_bytes
                + self.saved_activations_bytes + self.transients_bytes)

    def to_json(self) -> dict:
        region = ("head" if self.region == HEAD else "tail" if self.region == TAIL
                  else f"layer {self.region}")
        return {"at": self.at, "phase": self.phase, "region": region,
                "static_bytes": self.static_bytes, "grads_bytes": self.grads_bytes,
                "gathered_params_bytes": self.gathered_params_bytes,
                "saved_activations_bytes": self.saved_activations_bytes,
                "transients_bytes": self.transients_bytes, "total_bytes": self.total_bytes,
                "largest": [{"name": n, "category": c, "bytes": b} for n, c, b in self.largest]}



def peak_live(lifetimes: list[Lifetime], n_items: int) -> tuple[int, int]:
    """The most bytes alive at once over items ``0 .. n_items``, and the item where that happens."""
    delta = [0] * (n_items + 2)
    for lt in lifetimes:
        delta[lt.born] += lt.size
        delta[lt.last + 1] -= lt.size
    live = peak = at = 0
    for i, d in enumerate(delta):
        live += d
        if live > peak:
            peak, at = live, i
    return peak, at


def breakdown(lifetimes: list[Lifetime], at: int, static: int, node: str, phase: str,
              region: int) -> MemoryBreakdown:
    """What is alive at item ``at`` (running ``node``), by category, and the largest buffers."""
    live = [lt for lt in lifetimes if lt.born <= at <= lt.last]
    by_cat = {c: sum(lt.size for lt in live if lt.category == c) for c in MemoryCategory.ALL}
    top = sorted(live, key=lambda lt: -lt.size)[:BREAKDOWN_LARGEST]
    return MemoryBreakdown(
        at=node, phase=phase, region=region, static_bytes=static,
        grads_bytes=by_cat[MemoryCategory.GRADS],
        gathered_params_bytes=by_cat[MemoryCategory.GATHERED_PARAMS],
        saved_activations_bytes=by_cat[MemoryCategory.SAVED],
        transients_bytes=by_cat[MemoryCategory.TRANSIENT],
        largest=[(lt.name, lt.category, lt.size) for lt in top])


def reserved_peak(lifetimes: list[Lifetime], params: list[int], states: list[int], n_items: int,
                  capacity: float, expandable_segments: bool) -> tuple[int, dict[str, int]]:
    """The caching allocator's peak reserved bytes, and what each stream's pool holds at the
    end, over ``ALLOCATOR_STEPS`` steps of ``lifetimes`` (items ``0 .. n_items``, the optimizer
    at ``n_items``); ``params``: the stored parameter tensors, allocated first; ``states``: the
    optimizer's, allocated at the first optimizer step before its temporaries."""
    from shardwise.cost.allocator import CachingAllocator, Request, replay

    period = n_items + 2
    forever = period * ALLOCATOR_STEPS
    ordered = sorted(lifetimes, key=lambda lt: lt.born)
    reqs = [Request(b, -1, forever) for b in params]
    for step in range(ALLOCATOR_STEPS):
        base = step * period
        step_reqs = [Request(lt.size, lt.born + base, lt.last + base, lt.stream) for lt in ordered]
        if step == 0:
            k = sum(1 for lt in ordered if lt.born < n_items)
            step_reqs[k:k] = [Request(b, n_items + base, forever) for b in states]
        reqs += step_reqs
    stats = replay(reqs, CachingAllocator(expandable_segments=expandable_segments, capacity=int(capacity)))
    return stats.peak_reserved, dict(stats.reserved_by_stream)
