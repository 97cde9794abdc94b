"""The runtime passes (early_loss_weight, simplify, sink_waits, inplace_all_reduce): a per-rank
program with its layout bookkeeping folded, its loss's token count reduced at the start, its
waits sunk and its private buffers reduced in place computes the same values (single process,
and on gloo ranks against the unrewritten program),
and what they must leave alone."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from shardwise.ir.match import RESHAPE_OPS, is_wait
from shardwise.passes import early_loss_weight, inplace_all_reduce, simplify, sink_waits
from tests.helpers import SLOW_MACHINE_TIMEOUT_S
from tests.passes.test_bucket import _programs

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def _count(gm, *targets) -> int:
    return sum(n.op == "call_function" and n.target in targets for n in gm.graph.nodes)


def _layout_soup(x, y):
    a = x.view(4, 6).view(24).view(2, 12)  # a reshape chain
    b = a.t().t().permute(1, 0).permute(1, 0)  # transposes that cancel
    c = b.detach().view(2, 12)  # a marker and an identity view
    return c * y.t().contiguous().view(2, 12)


def test_layout_chains_fold_and_the_values_stay():
    x, y = torch.randn(24), torch.randn(12, 2)
    gm = make_fx(_layout_soup)(x, y)
    want = gm(x, y)
    views, perms = _count(gm, *RESHAPE_OPS), _count(gm, aten.t.default, aten.permute.default)
    assert simplify.apply(gm) > 0
    assert _count(gm, aten.detach.default) == 0
    assert _count(gm, *RESHAPE_OPS) < views - 2
    # x's four transposes cancel; y's one stays (it changes the value).
    assert _count(gm, aten.t.default, aten.permute.default) == 1 < perms
    x2, y2 = torch.randn(24), torch.randn(12, 2)
    assert torch.equal(gm(x, y), want) and torch.equal(gm(x2, y2), _layout_soup(x2, y2))


def _viewed_twice(x, w, y):
    a = x.view(6, 4) @ w
    b = x.view(6, 4).t() @ a  # the same view of x again, as a backward takes it for a gradient
    return a, b, y.t() + y.t().sin()


def test_the_same_view_of_the_same_input_is_made_once_and_the_values_stay():
    x, w, y = torch.randn(4, 6), torch.randn(4, 3), torch.randn(3, 5)
    gm = make_fx(_viewed_twice)(x, w, y)
    assert _count(gm, aten.view.default) == 2 and _count(gm, aten.t.default) == 3
    assert simplify.apply(gm) >= 2
    assert _count(gm, aten.view.default) == 1 and _count(gm, aten.t.default) == 2
    x2, w2, y2 = torch.randn(4, 6), torch.randn(4, 3), torch.randn(3, 5)
    for got, want in zip(gm(x2, w2, y2), _viewed_twice(x2, w2, y2), strict=True):
        assert torch.equal(got, want)


def _with_tables(x, n: int):
    table = torch.arange(n, dtype=torch.float32).cos()  # reads no input: a constant
    return x.sum() + table


def test_small_constants_fold_once_and_large_ones_are_recomputed():
    x = torch.randn(8)
    small = make_fx(lambda x: _with_tables(x, 16))(x)
    assert simplify.apply(small) > 0
    assert _count(small, aten.arange.start_step, aten.arange.default, aten.cos.default) == 0
    assert any(n.op == "get_attr" for n in small.graph.nodes)
    assert torch.equal(small(x), _with_tables(x, 16))
    n_big = simplify.CONST_FOLD_MAX_BYTES // 4 + 1  # one float32 more than the limit
    big = make_fx(lambda x: _with_tables(x, n_big))(x)
    simplify.apply(big)
    assert not any(n.op == "get_attr" for n in big.graph.nodes)  # nothing kept: made each call
    assert _count(big, aten.cos.default) == 1
    assert torch.equal(big(x), _with_tables(x, n_big))


def test_a_graph_that_writes_in_place_keeps_its_buffers_and_storage():
    """zeros() is a constant, but add_ writes it: folded into a buffer, each call would add to
    the last call's sum. The view chain still folds (onto the same storage)."""

    def f(x):
        acc = torch.zeros(8)
        acc.add_(x)
        return acc.view(2, 4).view(8) * 2

    x = torch.randn(8)
    gm = make_fx(f)(x)
    assert not simplify.is_functional(gm.graph)
    views = _count(gm, *RESHAPE_OPS)
    simplify.apply(gm)
    assert not any(n.op == "get_attr" for n in gm.graph.nodes)
    assert _count(gm, *RESHAPE_OPS) < views
    assert torch.equal(gm(x), f(x)) and torch.equal(gm(x), f(x))


