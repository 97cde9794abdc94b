"""Fused collective-matmul programs against the unfused ones on real gloo groups (2 and 4 ranks)."""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch

from shardwise.runtime.collective_matmul import Impl, collective_matmul_impl, resolve_impl
from tests.helpers import spawn

# fp32: the ring sums partial products in another order than one matmul / one reduce_scatter.
MAX_REL_ERR = 1e-5


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (0 for two empty or all-zero tensors)."""
    scale = want.abs().max().item() if want.numel() else 0.0
    diff = (got - want).abs().max().item() if want.numel() else 0.0
    return diff / scale if scale else diff


def _flat(out) -> list[torch.Tensor]:
    return list(out) if isinstance(out, list | tuple) else [out]


def traced_cases(world: int) -> bytes:
    """Every fusable case traced once (here, under a fake group of ``world`` ranks) and fused:
    pickled ``[(name, shapes, fusions expected, fusions made, group name, original, fused)]``.
    Tracing here rather than on every rank keeps the multi-process test fast."""
    from shardwise.mesh import ensure_fake_world
    from shardwise.passes import collective_matmul as cm
    from tests.passes import cm_graphs as g

    ensure_fake_world(world)
    group = torch.distributed.group.WORLD.group_name
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        for case in g.CASES:
            if case.fusions(world) == 0:
                continue
            ref = g.trace_case(case, world)
            fused = copy.deepcopy(ref)
            made = cm.apply(fused)
            for gm in (ref, fused):  # fake values stay here; the code is what runs
                for n in gm.graph.nodes:
                    n.meta.clear()
                gm._tracer_cls = None  # rebuild with the plain fx tracer when unpickled
            out.append((f"{case.name}/{len(case.shapes(world)[0])}d", case.shapes(world), case.fusions(world),
                        made, group, ref, fused))
    return pickle.dumps(out)


GROUP_OPS_NAMESPACES = ("_c10d_functional", "shardwise")


def _retarget(gm, old: str, new: str):
    """Point the graph's collectives at group ``new`` instead of ``old`` (the traced group)."""
    for n in gm.graph.nodes:
        if n.op == "call_function" and getattr(n.target, "namespace", None) in GROUP_OPS_NAMESPACES:
            n.args = tuple(new if a == old else a for a in n.args)
    gm.recompile()
    return gm


def _check_cases(rank: int, group, cases: bytes) -> list[tuple[str, int, int, float, float]]:
    """Per fusable case: (name, fusions expected, fusions made, max rel err of the fused graph with
    the ring implementation, and with the unfused implementation) against the original graph."""
    import shardwise.ir.ops  # noqa: F401  (the fused graphs call torch.ops.shardwise.*)

    results = []
    for name, shapes, want, made, traced_group, ref, fused in pickle.loads(cases):
        ref, fused = (_retarget(gm, traced_group, group.group_name) for gm in (ref, fused))
        gen = torch.Generator().manual_seed(1234)  # the same weights on every rank
        inputs = [torch.randn(shapes[0], generator=torch.Generator().manual_seed(100 + rank))]
        inputs += [torch.randn(s, generator=gen) for s in shapes[1:]]
        expected = _flat(ref(*inputs))
        ring = _flat(fused(*inputs))
        with collective_matmul_impl(Impl.UNFUSED):
            unfused = _flat(fused(*inputs))
        err_ring = max(rel_err(a, b) for a, b in zip(ring, expected, strict=True))
        err_unfused = max(rel_err(a, b) for a, b in zip(unfused, expected, strict=True))
        results.append((name, want, made, err_ring, err_unfused))
    return results


def _check_direct_ops(rank: int, group) -> list[tuple[str, float]]:
    """The ops called directly on other shapes (several rows per chunk, two bs), ring vs unfused."""
    from shardwise.runtime import collective_matmul as rt

    world, name = group.size(), group.group_name
    gen = torch.Generator().manual_seed(7 + rank)
    out = []
    for gather_dim in (0, 1, 2):
        a = torch.randn(3, 5, 6, generator=gen)
        k = 6 * world if gather_dim == 2 else 6
        bs = [torch.randn(k, 7, generator=torch.Generator().manual_seed(1)), torch.randn(k, 3)]
        ring = rt.all_gather_matmul(a, bs, gather_dim, name, world, rt.Impl.RING)
        ref = rt.all_gather_matmul(a, bs, gather_dim, name, world, rt.Impl.UNFUSED)
        out.append((f"all_gather_matmul dim {gather_dim}", max(map(rel_err, ring, ref))))
    for scatter_dim in (0, 1, 2):
        a = torch.randn(2 * world, 3 * world, 5, generator=gen)
        b = torch.randn(5, 2 * world, generator=torch.Generator().manual_seed(2))
        for op in rt.ReduceOp:
            ring = rt.matmul_reduce_scatter(a, b, scatter_dim, op, name, world, rt.Impl.RING)
            ref = rt.matmul_reduce_scatter(a, b, scatter_dim, op, name, world, rt.Impl.UNFUSED)
            out.append((f"matmul_reduce_scatter dim {scatter_dim} {op.value}", rel_err(ring, ref)))
    return out


