"""Collective-matmul fusion on graphs traced under a fake process group (numerics: tests/runtime)."""

from __future__ import annotations

import operator

import pytest
import torch
from torch import fx

from shardwise.errors import UserError
from shardwise.ir.flops import node_flops
from shardwise.ir.match import (
    einsum_is_matmul,
    gathered_value,
    gathered_values,
    matmul_at,
    matmuls_reading,
    piece_of,
    scattered_values,
)
from shardwise.mesh import ensure_fake_world
from shardwise.passes import collective_matmul as cm
from tests.passes import cm_graphs as g

AGM = torch.ops.shardwise.all_gather_matmul.default
MRS = torch.ops.shardwise.matmul_reduce_scatter.default
C10D = torch.ops._c10d_functional


def _fused(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in (AGM, MRS)]


def _collectives(gm: fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function"
               and getattr(n.target, "namespace", None) == "_c10d_functional")


def _matmuls(gm: fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function"
               and n.target in (torch.ops.aten.mm.default, torch.ops.aten.einsum.default))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", g.CASES, ids=g.case_id)
def test_fuses_exactly_the_expected_patterns(case: g.Case, world: int) -> None:
    ensure_fake_world(world)
    gm = g.trace_case(case, world)
    before = {"collectives": _collectives(gm), "matmuls": _matmuls(gm)}
    flops_before = sum(node_flops(n) for n in gm.graph.nodes)
    want = case.fusions(world)
    assert cm.apply(gm) == want
    fused = _fused(gm)
    assert len(fused) == want
    if want == 0:
        assert _collectives(gm) == before["collectives"] and _matmuls(gm) == before["matmuls"]
        return
    # The fused op replaced the collective (op + wait) and its matmuls, and counts the same FLOPs.
    assert _collectives(gm) == before["collectives"] - 2 * want
    assert sum(node_flops(n) for n in gm.graph.nodes) == flops_before
    for n in fused:
        assert n.meta["val"] is not None


def test_seed_functions_each_become_one_fused_op_at_world_2() -> None:
    ensure_fake_world(2)
    ag = g.trace_case(g.CASES[0], 2)
    assert cm.apply(ag) == 1
    (node,) = _fused(ag)
    # all_gather on dim 0 whose rank chunks are concatenated on dim 1 is an all_gather on dim 1.
    assert node.target is AGM and node.args[2] == 1
    assert not any(n.target in (torch.ops.aten.cat.default, torch.ops.aten.slice.Tensor)
                   for n in ag.graph.nodes if n.op == "call_function")
    rs = g.trace_case(g.CASES[1], 2)
    assert cm.apply(rs) == 1
    (node,) = _fused(rs)
    # dim-1 slices concatenated on dim 0 before a dim-0 reduce_scatter: a reduce_scatter on dim 1.
    assert node.target is MRS and node.args[2] == 1 and node.args[3] == "avg"


def test_seed_two_narrows_at_world_4_are_no_per_rank_reassembly() -> None:
    ensure_fake_world(4)
    gm = g.trace_case(g.CASES[0], 4)
    dims = sorted(m.dim for m in gathered_values(gm.graph))
    assert dims == [0]  # only the wait itself; the cat of two-rank spans is no all_gather
    assert cm.apply(gm) == 0


def test_several_matmuls_share_one_fused_op() -> None:
    ensure_fake_world(2)
    case = next(c for c in g.CASES if c.name == "ag_two_matmuls")
    gm = g.trace_case(case, 2)
    assert cm.apply(gm) == 1
    (node,) = _fused(gm)
    assert len(node.args[1]) == 2
    assert _matmuls(gm) == 0


def test_other_readers_of_the_gathered_value_read_the_fused_output() -> None:
    ensure_fake_world(2)
    case = next(c for c in g.CASES if c.name == "ag_matmul_and_other_reader")
    gm = g.trace_case(case, 2)
    assert cm.apply(gm) == 1
    (node,) = _fused(gm)
    first = [u for u in node.users if u.args[1] == 0]
    assert len(first) == 1 and any(u.target is torch.ops.aten.mul.Tensor for u in first[0].users)


