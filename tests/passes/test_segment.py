"""Kernel segmentation on tiny make_fx graphs: merging, segment_set, the three forwarding rules
and their refusals, bad input. Every segmentation that can run is run against the graph."""

from __future__ import annotations

import pytest
import torch
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx

import shardwise.ir.ops  # noqa: F401  (torch.ops.shardwise.segment_set)
from shardwise.errors import UnsupportedGraph
from shardwise.passes.segment import SegClass, Segmentation, segment
from shardwise.passes.segment.classify import is_degenerate_reduce, node_class
from shardwise.passes.segment.forwarding import is_output_aliased
from shardwise.passes.segment.merge import FuseState, fuse_state

aten = torch.ops.aten
seg_set = torch.ops.shardwise.segment_set
N = 8


def fx_graph(fn, *shapes: tuple[int, ...]) -> fx.GraphModule:
    return make_fx(fn, tracing_mode="fake")(*(torch.randn(s) for s in shapes))


def node(gm: fx.GraphModule, target) -> fx.Node:
    return next(n for n in gm.graph.nodes if n.op == "call_function" and n.target == target)


def assert_runs_like_graph(s: Segmentation, *shapes: tuple[int, ...]) -> None:
    args = [torch.randn(sh) for sh in shapes]
    want, got = s.gm(*args), s.run(*args)
    want = want if isinstance(want, (tuple, list)) else [want]
    got = got if isinstance(got, (tuple, list)) else [got]
    assert len(want) == len(got)
    for w, g in zip(want, got, strict=True):
        assert torch.equal(w, g)


def crosses_boundary(s: Segmentation, n: fx.Node) -> bool:
    return any(n in seg.inputs or n in seg.outputs for seg in s.segments)


def assert_well_formed(s: Segmentation) -> None:
    """Each computed node owned once; segments in a dependency order; one class each."""
    owned = [n for seg in s.segments for n in seg.nodes]
    assert len(owned) == len(set(owned))
    computed = {n for n in s.gm.graph.nodes if n.op == "call_function"} - set(s.forwarding.kinds)
    assert set(owned) == computed
    ready = {n for n in s.gm.graph.nodes if n.op in ("placeholder", "get_attr")}
    for seg in s.segments:
        assert set(seg.inputs) <= ready, f"segment {seg.index} reads a value computed later"
        ready |= set(seg.outputs)
        classes = {node_class(n) for n in seg.nodes} - {SegClass.VIEW}
        assert classes <= {seg.cls} | ({SegClass.POINTWISE} if seg.cls is SegClass.REDUCTION else set())


# --- factory forwarding (the acceptance case) ------------------------------------------


def _factory(x):
    t1 = torch.full([N], 1.0)
    t2 = x + t1
    t3 = seg_set(t2)
    return t3 + t1


def test_factory_is_recomputed_in_each_segment():
    gm = fx_graph(_factory, (N,))
    s = segment(gm)
    full = node(gm, aten.full.default)
    assert len(s.segments) == 2
    assert all(full in seg.forwarded for seg in s.segments)
    assert not crosses_boundary(s, full)
    assert s.forwarded == {"unary": 0, "factory": 1, "broadcast": 0}
    assert s.boundary_bytes < segment(gm, forwarding=False).boundary_bytes
    assert_well_formed(s)
    assert_runs_like_graph(s, (N,))


def test_factory_that_is_a_graph_output_is_not_forwarded():
    gm = fx_graph(_factory_and_t1, (N,))
    s = segment(gm)
    full = node(gm, aten.full.default)
    assert s.forwarded["factory"] == 0
    assert s.segment_of(full) is not None
    assert crosses_boundary(s, full)
    assert_runs_like_graph(s, (N,))


def _factory_and_t1(x):
    t1 = torch.full([N], 1.0)
    t3 = seg_set(x + t1)
    return t3 + t1, t1


def test_random_factory_is_never_forwarded():
    gm = fx_graph(lambda x: seg_set(x + torch.rand(N)) * 2, (N,))
    s = segment(gm)
    assert s.forwarded["factory"] == 0
    assert s.segment_of(node(gm, aten.rand.default)) is not None


# --- (a) unary chains from inputs --------------------------------------------------------------


