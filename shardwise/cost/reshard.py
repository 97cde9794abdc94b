"""Cost of turning one placement tuple into another over a mesh, step by step as DTensor does it.

``reshard_cost(src, dst, global_shape, itemsize, topology)`` replays the plan of DTensor's
``redistribute`` (``torch/distributed/tensor/_redistribute.py``: the greedy
``generate_greedy_transform_infos``, the default for ``Shard``/``Replicate``/``Partial``) so the
collectives predicted here are the ones the lowering will emit:

1. On a 1-D mesh: one step, ``src[0] -> dst[0]``.
2. Otherwise, when the source is sharded, walk the mesh dims from inner to outer: a target
   ``Shard(d)`` whose tensor dim ``d`` is sharded by different outer mesh dims in ``src`` and
   ``dst`` (misaligned nested sharding) is first replicated; every other change happens there.
3. Then walk from outer to inner and finish the remaining changes.

Each step on mesh dim ``i`` with ``n = mesh_shape[i] > 1`` ranks, on the LOCAL tensor of that
moment (other dims' shards included):

    Partial -> Replicate      all_reduce      bytes = local tensor
    Shard   -> Replicate      all_gather      bytes = gathered output (local * n)
    Partial -> Shard          reduce_scatter  bytes = local input
    Shard(i) -> Shard(j)      all_to_all      bytes = local input (the lowering's, on every device
                                              type: DTensor's own on CPU is all_gather + chunk)
    Replicate -> Shard        local slice, free
    Replicate -> Partial      local (zeros on the other ranks), free
    Shard -> Partial, Partial(a) -> Partial(b), mixed partials: impossible, ``math.inf``

A tensor dim that does not divide evenly by its shards (at any step) is priced ``math.inf``: the
planner keeps to even shards, and DTensor's padded collectives move more than the bytes above.

The order of the mesh dims is ours to choose (``reshard_path``). DTensor's greedy plan reduces a
gradient that is partial over both dims of a (dp, tp) mesh, ``(P, P) -> (R, S(0))``, outer dim
first: an all_reduce over dp of the whole local tensor, then a reduce_scatter over tp. Reduced
over tp first, the slow dp link carries 1/tp of the bytes (Qwen2-7B over 8x8, an MLP weight's
gradient: 11.4 + 0.7 ms -> 0.7 + 1.4 ms), and the tp stream no longer waits behind the dp
reduction. Going through a placement that is neither end can be cheaper still: ``(R, S(0)) ->
(S(0), R)`` is an all_gather of the whole tensor over tp in DTensor's plan, and an all_to_all, a
slice and an all_gather of an eighth through hops (``hop_tree``). So a move is priced, and
lowered, as the cheaper of DTensor's one plan and the shortest path of ``redistribute`` calls
that each change one mesh dim; the lowering redistributes through the same intermediate
placements (``lower/spmd.py``), so the collectives priced are the ones run. The planner's
flow edges (``plan/ilp.py``) rely on it: a move's cost is a shortest path over such hops.
Not modelled: DTensor merging consecutive same-kind steps into one collective over a flattened
mesh, which it does only when the user has created that flattened mesh (``mesh._flatten``).
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from shardwise.cost.topology import MeshTopology
from shardwise.ir.match import CollectiveKind

Placements = tuple[Placement, ...]


@dataclass(frozen=True)
class CollectiveUse:
    kind: CollectiveKind
    mesh_dim: int
    bytes: int


@dataclass(frozen=True)
class ReshardCost:
    time_s: float
    collectives: tuple[CollectiveUse, ...] = ()

    @property
    def possible(self) -> bool:
        return self.time_s != math.inf


IMPOSSIBLE = ReshardCost(math.inf)
FREE = ReshardCost(0.0)
# A path of one redistribute per mesh dim replaces DTensor's one plan only when cheaper by this
# fraction: a rounding difference keeps DTensor's.
PATH_GAIN = 1e-9


@dataclass(frozen=True)
class Step:
    """One transform of DTensor's plan: ``mesh_dim`` goes from ``src`` to ``dst``."""

    mesh_dim: int
    src: Placement
    dst: Placement


