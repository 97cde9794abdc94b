"""Tracing: the joint graph's bookkeeping (params, grads, phases), fake tensors, and a 70B model
traced without its weights."""

from __future__ import annotations

import resource

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from shardwise.errors import UserError
from shardwise.ir.trace import Phase, trace, trace_model
from shardwise.models import get_model
from tests.helpers import hf_model_name, real_inputs_for

GIB = 2**30
RSS_UNIT = 1024  # ru_maxrss is in KiB on Linux
RSS_BUDGET = 4 * GIB


@pytest.fixture(scope="module")
def tiny():
    return trace_model("llama-tiny", layers=1)


def placeholders(gm):
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def test_params_map_to_leading_placeholders_in_named_order(tiny):
    module = get_model("llama-tiny", layers=1).build_module()
    names = [k for k, _ in module.named_parameters()]
    ph = placeholders(tiny.gm)
    assert list(tiny.params) == names
    assert [tiny.params[k] for k in names] == [n.name for n in ph[: len(names)]]
    assert tiny.inputs == [n.name for n in ph[len(names):]] and len(tiny.inputs) == 2
    shapes = dict((k, tuple(p.shape)) for k, p in module.named_parameters())
    for k, node_name in tiny.params.items():
        val = tiny.node(node_name).meta["val"]
        assert isinstance(val, FakeTensor) and tuple(val.shape) == shapes[k]
    assert tiny.param_of_placeholder()[tiny.params["output.weight"]] == "output.weight"


def test_every_param_has_a_backward_gradient_of_its_shape(tiny):
    assert set(tiny.grads) == set(tiny.params)
    for k, g in tiny.grads.items():
        node = tiny.node(g)
        assert tiny.phase(node) is Phase.BACKWARD, k
        assert node.meta["val"].shape == tiny.node(tiny.params[k]).meta["val"].shape, k


def test_loss_is_a_forward_scalar_and_phases_split_the_graph(tiny):
    loss = tiny.node(tiny.loss)
    assert loss.meta["val"].dim() == 0 and tiny.phase(loss) is Phase.FORWARD
    fwd = {n for n in tiny.gm.graph.nodes if tiny.phase(n) is Phase.FORWARD}
    bwd = [n for n in tiny.gm.graph.nodes if tiny.phase(n) is Phase.BACKWARD and n.op != "output"]
    assert fwd and bwd
    # forward nodes never read backward ones
    assert all(tiny.phase(i) is Phase.FORWARD for n in fwd for i in n.all_input_nodes)
    # the backward holds the gradient matmuls and the sdpa backward
    assert any("backward" in str(n.target) for n in bwd)


def test_graph_is_functional_and_every_tensor_node_has_a_fake_value(tiny):
    for n in tiny.gm.graph.nodes:
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload):
            assert not n.target._schema.is_mutable, n.format_node()
        if n.op in ("placeholder", "call_function"):
            assert "val" in n.meta, n.format_node()


def test_inference_trace_is_forward_only():
    traced = trace_model("llama-tiny", layers=1, train=False)
    assert traced.grads == {} and traced.loss is None
    (out,) = traced.outputs
    assert tuple(traced.node(out).meta["val"].shape) == (4, 16, 256)
    assert all(traced.phase(n) is Phase.FORWARD for n in traced.gm.graph.nodes)
    assert len(traced.inputs) == 1


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.frozen = nn.Linear(3, 3)
        self.frozen.requires_grad_(False)

    def forward(self, x):
        return self.frozen(self.lin(x)).pow(2).mean()


def test_trace_real_module_leaves_it_untouched_and_skips_frozen_params():
    torch.manual_seed(0)
    model = _Tiny()
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    x = torch.randn(2, 5, 4)
    traced = trace(model, x)
    # frozen parameters are placeholders too, but get no gradient
    assert list(traced.params) == ["lin.weight", "lin.bias", "frozen.weight", "frozen.bias"]
    assert set(traced.grads) == {"lin.weight", "lin.bias"}
    for k, p in model.named_parameters():
        assert not isinstance(p, FakeTensor) and torch.equal(p, before[k])
        assert p.grad is None
    # the graph computes the eager loss and grads on the real values
    loss, gw, gb, *frozen = traced.gm(*[p.detach() for p in model.parameters()], x)
    assert frozen == [None, None]
    ref = model(x)
    ref.backward()
    torch.testing.assert_close(loss, ref.detach())
    torch.testing.assert_close(gw, model.lin.weight.grad)
    torch.testing.assert_close(gb, model.lin.bias.grad)


def test_training_trace_needs_a_scalar_loss():
    with pytest.raises(UserError, match="scalar loss"):
        trace(nn.Linear(4, 3), torch.randn(2, 4))


def test_llama3_70b_traces_all_80_layers_without_allocating_weights():
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * RSS_UNIT
    traced = trace_model("llama3-70b", batch=1, seq=128)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * RSS_UNIT - rss0
    assert grown < RSS_BUDGET  # its bf16 weights alone are 140 GB
    n_params = sum(traced.node(p).meta["val"].numel() for p in traced.params.values())
    assert n_params > 70e9
    layers = {k.split(".")[1] for k in traced.params if k.startswith("layers.")}
    assert len(layers) == 80 and set(traced.grads) == set(traced.params)
    assert all(traced.node(p).meta["val"].dtype is torch.bfloat16 for p in traced.params.values())
    mms = [n for n in traced.gm.graph.nodes if n.target is torch.ops.aten.mm.default]
    assert len(mms) == 3 * (7 * 80 + 1)  # forward, input-grad, weight-grad of every projection