def _unary_chain(x, y):
    a = torch.exp(-x)          # x -> neg -> exp, each single-use
    b = seg_set(a * y)
    return b + a


def test_unary_chain_is_recomputed_instead_of_passed():
    gm = fx_graph(_unary_chain, (N, N), (N, N))
    s, plain = segment(gm), segment(gm, forwarding=False)
    exp = node(gm, aten.exp.default)
    assert s.forwarded["unary"] == 2
    assert crosses_boundary(plain, exp) and not crosses_boundary(s, exp)
    assert s.boundary_bytes < plain.boundary_bytes
    assert_well_formed(s)
    assert_runs_like_graph(s, (N, N), (N, N))


@pytest.mark.parametrize("fn, why", [
    (lambda x, y: seg_set(-x + x) * (-x), "the input has two users"),
    (lambda x, y: (seg_set(torch.exp(-x) * y) + torch.exp(-x), torch.exp(-x)), "the chain is a graph output"),
    (lambda x, y: seg_set(-x) * y, "the chain feeds segment_set"),
])
def test_unary_chain_refusals(fn, why):
    gm = fx_graph(fn, (N, N), (N, N))
    s = segment(gm)
    neg = node(gm, aten.neg.default)
    assert neg not in s.forwarding, why
    assert_runs_like_graph(s, (N, N), (N, N))


def test_random_unary_op_is_never_forwarded():
    gm = fx_graph(lambda x: seg_set(torch.bernoulli(x) * 2) + 1, (N,))
    s = segment(gm)
    assert s.forwarded["unary"] == 0
    assert s.segment_of(node(gm, aten.bernoulli.default)) is not None


def test_unary_chain_from_a_mutated_input_is_not_forwarded():
    gm = fx_graph(_unary_chain, (N, N), (N, N))
    x = next(n for n in gm.graph.nodes if n.op == "placeholder")
    assert segment(gm, mutated_inputs={x.name}).forwarded["unary"] == 0


# --- (c) broadcasts of inputs ------------------------------------------------------------------


def _broadcast(x, y):
    e = x.expand(4, N, N)      # x: [4, 1, N]
    s = seg_set(e * y)
    return s + e


def test_input_broadcast_is_absorbed():
    gm = fx_graph(_broadcast, (4, 1, N), (4, N, N))
    s, plain = segment(gm), segment(gm, forwarding=False)
    expand = node(gm, aten.expand.default)
    x = expand.args[0]
    assert s.forwarded["broadcast"] == 1
    assert crosses_boundary(plain, expand) and not crosses_boundary(s, expand)
    assert all(x in seg.inputs for seg in s.segments)  # each segment reads the input at its own size
    assert s.boundary_bytes < plain.boundary_bytes
    assert_well_formed(s)
    assert_runs_like_graph(s, (4, 1, N), (4, N, N))


def _reduce_then_broadcast(x, y):
    r = x.sum(1, keepdim=True)  # x: [4, 1, N]: a reduce over a size-1 dim
    e = r.expand(4, N, N)       # ... broadcast back over it
    return seg_set(e * y) + e


def test_reduce_then_broadcast_is_not_absorbed():
    gm = fx_graph(_reduce_then_broadcast, (4, 1, N), (4, N, N))
    assert is_degenerate_reduce(node(gm, aten.sum.dim_IntList))
    s = segment(gm)
    assert node(gm, aten.expand.default) not in s.forwarding
    assert_runs_like_graph(s, (4, 1, N), (4, N, N))


def test_broadcast_of_mutated_input_is_not_absorbed():
    gm = fx_graph(_broadcast, (4, 1, N), (4, N, N))
    x = next(n for n in gm.graph.nodes if n.op == "placeholder")
    s = segment(gm, mutated_inputs={x.name})
    assert s.forwarded["broadcast"] == 0
    assert crosses_boundary(s, node(gm, aten.expand.default))


def test_broadcast_of_output_aliased_input_is_not_absorbed():
    gm = fx_graph(lambda x, y: (_broadcast(x, y), x.view(4, N)), (4, 1, N), (4, N, N))
    x = next(n for n in gm.graph.nodes if n.op == "placeholder")
    assert is_output_aliased(x)
    s = segment(gm)
    assert node(gm, aten.expand.default) not in s.forwarding
    assert_runs_like_graph(s, (4, 1, N), (4, N, N))