def plan_steps(src: Placements, dst: Placements, mesh_shape: tuple[int, ...]) -> list[Step]:
    """DTensor's greedy transform plan (``generate_greedy_transform_infos``), placements only."""
    steps = _code_steps(_codes(src), _codes(dst), mesh_shape)
    return [Step(i, _placement(a), _placement(b)) for i, a, b in steps]


def _is_shard(c: object) -> bool:
    return type(c) is int and c >= 0


def _code_steps(src: tuple, dst: tuple, mesh_shape: tuple[int, ...]) -> list[tuple[int, object, object]]:
    """``plan_steps`` on placement codes (``_codes``): (mesh dim, from, to) each."""
    if len(mesh_shape) == 1:
        return [(0, src[0], dst[0])] if src[0] != dst[0] else []
    steps: list[tuple[int, object, object]] = []
    current = list(src)
    num_shards = math.prod(n for c, n in zip(src, mesh_shape, strict=True) if _is_shard(c))
    if num_shards > 1:
        for i in reversed(range(len(current))):
            want = dst[i]
            # nested sharding of the same tensor dim by outer mesh dims must agree
            if _is_shard(want) and ([j for j in range(i) if current[j] == want]
                                    != [j for j in range(i) if dst[j] == want]):
                want = _REPLICATE
            if current[i] != want:
                steps.append((i, current[i], want))
                current[i] = want
    for i, (cur, want) in enumerate(zip(current, dst, strict=True)):
        if cur != want:
            steps.append((i, cur, want))
            current[i] = want
    return steps


def normalise(ps: Placements, ndim: int) -> Placements | None:
    """``ps`` with every Shard dim non-negative; None where a dim is out of range or a
    placement is not priced (``_normal_codes``)."""
    codes = _normal_codes(ps, ndim)
    return None if codes is None else _placements(codes)


def makes_partial(src: Placements, dst: Placements) -> bool:
    """A move that makes some mesh dim ``Partial``: the lowering's local step, after the other
    dims have moved (``reshard_path``)."""
    for a, b in zip(src, dst, strict=True):
        if type(b) is Partial and a != b:
            return True
    return False


