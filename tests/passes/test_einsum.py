"""The einsum fusion: positive rewrites checked by running them, refusals checked by an unchanged
graph, whole-model acceptance (no linear mm left, FLOPs unchanged) and eager numerics."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
import torch.fx.traceback as fx_traceback
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils.flop_counter import FlopCounterMode

from shardwise.ir.flops import graph_flops, node_flops
from shardwise.ir.trace import trace, trace_model
from shardwise.models import get_model
from shardwise.passes import einsum
from shardwise.passes.pipeline import canonicalize
from tests.helpers import hf_model_name, real_inputs_for

aten = torch.ops.aten
MM_OPS = ("aten.mm.default", "aten.addmm.default")


def ops(gm) -> Counter:
    return Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")


def graph_of(fn, *args, mode: str = "fake"):
    return make_fx(fn, tracing_mode=mode)(*args)


def rand(*shape, requires_grad: bool = False) -> torch.Tensor:
    return torch.randn(*shape).requires_grad_(requires_grad)


def check_rewrite(fn, *args, expect: int) -> torch.fx.GraphModule:
    """Rewrite ``fn``'s graph, check the count, and check the rewritten graph computes the same."""
    gm = graph_of(fn, *args)
    before = copy.deepcopy(gm)
    assert einsum.apply(gm) == expect
    c = ops(gm)
    assert c["aten.einsum.default"] == expect
    assert c["aten.mm.default"] + c["aten.addmm.default"] == ops(before)["aten.mm.default"] + ops(
        before)["aten.addmm.default"] - expect
    assert graph_flops(gm) == graph_flops(before)
    torch.testing.assert_close(gm(*args), before(*args))
    return gm


# --------------------------------------------------------------------------------------------
# Positive cases
# --------------------------------------------------------------------------------------------


def test_forward_linear_rank3_becomes_einsum():
    gm = check_rewrite(lambda x, w: F.linear(x, w), rand(2, 3, 4), rand(5, 4), expect=1)
    (ein,) = [n for n in gm.graph.nodes if n.target is aten.einsum.default]
    assert ein.args[0] == "bsk,kn->bsn"
    assert tuple(ein.meta["val"].shape) == (2, 3, 5)


def test_forward_linear_rank4_keeps_three_batch_dims():
    gm = check_rewrite(lambda x, w: F.linear(x, w), rand(2, 3, 2, 4), rand(5, 4), expect=1)
    (ein,) = [n for n in gm.graph.nodes if n.target is aten.einsum.default]
    assert ein.args[0] == "bsuk,kn->bsun"


def test_addmm_becomes_einsum_then_bias_add():
    gm = check_rewrite(lambda x, w, b: F.linear(x, w, b), rand(2, 3, 4), rand(5, 4), rand(5), expect=1)
    c = ops(gm)
    assert c["aten.addmm.default"] == 0 and c["aten.add.Tensor"] == 1


def _linear_step(x, w):
    y = F.linear(x, w)
    loss = (y * y).sum()
    return (loss, *torch.autograd.grad(loss, [x, w]))


def test_joint_linear_forward_input_grad_and_weight_grad():
    gm = check_rewrite(_linear_step, rand(2, 3, 4, requires_grad=True), rand(5, 4, requires_grad=True),
                       expect=3)
    equations = sorted(n.args[0] for n in gm.graph.nodes if n.target is aten.einsum.default)
    assert equations == ["bsk,kn->bsn", "bsk,kn->bsn", "bsn,bsk->nk"]


def test_weight_grad_with_permute_form():
    def wgrad(dy, x):
        return torch.mm(dy.reshape(6, 5).permute(1, 0), x.reshape(6, 4))

    gm = check_rewrite(wgrad, rand(2, 3, 5), rand(2, 3, 4), expect=1)
    assert ops(gm)["aten.permute.default"] == 0


def test_flatten_with_other_users_is_kept():
    def fn(x, w):
        flat = x.view(6, 4)
        return (flat @ w).view(2, 3, 5), flat * 2

    gm = check_rewrite(fn, rand(2, 3, 4), rand(4, 5), expect=1)
    flats = [n for n in gm.graph.nodes
             if n.target is aten.view.default and tuple(n.meta["val"].shape) == (6, 4)]
    assert len(flats) == 1 and all(u.target is aten.mul.Tensor for u in flats[0].users)


def test_einsum_takes_seq_nr_from_the_mm():
    def fn(x, w):
        return F.linear(x, w)

    with fx_traceback.preserve_node_meta():
        gm = graph_of(fn, rand(2, 3, 4, requires_grad=True), rand(5, 4, requires_grad=True))
    (mm,) = [n for n in gm.graph.nodes if n.target is aten.mm.default]
    (unflat,) = list(mm.users)
    assert mm.meta["seq_nr"] != unflat.meta["seq_nr"]  # so the test tells them apart
    mm_seq = mm.meta["seq_nr"]
    einsum.apply(gm)
    (ein,) = [n for n in gm.graph.nodes if n.target is aten.einsum.default]
    assert ein.meta["seq_nr"] == mm_seq