@pytest.mark.slow
def test_a_training_step_simplified_and_sunk_computes_the_same_on_gloo():
    from shardwise.mesh import Mesh
    from shardwise.passes import bucket
    from shardwise.runtime import run_many

    plain, rewritten = _programs("ddp", Mesh((2,), ("dp",)))
    gm = rewritten.gm
    bucket.apply(gm)
    n_nodes = len(gm.graph.nodes)
    assert early_loss_weight.apply(gm) == 1
    assert simplify.apply(gm) > 0 and sink_waits.apply(gm) > 0
    assert len(gm.graph.nodes) < 0.8 * n_nodes
    # The token count's all_reduce is launched before any matmul of the forward.
    first_mm = next(n for n in gm.graph.nodes if n.target is aten.mm.default)
    count_reduce = next(n for n in gm.graph.nodes if n.target is c10d.all_reduce.default)
    assert count_reduce.args[0].target is aten._to_copy.default
    assert list(gm.graph.nodes).index(count_reduce) < list(gm.graph.nodes).index(first_mm)
    # The backward's seed reads the local loss, not the all_reduced one: nothing waits for the
    # loss before the gradients are computed, and every wait sits just before its first reader.
    seed = next(n for n in gm.graph.nodes if n.target is aten.ones_like.default)
    assert not is_wait(seed.args[0])
    for w in (n for n in gm.graph.nodes if is_wait(n)):
        assert w.next in w.users
    # The gradient bucket and the token count are reduced in place; the loss (read by the
    # backward's seed too) is not.
    assert inplace_all_reduce.apply(gm) == 2
    assert _count(gm, c10d.all_reduce.default) == 1
    results = run_many([plain, rewritten], check=True, timeout_s=SLOW_MACHINE_TIMEOUT_S)
    assert results[1].max_rel_err <= 1e-5
    for got, want in zip(results[1].outputs, results[0].outputs, strict=True):
        assert torch.equal(got, want)


@pytest.mark.slow
def test_fsdp_tp_sp_with_passes_stays_equal_after_sinking_on_a_2x2_mesh():
    from shardwise.mesh import Mesh
    from shardwise.runtime import run_many

    plain, rewritten = _programs("fsdp_tp_sp", Mesh((2, 2), ("dp", "tp")),
                                 passes=("sequence_parallel", "collective_matmul", "bucket"))
    assert simplify.apply(rewritten.gm) > 0 and sink_waits.apply(rewritten.gm) > 0
    results = run_many([plain, rewritten], check=True, timeout_s=SLOW_MACHINE_TIMEOUT_S)
    assert results[1].max_rel_err <= 1e-5


@pytest.mark.parametrize("change", ["class weights", "sum reduction"])
def test_the_token_count_stays_put_unless_it_is_a_plain_mean(change):
    """With class weights the total weight is no token count; with a sum there is none to take."""
    from shardwise.mesh import Mesh

    _, prog = _programs("ddp", Mesh((2,), ("dp",)))
    assert len(early_loss_weight.find(prog.gm)) == 1
    loss = next(n for n in prog.gm.graph.nodes if n.target is aten.nll_loss_forward.default)
    args = list(loss.args)
    if change == "class weights":
        args[2] = args[0]  # any node: the rule only asks whether weights are given
    else:
        args[3] = 2
    loss.args = tuple(args)
    assert early_loss_weight.find(prog.gm) == [] and early_loss_weight.apply(prog.gm) == 0


def test_only_a_private_fresh_buffer_is_reduced_in_place():
    """A computed buffer read only by its all_reduce is reduced in place; an input, a view, and a
    buffer that something else reads keep the copying all_reduce."""
    from torch import fx

    from shardwise.passes import inplace_all_reduce

    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.randn(4, 4)

    def call(target, *args):
        node = g.call_function(target, args)
        node.meta["val"] = target(*[a.meta["val"] if isinstance(a, fx.Node) else a for a in args])
        return node

    private, shared = call(aten.mul.Tensor, x, 2.0), call(aten.mul.Tensor, x, 3.0)
    base = call(aten.add.Tensor, x, 1.0)
    view = call(aten.view.default, base, [16])
    reduces = [g.call_function(c10d.all_reduce.default, (v, "sum", "0")) for v in (private, shared, x, view)]
    waits = [g.call_function(c10d.wait_tensor.default, (r,)) for r in reduces]
    g.output((*waits, shared))
    gm = fx.GraphModule(torch.nn.Module(), g)
    assert [m.buffer for m in inplace_all_reduce.find(gm)] == [private]
    assert inplace_all_reduce.apply(gm) == 1
    assert [r.target for r in reduces] == [c10d.all_reduce_.default] + [c10d.all_reduce.default] * 3