def local_shape(placements: Placements, global_shape: tuple[int, ...],
                mesh_shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """Per-rank shape under ``placements``; None when a shard does not divide evenly."""
    codes = _normal_codes(placements, len(global_shape))
    return None if codes is None else _local_shape(codes, tuple(global_shape), mesh_shape)


def _local_shape(codes: tuple, global_shape: tuple[int, ...],
                 mesh_shape: tuple[int, ...]) -> tuple[int, ...] | None:
    shape = list(global_shape)
    for c, n in zip(codes, mesh_shape, strict=True):
        if _is_shard(c):
            if shape[c] % n:
                return None
            shape[c] //= n
    return tuple(shape)


@functools.lru_cache(maxsize=1 << 20)
def reshard_path(src: Placements, dst: Placements, global_shape: tuple[int, ...], itemsize: int,
                 topology: MeshTopology) -> tuple[tuple[Placements, ...], ReshardCost]:
    """The cheapest way to redistribute from ``src`` to ``dst``: the placements it passes
    through (each reached by one DTensor ``redistribute``; the last is ``dst``) and its cost.
    DTensor's own plan in one ``redistribute`` unless a shortest path of hops that each change
    one mesh dim (``hop_tree``) is cheaper. A dim made ``Partial`` is the lowering's local step,
    after the other dims have moved (``lower/spmd._to_partial``): such a move's path ends with it,
    a hop of no collective."""
    s, d = _mesh_codes(src, global_shape, topology), _mesh_codes(dst, global_shape, topology)
    if s is None or d is None:
        return (tuple(dst),), IMPOSSIBLE
    hops, cost = _code_path(s, d, tuple(global_shape), itemsize, topology)
    return (tuple(dst),) if hops is None else tuple(_placements(c) for c in hops), cost


@functools.lru_cache(maxsize=1 << 20)
def _code_path(s: tuple, d: tuple, shape: tuple[int, ...], itemsize: int,
               topology: MeshTopology) -> tuple[tuple | None, ReshardCost]:
    """``reshard_path`` on normalised codes: the hops' codes (None: DTensor's one
    ``redistribute``) and the cost."""
    if _mixed_partials(s) or _mixed_partials(d):
        return None, IMPOSSIBLE
    best = _dtensor_cost(s, d, shape, itemsize, topology)
    if s == d:
        return None, best
    made = [i for i, (a, b) in enumerate(zip(s, d, strict=True)) if _is_partial(b) and a != b]
    if made:
        if not best.possible:  # Shard -> Partial, one reduction into another, an uneven shard
            return None, best
        # The lowering moves the other dims to their targets first, by this path, and then makes
        # these Partial locally, at no cost (``lower/spmd._to_partial``): a move's price is that
        # path's. A bf16 (4, 4, 256, 32) rotary half over 2x2 H100s, (R, S(0)) -> (P, S(1)):
        # an all_gather and a slice over tp, 9.2 us, not DTensor's all_to_all, 14.2 us.
        mid = tuple(_REPLICATE if i in made else b for i, b in enumerate(d))
        if mid == s:
            return None, best
        hops, cost = _code_path(s, mid, shape, itemsize, topology)
        return (*(hops or (mid,)), d), cost
    tree = hop_tree(s, shape, itemsize, topology)
    if d not in tree or not tree[d][0] < best.time_s * (1.0 - PATH_GAIN):
        return None, best  # on a tie DTensor's one redistribute is kept
    codes = [d]
    while tree[codes[-1]][1] != s:
        codes.append(tree[codes[-1]][1])
    hops = tuple(reversed(codes))
    uses = tuple(u for a, b in zip((s, *hops[:-1]), hops, strict=True)
                 for u in _dtensor_cost(a, b, shape, itemsize, topology).collectives)
    return hops, ReshardCost(tree[d][0], uses)


@functools.lru_cache(maxsize=1 << 16)
def hop_tree(src: tuple, global_shape: tuple[int, ...], itemsize: int,
             topology: MeshTopology) -> dict[tuple, tuple[float, tuple]]:
    """Shortest paths from ``src`` (normalised codes, ``_codes``) over hops that each change one
    mesh dim to ``Replicate`` or a ``Shard`` (one DTensor ``redistribute``, priced by
    ``_dtensor_cost``): placement -> (seconds, the placement before it), each as its codes.

    Moving one dim at a time can be much cheaper than DTensor's one plan. Over 8x8, that plan
    takes ``(R, S(0)) -> (S(0), R)`` by an all_gather of the whole tensor over tp; the hops
    all_to_all over tp to ``(R, S(1))``, slice over dp to ``(S(0), S(1))`` and gather an
    eighth over tp (2.75 -> 0.77 ms for a bf16 16 x 8192 x 4096 activation on h100). Ties keep
    the path of fewer hops. Each hop's cost is kept per shape and mesh for other sources'
    searches."""
    options = (_REPLICATE, *range(len(global_shape)))
    arcs = _arc_costs(global_shape, itemsize, topology)
    done: dict[tuple, tuple[float, tuple]] = {}
    heap = [(0.0, 0, 0, src, src)]
    order = itertools.count(1)
    while heap:
        t, n, _, at, before = heapq.heappop(heap)
        if at in done:
            continue
        done[at] = (t, before)
        for i, now in enumerate(at):
            for p in options:
                if p == now:
                    continue
                nxt = (*at[:i], p, *at[i + 1:])
                if nxt in done:
                    continue
                c = arcs.get((at, nxt))
                if c is None:
                    c = arcs[(at, nxt)] = _dtensor_cost(at, nxt, global_shape, itemsize, topology).time_s
                if c != math.inf:
                    heapq.heappush(heap, (t + c, n + 1, next(order), nxt, at))
    return done


@functools.lru_cache(maxsize=1 << 12)
def _arc_costs(global_shape: tuple[int, ...], itemsize: int, topology: MeshTopology) -> dict[tuple, float]:
    """``hop_tree``'s hop costs for one tensor on one mesh, (from, to) -> seconds, filled as its
    searches ask: a dict lookup is cheaper than ``_dtensor_cost``'s cache key, and the tables
    are bounded in number as that cache is."""
    return {}


# Placement codes: Shard(d) is d, Replicate this, Partial its reduce op's name. The cost model
# runs on codes: placement objects hash and compare in Python, slowly.
_REPLICATE = -1


def _codes(ps: Placements) -> tuple:
    """The codes of placements whose Shard dims are non-negative (``_normal_codes``)."""
    return tuple(p.dim if type(p) is Shard else _REPLICATE if type(p) is Replicate else p.reduce_op
                 for p in ps)


def _normal_codes(ps: Placements, ndim: int) -> tuple | None:
    """The codes of ``ps`` with every Shard dim taken modulo ``ndim``; None where a dim is out
    of range or a placement is not priced."""
    out = []
    for p in ps:
        kind = type(p)
        if kind is Shard:
            if not -ndim <= p.dim < ndim:
                return None
            out.append(p.dim % ndim)
        elif kind is Replicate:
            out.append(_REPLICATE)
        elif kind is Partial:
            out.append(p.reduce_op)
        else:  # _StridedShard and other placements: not priced
            return None
    return tuple(out)


def _mesh_codes(ps: Placements, global_shape: tuple[int, ...], topology: MeshTopology) -> tuple | None:
    """``_normal_codes`` of one placement per mesh dim; ValueError where ``ps`` has another count."""
    mesh = topology.mesh_shape
    if len(ps) != len(mesh):
        raise ValueError(f"placements {ps} do not match the {len(mesh)}-dim mesh {mesh}")
    return _normal_codes(ps, len(global_shape))


def _is_partial(c: object) -> bool:
    return type(c) is str


def _mixed_partials(codes: tuple) -> bool:
    return len({c for c in codes if _is_partial(c)}) > 1


def _placement(c: object) -> Placement:
    return Shard(c) if _is_shard(c) else Replicate() if c == _REPLICATE else Partial(c)


@functools.lru_cache(maxsize=1 << 16)
def _placements(codes: tuple) -> Placements:
    return tuple(_placement(c) for c in codes)


def move_times(srcs: Sequence[Placements], dsts: Sequence[Placements], global_shape: tuple[int, ...],
               itemsize: int, topology: MeshTopology) -> np.ndarray:
    """``reshard_cost``'s time of every move from one of ``srcs`` to one of ``dsts`` (inf where
    there is none, 0 from a placement to itself), as a (srcs, dsts) matrix: each placement's
    codes made once, not once per pair."""
    shape = tuple(global_shape)
    s_codes = [_mesh_codes(p, shape, topology) for p in srcs]
    d_codes = [_mesh_codes(q, shape, topology) for q in dsts]
    times = np.full((len(srcs), len(dsts)), math.inf)
    for i, s in enumerate(s_codes):
        for j, d in enumerate(d_codes):
            if srcs[i] is dsts[j]:
                times[i, j] = 0.0
            elif s is not None and d is not None:
                times[i, j] = _code_path(s, d, shape, itemsize, topology)[1].time_s
    return times


def move_hops(src: Placements, dst: Placements, global_shape: tuple[int, ...], itemsize: int,
              topology: MeshTopology) -> list[tuple[Placements, Placements, float]]:
    """The move ``reshard_path`` takes, hop by hop: (from, to, seconds), ``src`` and ``dst`` as
    given, the placements between them normalised. ValueError where there is no move."""
    shape = tuple(global_shape)
    s, d = _mesh_codes(src, shape, topology), _mesh_codes(dst, shape, topology)
    hops, cost = (None, IMPOSSIBLE) if s is None or d is None else _code_path(s, d, shape, itemsize, topology)
    if not cost.possible:
        raise ValueError(f"no move from {src} to {dst}")
    if hops is None:
        return [(tuple(src), tuple(dst), cost.time_s)]
    codes = (s, *hops)
    chain = (tuple(src), *(_placements(c) for c in hops[:-1]), tuple(dst))
    return [(a, b, _dtensor_cost(na, nb, shape, itemsize, topology).time_s)
            for a, b, na, nb in zip(chain, chain[1:], codes, codes[1:], strict=False)]


def reshard_cost(src: Placements, dst: Placements, global_shape: tuple[int, ...], itemsize: int,
                 topology: MeshTopology) -> ReshardCost:
    """Time and collectives of redistributing a tensor from ``src`` to ``dst`` placements, by the
    cheapest path (``reshard_path``)."""
    return reshard_path(src, dst, global_shape, itemsize, topology)[1]


def leaves_copies(dst: Placements) -> bool:
    """Whether a move to ``dst`` leaves copies a later move of the value may start from
    (``start_of_move``): not one to a placement with a ``Partial`` dim, which the lowering makes
    locally from the value as made."""
    return not any(isinstance(p, Partial) for p in dst)


def start_of_move(src: Placements, copies: Iterable[Placements], dst: Placements,
                  global_shape: tuple[int, ...], itemsize: int, topology: MeshTopology) -> Placements:
    """Where a move of a value to ``dst`` starts: of ``src`` (the value as made) and ``copies``
    (the placements earlier moves of it reached or passed through), the one cheapest to move
    from (``reshard_path``), ``src`` on a tie. The lowering, the step schedule and the
    node-by-node estimate all move so; the planner's ILP pays a hop once for all of a value's
    readers. Into a placement with a ``Partial`` dim, ``src`` (``leaves_copies``)."""
    if not leaves_copies(dst):
        return src
    best, cost = src, reshard_path(src, dst, global_shape, itemsize, topology)[1].time_s
    for p in copies:
        c = reshard_path(p, dst, global_shape, itemsize, topology)[1].time_s
        if c < cost:
            best, cost = p, c
    return best


@functools.lru_cache(maxsize=1 << 20)
def _dtensor_cost(s: tuple, d: tuple, global_shape: tuple[int, ...], itemsize: int,
                  topology: MeshTopology) -> ReshardCost:
    """Time and collectives of one DTensor ``redistribute`` from ``s`` to ``d`` (normalised
    codes, neither mixing two kinds of ``Partial``)."""
    mesh = topology.mesh_shape
    shape = _local_shape(s, global_shape, mesh)
    if shape is None or _local_shape(d, global_shape, mesh) is None:
        return IMPOSSIBLE
    current = list(s)
    uses: list[CollectiveUse] = []
    time_s = 0.0
    for dim, a, b in _code_steps(s, d, mesh):
        current[dim] = b
        new_shape = _local_shape(tuple(current), global_shape, mesh)
        if new_shape is None:
            return IMPOSSIBLE
        use = _step_collective(dim, a, b, mesh[dim], math.prod(shape) * itemsize)
        if use is IMPOSSIBLE:
            return IMPOSSIBLE
        shape = new_shape
        if use is not None:
            uses.append(use)
            time_s += topology.collective_time(use.kind, use.bytes, use.mesh_dim)
    return ReshardCost(time_s, tuple(uses))


def _step_collective(dim: int, a: object, b: object, n: int, local_bytes: int):
    """The collective one step on mesh ``dim`` from code ``a`` to ``b`` runs (None: a local op
    or a size-1 mesh dim; IMPOSSIBLE)."""
    if n == 1:  # DTensor skips every step on a size-1 mesh dim, before looking at the placements
        return None
    if _is_partial(b):
        if a == _REPLICATE:
            return None
        return IMPOSSIBLE  # Shard -> Partial, or one reduction into another
    if b == _REPLICATE:
        if _is_partial(a):
            return CollectiveUse(CollectiveKind.ALL_REDUCE, dim, local_bytes)
        return CollectiveUse(CollectiveKind.ALL_GATHER, dim, local_bytes * n)
    # target is Shard
    if _is_partial(a):
        return CollectiveUse(CollectiveKind.REDUCE_SCATTER, dim, local_bytes)
    if a == _REPLICATE:
        return None
    return CollectiveUse(CollectiveKind.ALL_TO_ALL, dim, local_bytes)