def test_find_matches_reports_both_forms():
    gm = graph_of(_linear_step, rand(2, 3, 4, requires_grad=True), rand(5, 4, requires_grad=True))
    kinds = Counter(type(m).__name__ for m in einsum.find_matches(gm.graph))
    assert kinds == {"LinearMatch": 2, "WeightGradMatch": 1}


# --------------------------------------------------------------------------------------------
# Safety predicates
# --------------------------------------------------------------------------------------------


def _node(gm, target):
    return next(n for n in gm.graph.nodes if n.target is target)


def test_canonical_flatten_predicate():
    gm = graph_of(lambda x, y: (x.view(6, 4), y.view(6, 4)), rand(2, 3, 4), rand(2, 4, 3))
    good, bad = [n for n in gm.graph.nodes if n.target is aten.view.default]
    assert einsum.canonical_flatten(good) == (2, 3)
    assert einsum.canonical_flatten(bad) is None


def test_is_kn_operand_and_same_batch_predicates():
    gm = graph_of(lambda w: w.t(), rand(5, 4))
    t = _node(gm, aten.t.default)
    assert einsum.is_kn_operand(t, 4) and not einsum.is_kn_operand(t, 5)
    assert einsum.same_batch((2, 3), (2, 3)) and not einsum.same_batch((2, 3), (3, 2))
    assert not einsum.same_batch(None, (2, 3))


def test_is_plain_addmm_predicate():
    def fn(b, x, w, b2):
        return torch.addmm(b, x, w), torch.addmm(b, x, w, beta=2), torch.addmm(b2, x, w)

    gm = graph_of(fn, rand(5), rand(6, 4), rand(4, 5), rand(6, 5))
    plain, scaled, full_bias = [n for n in gm.graph.nodes if n.target is aten.addmm.default]
    assert einsum.is_plain_addmm(plain)
    assert not einsum.is_plain_addmm(scaled) and not einsum.is_plain_addmm(full_bias)


def test_only_user_is_unflatten_predicate():
    gm = graph_of(lambda x, w: ((x.view(6, 4) @ w).view(2, 3, 5), (x.view(6, 4) @ w).view(3, 2, 5)),
                  rand(2, 3, 4), rand(4, 5))
    first, second = [n for n in gm.graph.nodes if n.target is aten.mm.default]
    assert einsum.only_user_is_unflatten(first, (2, 3)) is not None
    assert einsum.only_user_is_unflatten(second, (2, 3)) is None


# --------------------------------------------------------------------------------------------
# Negative suite: graphs the pass must leave exactly as they are
# --------------------------------------------------------------------------------------------


def _noncanonical_flatten(x, w):  # [2, 4, 3] -> [6, 4] mixes the last dim into the rows
    return (x.view(6, 4) @ w).view(2, 3, 5)


def _unflatten_other_order(x, w):  # batch (2, 3) comes back as (3, 2)
    return (x.view(6, 4) @ w).view(3, 2, 5)


def _unflatten_other_shape(x, w):  # batch (2, 3) comes back as (6, 1)
    return (x.view(6, 4) @ w).view(6, 1, 5)


def _rank2_input(x, w):  # [6, 4]: no batch dims to restore
    return (x.view(6, 4) @ w).view(2, 3, 5)


def _transposed_batch(x, w):  # flatten of the [3, 2, 4] transpose, unflatten to [2, 3, 5]
    return (x.transpose(0, 1).reshape(6, 4) @ w).view(2, 3, 5)


def _weight_grad_mismatched_batch(dy, x):  # dy folds (2, 3), x folds (3, 2)
    return torch.mm(dy.view(6, 5).t(), x.view(6, 4))


def _weight_grad_noncanonical(dy, x):  # x [2, 6, 2] -> [6, 4] is not a flatten
    return torch.mm(dy.view(6, 5).t(), x.reshape(6, 4))


def _flat_on_the_right(w, x):  # the [K, N] operand is the flattened activation, not a weight
    return (w @ x.view(6, 4)).view(5, 2, 2)


def _flat_result_needed(x, w):  # the flat product is also read in its flat form
    y = x.view(6, 4) @ w
    return y.view(2, 3, 5), y.sum(0)


def _addmm_scaled(b, x, w):
    return torch.addmm(b, x.view(6, 4), w, alpha=0.5).view(2, 3, 5)


def _addmm_full_bias(b, x, w):  # a [prod(b), N] bias is not a per-feature bias
    return torch.addmm(b, x.view(6, 4), w).view(2, 3, 5)


def _linear(x, w):
    return F.linear(x, w)