# --- merging -----------------------------------------------------------------------------------


def test_segment_set_forces_a_boundary():
    def fn(x, hint):
        a = x * 2
        return (seg_set(a) if hint else a) + 1

    assert len(segment(fx_graph(lambda x: fn(x, False), (N,))).segments) == 1
    s = segment(fx_graph(lambda x: fn(x, True), (N,)))
    assert len(s.segments) == 2
    assert_runs_like_graph(s, (N,))


def _norm_linear(x, w, g):
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * g
    return torch.relu(h @ w)


def test_norm_is_one_reduction_kernel_and_matmul_its_own():
    gm = fx_graph(_norm_linear, (4, N), (N, N), (N,))
    s = segment(gm)
    assert [seg.cls for seg in s.segments] == [SegClass.REDUCTION, SegClass.MATMUL, SegClass.POINTWISE]
    assert_runs_like_graph(s, (4, N), (N, N), (N,))


def _diamond(x, w):
    a = x * 2
    return a + a @ w


def test_merge_refuses_a_cycle_through_another_kernel():
    # a -> mm -> c and a -> c: merging a and c would put the matmul both before and after them
    gm = fx_graph(_diamond, (N, N), (N, N))
    s = segment(gm)
    mul, add = node(gm, aten.mul.Tensor), node(gm, aten.add.Tensor)
    assert s.segment_of(mul) is not s.segment_of(add)
    assert_well_formed(s)
    assert_runs_like_graph(s, (N, N), (N, N))


def test_fuse_state_table():
    pw, pw2 = FuseState(SegClass.POINTWISE, frozenset({32})), FuseState(SegClass.POINTWISE, frozenset({4}))
    red = FuseState(SegClass.REDUCTION, space=frozenset({32, 4}))
    other_red = FuseState(SegClass.REDUCTION, space=frozenset({32, 8}))
    mm, view = FuseState(SegClass.MATMUL), FuseState(SegClass.VIEW)
    assert fuse_state(pw, pw2).cls is SegClass.POINTWISE
    assert fuse_state(pw, red).cls is SegClass.REDUCTION
    assert fuse_state(FuseState(SegClass.POINTWISE, frozenset({7})), red) is None  # other iteration space
    assert fuse_state(red, other_red) is None
    assert fuse_state(mm, view) == mm and fuse_state(view, mm) == mm
    assert fuse_state(mm, pw) is None and fuse_state(mm, mm) is None


def test_collective_and_its_wait_are_one_kernel():
    import torch.distributed as dist

    from shardwise.mesh import ensure_fake_world

    ensure_fake_world(2)
    group = dist.group.WORLD.group_name

    def fn(x):
        r = torch.ops._c10d_functional.all_reduce(x * 2, "sum", group)
        return torch.ops._c10d_functional.wait_tensor(r) + 1

    s = segment(fx_graph(fn, (N,)))
    assert [seg.cls for seg in s.segments] == [SegClass.POINTWISE, SegClass.COLLECTIVE, SegClass.POINTWISE]
    assert len(s.segments[1].nodes) == 2
    assert_well_formed(s)

    def two(x):
        r = torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_reduce(x, "sum", group))
        return torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_reduce(r, "sum", group))

    s = segment(fx_graph(two, (N,)))
    assert [seg.cls for seg in s.segments] == [SegClass.COLLECTIVE, SegClass.COLLECTIVE]


# --- bad input ---------------------------------------------------------------------------------


def test_in_place_op_is_refused():
    gm = fx_graph(lambda x: x * 2, (N,))
    mul = node(gm, aten.mul.Tensor)
    with gm.graph.inserting_after(mul):
        add_ = gm.graph.call_function(aten.add_.Tensor, (mul, 1))
    add_.meta["val"] = mul.meta["val"]
    with pytest.raises(UnsupportedGraph, match="in place"):
        segment(gm)


def test_missing_fake_value_is_refused():
    gm = fx_graph(lambda x: x * 2, (N,))
    del node(gm, aten.mul.Tensor).meta["val"]
    with pytest.raises(UnsupportedGraph, match="no fake value"):
        segment(gm)