def test_unused_gathered_value_is_not_kept() -> None:
    ensure_fake_world(2)
    gm = g.trace_case(g.CASES[2], 2)
    cm.apply(gm)
    (node,) = _fused(gm)
    assert [u.args[1] for u in node.users] == [1]


def test_other_operand_producers_move_before_the_fused_node() -> None:
    ensure_fake_world(2)

    def f(x, w):
        y = g._ag(x, 0)
        z = torch.relu(y)  # an earlier reader of the gathered value
        return z, y @ (w * 2.0)  # w * 2 is traced after relu(y)

    gm = g.make_fx(f, tracing_mode="fake")(torch.empty(g.R, g.K), torch.empty(g.K, g.N))
    assert cm.apply(gm) == 1
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    (node,) = _fused(gm)
    b = node.args[1][0]
    assert b.target is torch.ops.aten.mul.Tensor and order[b] < order[node]


def test_reduce_scatter_input_with_other_readers_is_left_alone() -> None:
    ensure_fake_world(2)
    case = next(c for c in g.CASES if c.name == "rs_input_with_other_user")
    gm = g.trace_case(case, 2)
    (s,) = scattered_values(gm.graph)
    m = matmul_at(s.input_value)
    assert m is not None and not cm.scatter_input_private(m, s)
    assert cm.apply(gm) == 0


def test_b_that_reads_the_gather_is_refused() -> None:
    ensure_fake_world(2)
    case = next(c for c in g.CASES if c.name == "ag_b_depends_on_gather")
    gm = g.trace_case(case, 2)
    (gm_match,) = [m for m in gathered_values(gm.graph) if matmuls_reading(m.value_node)]
    (mm,) = matmuls_reading(gm_match.value_node)
    assert not cm.b_independent_of_gather(mm, gm_match)


def test_reassembly_with_outside_reader_is_not_private() -> None:
    ensure_fake_world(2)

    def f(x, w):
        y = g._ag(x, 0)
        z = torch.cat([y.narrow(0, 0, g.R), y.narrow(0, g.R, g.R)], dim=1)
        return z @ w, y.narrow(0, 0, g.R) + 1.0  # the wait is read outside the reassembly

    gm = g.make_fx(f, tracing_mode="fake")(torch.empty(g.R, g.K), torch.empty(2 * g.K, g.N))
    match = next(m for m in gathered_values(gm.graph) if m.dim == 1)
    assert not cm.reassembly_private(match)
    assert cm.apply(gm) == 0


@pytest.mark.parametrize("eq, expected", [
    ("bsk,kn->bsn", False), ("mk,kn->mn", False), ("bsk,nk->bsn", True),
    ("bsk,kn->bns", None), ("bsk,bkn->bsn", None), ("bsn,bsk->nk", None), ("...k,kn->...n", None),
])
def test_einsum_is_matmul(eq: str, expected: bool | None) -> None:
    assert einsum_is_matmul(eq) is expected


@pytest.mark.parametrize("eq, expected", [
    ("bsn,bsk->nk", True), ("sn,sk->nk", True), ("bsn,bsk->kn", False), ("bsn,bsn->nn", False),
    ("bsk,kn->bsn", False), ("bsn,btk->nk", False), ("...n,...k->nk", False),
])
def test_einsum_is_weight_grad(eq: str, expected: bool) -> None:
    """The weight-gradient form that lowering runs as one mm of the operands flattened to 2-D."""
    from shardwise.ir.match import einsum_is_weight_grad

    assert einsum_is_weight_grad(eq) is expected
    if expected:
        a, b = torch.randn(2, 3, 4), torch.randn(2, 3, 5)
        a, b = (a[0], b[0]) if len(eq.split(",")[0]) == 2 else (a, b)
        want = torch.einsum(eq, a, b)
        torch.testing.assert_close(a.flatten(0, -2).t() @ b.flatten(0, -2), want)


def test_group_is_fusable() -> None:
    assert cm.group_is_fusable(2) and cm.group_is_fusable(8)
    assert not cm.group_is_fusable(1) and not cm.group_is_fusable(None)