NEGATIVE = {
    "noncanonical_flatten": (_noncanonical_flatten, (rand(2, 4, 3), rand(4, 5)), "fake"),
    "unflatten_other_order": (_unflatten_other_order, (rand(2, 3, 4), rand(4, 5)), "fake"),
    "unflatten_other_shape": (_unflatten_other_shape, (rand(2, 3, 4), rand(4, 5)), "fake"),
    "rank2_input": (_rank2_input, (rand(6, 4), rand(4, 5)), "fake"),
    "transposed_batch": (_transposed_batch, (rand(2, 3, 4), rand(4, 5)), "fake"),
    "weight_grad_mismatched_batch": (_weight_grad_mismatched_batch, (rand(2, 3, 5), rand(3, 2, 4)), "fake"),
    "weight_grad_noncanonical": (_weight_grad_noncanonical, (rand(2, 3, 5), rand(2, 6, 2)), "fake"),
    "weight_not_kn": (_flat_on_the_right, (rand(5, 6), rand(2, 3, 4)), "fake"),
    "flat_result_needed": (_flat_result_needed, (rand(2, 3, 4), rand(4, 5)), "fake"),
    "addmm_scaled": (_addmm_scaled, (rand(5), rand(2, 3, 4), rand(4, 5)), "fake"),
    "addmm_full_bias": (_addmm_full_bias, (rand(6, 5), rand(2, 3, 4), rand(4, 5)), "fake"),
    "symbolic_shapes": (_linear, (rand(2, 3, 4), rand(5, 4)), "symbolic"),
    "symbolic_joint": (_linear_step, (rand(2, 3, 4, requires_grad=True), rand(5, 4, requires_grad=True)),
                       "symbolic"),
}


@pytest.mark.parametrize("case", sorted(NEGATIVE))
def test_pass_leaves_graph_unchanged(case):
    fn, args, mode = NEGATIVE[case]
    gm = graph_of(fn, *args, mode=mode)
    mms = ops(gm)["aten.mm.default"] + ops(gm)["aten.addmm.default"]
    assert mms >= 1  # the case does hold a matmul the pass could have touched
    before = str(gm.graph)
    assert einsum.apply(gm) == 0
    assert str(gm.graph) == before
    assert einsum.find_matches(gm.graph) == []


# --------------------------------------------------------------------------------------------
# Whole models: acceptance
# --------------------------------------------------------------------------------------------


def _flop_counter_total(gm, inputs) -> int:
    with FlopCounterMode(display=False) as counter:
        gm(*inputs)
    return counter.get_total_flops()


@pytest.mark.parametrize("model", ["llama-tiny", hf_model_name("llama"), hf_model_name("qwen2")])
def test_every_linear_mm_becomes_einsum_with_equal_flops(model):
    traced = trace_model(model, layers=2)
    gm = traced.gm
    spec = get_model(model, layers=2)
    n_mm = sum(ops(gm)[k] for k in MM_OPS)
    flops_before = graph_flops(gm)
    inputs = real_inputs_for(gm, vocab=spec.vocab_size)
    counter_before = _flop_counter_total(gm, inputs)

    rewrites = canonicalize(traced)

    c = ops(gm)
    assert rewrites["einsum"] == n_mm == c["aten.einsum.default"]
    assert sum(c[k] for k in MM_OPS) == 0
    assert graph_flops(gm) == flops_before == counter_before
    assert _flop_counter_total(gm, inputs) == counter_before
    einsum_flops = sum(node_flops(n) for n in gm.graph.nodes if n.target is aten.einsum.default)
    assert einsum_flops > 0
    # each projection's forward, input-gradient and weight-gradient einsums share the mm's seq_nr
    seq_nrs = Counter(n.meta["seq_nr"] for n in gm.graph.nodes if n.target is aten.einsum.default)
    assert set(seq_nrs.values()) == {3} and len(seq_nrs) == n_mm // 3
    # the bookkeeping still points at live nodes
    names = {n.name for n in gm.graph.nodes}
    assert traced.loss in names and set(traced.grads.values()) <= names
    assert all(traced.phase(traced.node(g)).value == "backward" for g in traced.grads.values())


def test_canonical_llama_tiny_matches_eager_loss_and_grads():
    torch.manual_seed(0)
    spec = get_model("llama-tiny", dtype="fp32")
    model = spec.build_module()
    tokens, labels = spec.example_inputs(train=True, seed=1)

    traced = trace(model, tokens, labels)
    canonicalize(traced)
    assert ops(traced.gm)["aten.einsum.default"] > 0
    params = dict(model.named_parameters())
    loss, *grads = traced.gm(*[params[k].detach() for k in traced.params], tokens, labels)

    eager_loss = model(tokens, labels)
    eager_loss.backward()

    def rel_err(a, b):
        return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()

    assert rel_err(loss, eager_loss.detach()) <= 1e-5
    assert len(grads) == len(params)
    for name, g in zip(traced.params, grads, strict=True):
        assert rel_err(g, params[name].grad) <= 1e-5, name


def test_declines_say_why_at_debug_level(caplog):
    fn, args, mode = NEGATIVE["unflatten_other_order"]
    gm = graph_of(fn, *args, mode=mode)
    with caplog.at_level("DEBUG", logger="shardwise.passes.einsum"):
        einsum.apply(gm)
    assert "matching unflatten" in caplog.text and "aten.mm.default" in caplog.text