def _structure(gm):
    """Each node's op, target and arguments, with nodes written as their position in the graph."""
    index = {n: i for i, n in enumerate(gm.graph.nodes)}

    def norm(a):
        return torch.fx.node.map_arg(a, lambda n: ("%", index[n]))

    return [(n.op, str(n.target) if n.op != "placeholder" else "", norm(n.args), norm(n.kwargs))
            for n in gm.graph.nodes]


def _relative_seq_nrs(gm):
    seqs = [n.meta.get("seq_nr") for n in gm.graph.nodes if n.op != "placeholder"]
    lo = min(s for s in seqs if s is not None)
    return [None if s is None else s - lo for s in seqs]


@pytest.mark.parametrize(("model", "train"), [("llama-tiny", True), ("llama-tiny", False),
                                              (hf_model_name("llama"), True)])
def test_stamped_layers_equal_a_full_trace(model, train):
    stamped = trace_model(model, layers=3, train=train)
    full = trace_model(model, layers=3, train=train, stamp_layers=False)
    # the same graph: same ops in the same order reading the same arguments
    assert _structure(stamped.gm) == _structure(full.gm)
    assert list(stamped.params) == list(full.params)
    assert set(stamped.grads) == set(full.grads) and bool(stamped.loss) == bool(full.loss)
    assert [stamped.phase(n) for n in stamped.gm.graph.nodes] == [full.phase(n) for n in full.gm.graph.nodes]
    # autograd sequence numbers agree up to where the process's counter started
    assert _relative_seq_nrs(stamped.gm) == _relative_seq_nrs(full.gm)
    for k in stamped.params:
        val = stamped.node(stamped.params[k]).meta["val"]
        assert val.shape == full.node(full.params[k]).meta["val"].shape
    if model == "llama-tiny":  # and the same values, bit for bit, on real inputs
        inputs = real_inputs_for(full.gm)
        for a, b in zip(stamped.gm(*inputs), full.gm(*inputs), strict=True):
            assert torch.equal(a, b)


def test_stamping_is_used_for_identical_layers_only():
    from shardwise.ir.stamp import find_stack, identical_layers

    with FakeTensorMode():
        module = get_model("llama-tiny", layers=3).build_module()
    assert find_stack(module, 3) == "layers" and identical_layers(module.layers)
    module.layers[2].attention.wq = nn.Linear(64, 64, bias=True)
    assert not identical_layers(module.layers)


def test_stamping_refuses_what_it_cannot_rebind():
    from shardwise.ir.stamp import trace_stacked

    spec = get_model("llama-tiny", layers=3)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        module = spec.build_module()
    module.layers[1].attention.wq.weight.requires_grad_(False)  # frozen: not stamped
    assert trace_stacked(module, "layers", spec.example_inputs(True), train=True, fake_mode=mode) is None
    assert len(module.layers) == 3  # the module is left as it was
    two = get_model("llama-tiny", layers=2)
    with mode:
        small = two.build_module()
    assert trace_stacked(small, "layers", two.example_inputs(True), train=True, fake_mode=mode) is None


def test_layers_with_different_attention_types_are_not_stamped(tmp_path, monkeypatch):
    import json

    import shardwise.ir.stamp as stamp
    from tests.helpers import HF_TINY

    cfg = json.loads(HF_TINY["qwen2"].read_text())
    cfg.update(use_sliding_window=True, sliding_window=8, max_window_layers=1, num_hidden_layers=3,
               layer_types=["full_attention", "sliding_attention", "sliding_attention"])
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))

    def refuse(*args, **kwargs):
        raise AssertionError("layers of different attention types must not be stamped")

    monkeypatch.setattr(stamp, "trace_stacked", refuse)
    traced = trace_model(f"hf:{path}", layers=3, train=False)
    assert traced.outputs


def test_node_lookup_follows_graph_rewrites():
    tr = trace_model("llama-tiny", layers=1)
    loss = tr.node(tr.loss)
    victim = next(n for n in tr.gm.graph.nodes if n.op == "call_function" and n.users and n is not loss)
    name = victim.name
    assert tr.node(name) is victim
    with tr.gm.graph.inserting_after(victim):
        clone = tr.gm.graph.call_function(torch.ops.aten.clone.default, (victim,))
    victim.replace_all_uses_with(clone, delete_user_cb=lambda u: u is not clone)
    assert tr.node(clone.name) is clone  # a node the index did not hold yet
    clone.replace_all_uses_with(victim)
    tr.gm.graph.erase_node(clone)
    with pytest.raises(KeyError):
        tr.node(clone.name)  # an erased node is not found
    assert tr.node(name) is victim


def test_an_analysis_is_kept_until_the_graph_changes():
    """``Traced.analysis`` computes once per graph: again after a node is added, and after one is
    rewired to read another input."""
    tr = trace_model("llama-tiny", layers=1, batch=2, seq=8)
    calls = []

    def count(gm):
        calls.append(len(gm.graph.nodes))
        return len(calls)

    assert tr.analysis("count", count) == tr.analysis("count", count) == 1
    first = next(n for n in tr.gm.graph.nodes if n.op == "call_function")
    with tr.gm.graph.inserting_after(first):
        extra = tr.gm.graph.call_function(torch.ops.aten.neg.default, (first,))
    assert tr.analysis("count", count) == 2 and calls[-1] == calls[0] + 1
    user = next(iter(first.users.keys() - {extra}))
    user.replace_input_with(first, extra)
    assert tr.analysis("count", count) == 3 == tr.analysis("count", count)