def _check_tp_llama(rank: int, group) -> tuple[int, int, float]:
    """The hand-written tensor-parallel llama-tiny forward, after sequence_parallel then
    collective_matmul: (fusions made, projections, max rel err of the logits vs the original)."""
    from shardwise.models import get_model
    from shardwise.passes import collective_matmul as cm
    from tests.passes import sp_graphs as G
    from tests.passes.test_sequence_parallel import tp_programs

    ref, gm, _, args = tp_programs("llama-tiny", rank, group.size(), group.group_name)
    made = cm.apply(gm)
    layers = get_model("llama-tiny").build_module().cfg.n_layers
    # Per layer: q/k/v share one all_gather, w1/w3 another; wo and w2 reduce_scatter; plus the
    # output projection. (The embedding's reduce_scatter follows no matmul.)
    projections = 4 * layers + 1
    return made, projections, G.max_rel_err(ref(*args), gm(*args))


def _worker(rank: int, world: int, by_size: dict[int, bytes]) -> dict[int, tuple[list, list]]:
    """On a world of 4 ranks: the 4-rank cases on WORLD, the 2-rank cases on a group of ranks 0, 1
    (one spawn for both sizes; a 2-rank group inside a larger world also checks that the ring
    addresses its peers by global rank)."""
    import torch.distributed as dist

    groups = {world: dist.group.WORLD, 2: dist.new_group([0, 1])}  # every rank creates every group
    out = {}
    for size, cases in by_size.items():
        group = groups[size]
        if rank < size:
            out[size] = (_check_cases(rank, group, cases), _check_direct_ops(rank, group))
        dist.barrier()
    if rank < TP_LLAMA_RANKS:
        out["llama"] = _check_tp_llama(rank, groups[TP_LLAMA_RANKS])
    return out


WORLDS = (2, 4)
TP_LLAMA_RANKS = 2  # one TP size is enough here; the other size is the sequence-parallel test's


@pytest.mark.slow
def test_fused_programs_match_unfused_on_gloo() -> None:
    per_rank = spawn(_worker, max(WORLDS), {w: traced_cases(w) for w in WORLDS})
    for world in WORLDS:
        for rank in range(world):
            cases, direct = per_rank[rank][world]
            assert len(cases) >= 20, cases  # every fusable form ran
            for name, want, made, err_ring, err_unfused in cases:
                assert made == want, (world, rank, name, made)
                assert err_ring <= MAX_REL_ERR, (world, rank, name, err_ring)
                assert err_unfused <= MAX_REL_ERR, (world, rank, name, err_unfused)
            for name, err in direct:
                assert err <= MAX_REL_ERR, (world, rank, name, err)
    for rank in range(TP_LLAMA_RANKS):
        made, projections, err = per_rank[rank]["llama"]
        assert made == projections and err <= MAX_REL_ERR, (rank, made, projections, err)


def test_impl_switch_context_manager_wins_over_the_recorded_impl() -> None:
    t = torch.empty(2)
    assert resolve_impl(Impl.RING, t, "0") is Impl.RING
    assert resolve_impl(Impl.AUTO, t, "0") is Impl.RING  # no symmetric memory on CPU
    with collective_matmul_impl(Impl.UNFUSED):
        assert resolve_impl(Impl.RING, t, "0") is Impl.UNFUSED
        with collective_matmul_impl(Impl.RING):
            assert resolve_impl(Impl.UNFUSED, t, "0") is Impl.RING
        assert resolve_impl(Impl.AUTO, t, "0") is Impl.UNFUSED
    assert resolve_impl(Impl.UNFUSED, t, "0") is Impl.UNFUSED


def test_symm_mem_on_cpu_says_what_to_use_instead() -> None:
    with pytest.raises(RuntimeError, match="Impl.RING"):
        resolve_impl(Impl.SYMM_MEM, torch.empty(2), "0")