def test_pieces_of_slices_and_splits() -> None:
    def f(x):
        return (x.narrow(1, 2, 2), x[:, -2:], torch.split(x, [1, 3], 1)[1], torch.chunk(x, 2, 0)[1],
                x[:, ::2])

    gm = g.make_fx(f, tracing_mode="fake")(torch.empty(4, 4))
    outs = list(gm.graph.output_node().args[0])
    got = [(p.dim, p.start, p.length) if (p := piece_of(o)) else None for o in outs]
    assert got == [(1, 2, 2), (1, 2, 2), (1, 1, 3), (0, 2, 2), None]


def test_gathered_value_dims_for_every_gather_form() -> None:
    ensure_fake_world(2)
    for dim in (0, 1, 2):
        shapes = lambda w, dim=dim: [(2, g.R, g.K), (g.K * (w if dim == 2 else 1), g.N)]
        for case in (g.Case(g.ag_matmul(dim), shapes, g._always(1)),
                     g.Case(g.ag_einsum(dim), shapes, g._always(1), True)):
            gm = g.trace_case(case, 2)
            reader = next(n for n in gm.graph.nodes if n.target in (torch.ops.aten.view.default,
                                                                    torch.ops.aten.einsum.default))
            value = reader.args[0] if reader.target is torch.ops.aten.view.default else reader.args[1][0]
            match = gathered_value(value)
            assert match is not None and match.dim == dim and match.group_size == 2


def test_scattered_value_dims_for_every_scatter_form() -> None:
    ensure_fake_world(2)
    for dim in (0, 1, 2):
        gm = g.trace_case(g.Case(g.matmul_rs(dim), lambda w: [(2, 2, g.K), (g.K, g.N)], g._always(1)), 2)
        (s,) = scattered_values(gm.graph)
        assert s.dim == dim and s.input_value.target is torch.ops.aten._unsafe_view.default


def test_fused_node_keeps_meta_and_seq_nr() -> None:
    ensure_fake_world(2)
    gm = g.trace_case(g.CASES[2], 2)
    mm = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.mm.default)
    mm.meta["seq_nr"] = 123
    cm.apply(gm)
    (node,) = _fused(gm)
    assert node.meta["seq_nr"] == 123
    out = next(u for u in node.users if u.target is operator.getitem and u.args[1] == 1)
    assert out.meta["val"].shape == mm.meta["val"].shape


def test_unknown_impl_is_a_user_error() -> None:
    ensure_fake_world(2)
    gm = g.trace_case(g.CASES[2], 2)
    with pytest.raises(UserError, match="impl"):
        cm.apply(gm, impl="fastest")


# --- cost: the fused op is priced with overlap ---------------------------------------------------

def test_overlapped_time_is_max_of_comm_and_compute_plus_one_chunk() -> None:
    from shardwise.cost.overlap import overlapped_time

    world = 4
    # Compute-bound: every hop hides behind a chunk's matmul; total = the matmuls.
    assert overlapped_time(1.0, 0.3, world) == pytest.approx(4.0)
    # Communication-bound: the hops, plus the last chunk's matmul that nothing hides.
    assert overlapped_time(0.1, 3.0, world) == pytest.approx(3.0 + 0.1)
    assert overlapped_time(0.5, 1.0, 1) == pytest.approx(1.5)  # no ring, no overlap


@pytest.mark.parametrize("name", ["ag0_matmul", "matmul_rs1"])
def test_fused_node_priced_between_max_and_sum_on_h100(name: str) -> None:
    from shardwise.cost.hardware import get_hardware
    from shardwise.cost.overlap import fused_node_estimate

    ensure_fake_world(8)
    hw = get_hardware("h100")
    big = 4096
    case = next(c for c in g.CASES if c.name == name)
    shapes = [(big // 8, big), (big, big)] if name.startswith("ag") else [(big, big), (big, big)]
    gm = g.make_fx(case.fn, tracing_mode="fake")(*(torch.empty(s, dtype=torch.bfloat16) for s in shapes))
    assert cm.apply(gm) == 1
    (node,) = _fused(gm)
    est = fused_node_estimate(node, hw)
    assert est is not None and est.comm_s > 0 and est.compute_s > 0
    assert max(est.comm_s, est.compute_s) <= est.time_s < est.unfused_s
    assert est.time_s <= max(est.comm_s, est.compute_s) + est.chunk_compute_s * (1 + 1e-9)
    assert fused_node_estimate(next(iter(gm.graph.nodes)), hw) is None  # a placeholder
