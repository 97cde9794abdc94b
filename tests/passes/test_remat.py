"""Rematerialisation: the rewritten step equals the original on random inputs (built-in LLaMA and
tiny Hugging Face configs, every policy), the forward originals die before the backward, what
each policy keeps, the lowered per-rank program's collectives, the refusals, and ``shardwise run
--ac`` on real gloo ranks."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import torch
from torch import fx, nn
from torch.fx.experimental.proxy_tensor import make_fx

from shardwise.cli import main
from shardwise.errors import UserError
from shardwise.ir import regions
from shardwise.ir.match import collective, is_wait
from shardwise.ir.trace import trace, trace_model
from shardwise.mesh import ensure_fake_world
from shardwise.models import get_model
from shardwise.passes import PASSES, get_pass, remat
from shardwise.passes.pipeline import canonicalize
from shardwise.passes.remat import ACPolicy
from shardwise.runtime.activations import run_measured
from shardwise.runtime.launch import real_constants
from tests.helpers import cli, hf_model_name, json_object, real_inputs_for
from tests.passes import sp_graphs as G

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
MAX_REL_ERR = 1e-5  # the acceptance bound (fp32)
DROP_P = 0.5
POLICIES = (ACPolicy.SELECTIVE, ACPolicy.FULL)
MODELS = ("llama-tiny", hf_model_name("llama"), hf_model_name("qwen2"))


def _canonical(model: str, layers: int = 2, train: bool = True):
    traced = trace_model(model, layers=layers, train=train)
    canonicalize(traced)
    return traced


def _runnable(model: str, gm: fx.GraphModule) -> list[torch.Tensor]:
    """Random real inputs for ``gm``, its fake constants (rotary tables) given real values."""
    module = get_model(model).build_module()
    for name, value in real_constants(gm, module).items():
        setattr(gm, name, value)
    return real_inputs_for(gm)


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    return fx.GraphModule(gm, copy.deepcopy(gm.graph))


def _outputs(gm: fx.GraphModule, args: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t for t in gm(*args) if isinstance(t, torch.Tensor)]


@pytest.fixture(scope="module")
def llama():
    return _canonical("llama-tiny")


# ---------------------------------------------------------------------------------------------
# Numerics and memory.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.value)
def test_rewritten_step_equals_the_original_and_saves_less(model, policy):
    gm = _canonical(model).gm
    args = _runnable(model, gm)
    ref = _outputs(gm, args)
    _, before = run_measured(gm, args)
    rewritten = _copy(gm)
    n = remat.apply(rewritten, policy)
    assert n == len(remat.recompute_plan(gm, policy).recompute) > 0
    got = _outputs(rewritten, args)
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=MAX_REL_ERR, atol=0.0)
    # Fewer activation bytes alive when the backward starts, measured on the real tensors; the
    # plan predicts them exactly from the fake values.
    none, plan = remat.recompute_plan(gm, ACPolicy.NONE), remat.recompute_plan(gm, policy)
    _, after = run_measured(rewritten, args)
    assert after < before
    assert (remat.saved_bytes(gm, plan.saved), remat.saved_bytes(gm, none.saved)) == (after, before)


def test_full_saves_less_than_selective(llama):
    gm = llama.gm
    full, sel = (remat.saved_bytes(gm, remat.recompute_plan(gm, p).saved) for p in (ACPolicy.FULL,
                                                                                 ACPolicy.SELECTIVE))
    assert full < sel


def test_forward_originals_die_before_the_backward(llama):
    """After the rewrite no backward node reads a recomputed original: their last uses are in
    the forward, and the copies sit in the backward, after the seed."""
    gm = _copy(llama.gm)
    plan = remat.recompute_plan(gm, ACPolicy.FULL)
    originals = {n.name for n in plan.recompute}
    remat.apply(gm, ACPolicy.FULL)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    start = order[regions.backward_start(gm)]
    alive = [n for n in gm.graph.nodes if n.name in originals]
    assert alive, "the forward still computes the recomputed values"
    for n in alive:
        assert all(order[u] < start for u in n.users), n.format_node()
    copies = [n for n in gm.graph.nodes if remat.recomputed_from(n) is not None]
    assert len(copies) == len(originals)
    assert all(order[c] > start for c in copies)
    assert {remat.recomputed_from(c) for c in copies} == originals


def test_none_changes_nothing(llama):
    gm = _copy(llama.gm)
    code = gm.code
    assert remat.apply(gm, "none") == 0 and gm.code == code
    assert remat.recompute_plan(gm, ACPolicy.NONE).recompute == []


# ---------------------------------------------------------------------------------------------
# What each policy keeps.
# ---------------------------------------------------------------------------------------------


def test_full_keeps_one_residual_value_per_layer():
    """Full keeps each layer's input: one more layer saves exactly one more value, of the
    residual stream's shape; attention outputs and the residual between attention and MLP are
    recomputed."""
    saved = {}
    for layers in (2, 3):
        gm = _canonical("llama-tiny", layers=layers).gm
        saved[layers] = remat.recompute_plan(gm, ACPolicy.FULL).saved
    assert len(saved[3]) - len(saved[2]) == 1
    residual = [n for n in saved[3] if n.target is aten.add.Tensor]
    assert len(residual) == 3  # the inputs of layers 1 and 2, and of the head
    embedding = next(n for n in saved[3] if n.target is aten.embedding.default)  # layer 0's input
    assert {tuple(n.meta["val"].shape) for n in residual} == {tuple(embedding.meta["val"].shape)}
    assert not any(n.args and isinstance(n.args[0], fx.Node) and remat.is_attention(n.args[0])
                   for n in saved[3])


LLAMA_MATMULS_PER_LAYER = 7  # q, k, v, o, w1, w3, w2


def test_selective_keeps_every_other_matmul_of_a_layer_and_attention(llama):
    gm = llama.gm
    plan = remat.recompute_plan(gm, ACPolicy.SELECTIVE)
    start = regions.backward_start(gm)
    matmuls = []
    for n in gm.graph.nodes:
        if n is start:
            break
        if remat.is_matmul(n):
            matmuls.append(n)
    assert len(matmuls) == 2 * LLAMA_MATMULS_PER_LAYER + 1  # and the head's
    recomputed = set(plan.recompute)
    for layer in range(2):
        own = matmuls[layer * LLAMA_MATMULS_PER_LAYER:(layer + 1) * LLAMA_MATMULS_PER_LAYER]
        assert not recomputed & set(own[0::2])  # 1st, 3rd, ... kept (counted per layer)
        assert recomputed & set(own[1::2])
    assert matmuls[-1] not in recomputed
    attention = [n for n in gm.graph.nodes if remat.is_attention(n)]
    assert len(attention) == 2 and not any(a in recomputed for a in attention)
    # What the attention backward reads of the forward kernel: its output and logsumexp, saved.
    assert {u for a in attention for u in a.users} <= set(plan.saved)


def test_lowered_program_collectives_follow_the_policy():
    """On the per-rank program (FSDP x TP with sequence parallelism): all_gathers are recomputed
    (as FSDP re-gathers parameters in the backward), reduce_scatters only under full, and a
    recomputed collective always comes with its own wait."""
    from shardwise.cli.run import make_plan_for
    from shardwise.lower import lower
    from shardwise.mesh import parse_mesh

    traced = _canonical("llama-tiny")
    # Dim names no other in-process test uses: once a 2x2 mesh was lowered on, a later change of
    # the fake world size leaves torch resolving that mesh's layout and names to its old, dead
    # groups ("Could not resolve the process group"), which would break the next test lowering
    # on the same mesh.
    mesh = parse_mesh("2x2", "data,tp", "h100")
    program = lower(traced, make_plan_for("fsdp_tp_sp", traced, mesh, "llama-tiny", True))
    kinds = {}
    for policy in POLICIES:
        plan = remat.recompute_plan(program.gm, policy)
        rec = set(plan.recompute)
        ops = [c for n in plan.recompute if (c := collective(n)) is not None and c.op is n]
        for c in ops:
            assert c.wait in rec, c.op.format_node()
        for w in (n for n in rec if is_wait(n)):
            assert w.args[0] in rec
        kinds[policy] = {c.kind.value for c in ops}
        gm = _copy(program.gm)
        before = sum(1 for n in gm.graph.nodes if collective(n) is not None and not is_wait(n))
        assert remat.apply(gm, policy) == len(plan.recompute)
        after = sum(1 for n in gm.graph.nodes if collective(n) is not None and not is_wait(n))
        assert after > before  # re-gathered in the backward
    assert kinds[ACPolicy.SELECTIVE] == {"all_gather"}
    assert kinds[ACPolicy.FULL] <= {k.value for k in remat.RECOMPUTED_COLLECTIVES[ACPolicy.FULL]}


def _scattered_step(group: str):
    """A joint step whose backward reads a value computed from a reduce_scatter's output (off
    the residual stream): selective keeps the reduce_scatter, full runs it again."""

    def step(w, x):
        y = w * x.repeat(2)
        t = torch.tanh(c10d.wait_tensor(c10d.reduce_scatter_tensor(y, "sum", 2, group)))
        loss = (x + t).sum()
        seed = torch.ones_like(loss)
        grad = (seed * (1 - t * t)).repeat(2) * x.repeat(2)
        return loss, grad

    return step


def test_reduce_scatter_is_kept_by_selective_and_recomputed_by_full():
    ensure_fake_world(2)
    fn = _scattered_step(G.world_group())
    gm = G.trace(fn, torch.randn(8), torch.randn(4))
    inputs = G.spmd_inputs(fn, [(8,), (4,)], 2)
    ref = G.run_spmd(gm, inputs)
    scatters = {}
    for policy in POLICIES:
        rewritten = _copy(gm)
        remat.apply(rewritten, policy)
        scatters[policy] = G.count(rewritten, c10d.reduce_scatter_tensor.default)
        assert G.max_rel_err(ref, G.run_spmd(rewritten, inputs)) <= MAX_REL_ERR
    assert scatters == {ACPolicy.SELECTIVE: 1, ACPolicy.FULL: 2}


# ---------------------------------------------------------------------------------------------
# Refusals: what is never recomputed.
# ---------------------------------------------------------------------------------------------


def test_inference_graph_is_left_alone():
    gm = _canonical("llama-tiny", train=False).gm
    plan = remat.recompute_plan(gm, ACPolicy.FULL)
    assert plan.recompute == [] and plan.start is None and "no backward" in plan.reason
    assert remat.apply(gm, ACPolicy.FULL) == 0


def test_unknown_policy_is_one_sentence():
    with pytest.raises(UserError, match="unknown activation checkpointing policy 'sometimes'"):
        remat.parse_policy("sometimes")
    assert remat.parse_policy("FULL") is ACPolicy.FULL


class _DropoutBlocks(nn.Module):
    """Two residual blocks with dropout: a random op in the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.tanh(self.a(x))
        h = x + a * (torch.rand_like(a) > DROP_P) / (1 - DROP_P)  # dropout, functional form
        h = h + torch.tanh(self.b(h))
        return self.head(h).pow(2).mean()


def test_random_ops_are_not_recomputed():
    torch.manual_seed(0)
    model = _DropoutBlocks()
    x = torch.randn(4, 8)
    gm = trace(model, x).gm
    randoms = [n for n in gm.graph.nodes if remat.is_random(n)]
    assert randoms
    plan = remat.recompute_plan(gm, ACPolicy.FULL)
    assert plan.recompute and not set(randoms) & set(plan.recompute)
    args = [p.detach() for p in model.parameters()] + [x]
    rewritten = _copy(gm)
    remat.apply(rewritten, ACPolicy.FULL)
    torch.manual_seed(1)
    ref = _outputs(gm, args)
    torch.manual_seed(1)  # same draws: the dropout mask is drawn once, in the forward, by both
    for a, b in zip(_outputs(rewritten, args), ref, strict=True):
        torch.testing.assert_close(a, b, rtol=MAX_REL_ERR, atol=0.0)


def test_attention_without_dropout_is_deterministic(llama):
    sdpa = next(n for n in llama.gm.graph.nodes if remat.is_attention(n))
    assert torch.Tag.nondeterministic_seeded in sdpa.target.tags and not remat.is_random(sdpa)


def _mutating_step(w: torch.Tensor, x: torch.Tensor):
    """A hand-written joint step whose forward writes an intermediate in place."""
    y = torch.tanh(x * w)
    z = y.clone()
    z.add_(1.0)  # in place: z's value depends on when it is read
    b = torch.exp(y)  # off the main chain: recomputable
    loss = (torch.sin(z) + b).sum()
    seed = torch.ones_like(loss)
    grad = seed * (torch.cos(z) + b) * x
    return loss, grad


def test_values_written_in_place_are_not_recomputed():
    gm = make_fx(_mutating_step)(torch.randn(4), torch.randn(4))
    written = remat.written_values(gm.graph)
    add_ = next(n for n in gm.graph.nodes if remat.is_mutating(n))
    assert add_ in written and add_.args[0] in written
    plan = remat.recompute_plan(gm, ACPolicy.FULL)
    for n in plan.recompute:
        assert n not in written and not any(a in written for a in n.all_input_nodes), n.format_node()
    assert [n.target for n in plan.recompute] == [aten.exp.default]  # read from the saved tanh
    args = [torch.randn(4), torch.randn(4)]
    rewritten = _copy(gm)
    remat.apply(rewritten, ACPolicy.FULL)
    for a, b in zip(rewritten(*args), gm(*args), strict=True):
        torch.testing.assert_close(a, b)


def test_safety_predicates():
    gm = make_fx(_mutating_step)(torch.randn(4), torch.randn(4))
    written = remat.written_values(gm.graph)
    tanh = next(n for n in gm.graph.nodes if n.target is aten.tanh.default)
    ones = next(n for n in gm.graph.nodes if n.target is aten.ones_like.default)
    ph = next(n for n in gm.graph.nodes if n.op == "placeholder")
    assert remat.safe_to_recompute(tanh, written)
    assert not remat.safe_to_recompute(ph, written)  # always available, never copied
    assert regions.backward_start(gm) is ones
    assert regions.input_placeholders(gm) == [n for n in gm.graph.nodes if n.op == "placeholder"][1:]


def _views(w: torch.Tensor, x: torch.Tensor):
    y = torch.tanh(x * w)
    return w.t(), y.view(-1), y.t(), y


def test_saved_bytes_count_each_allocation_once():
    gm = make_fx(_views)(torch.randn(4, 4), torch.randn(4, 4))
    wt, yv, yt, y = list(gm.graph.nodes)[-1].args[0]
    one = 4 * 4 * 4  # a 4x4 fp32 tensor
    assert regions.alias_root(yt) is y and regions.alias_root(wt).op == "placeholder"
    assert remat.saved_bytes(gm, [wt]) == 0  # a parameter's transpose lives with the parameter
    assert remat.saved_bytes(gm, [yv, yt, y]) == one


def test_registry_and_options():
    assert PASSES["remat"] == "shardwise.passes.remat"
    gm = _copy(_canonical("llama-tiny").gm)
    assert get_pass("remat")(gm, policy="selective") > 0


# ---------------------------------------------------------------------------------------------
# The command line.
# ---------------------------------------------------------------------------------------------


def _error(capsys, *argv: str) -> str:
    assert main(["run", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err
    return err


def test_unknown_ac_is_refused(capsys):
    assert "--ac 'most': unknown activation checkpointing policy" in _error(capsys, "--ac", "most")


def test_ac_with_inference_is_refused(capsys):
    err = _error(capsys, "--ac", "full", "--inference")
    assert "--inference run has no backward" in err


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["full", "selective"])
def test_run_with_ac_on_gloo_ranks(policy):
    """The acceptance command: FSDP x TP with sequence parallelism on a 2x2 mesh of gloo ranks,
    checked against the single-process step; JSON on stdout, parsed whole."""
    argv = [sys.executable, "-m", "shardwise", "run", "--model", "llama-tiny", "--mesh", "2x2",
            "--mesh-names", "dp,tp", "--plan", "fsdp_tp_sp", "--ac", policy, "--check", "--json",
            "--timeout", "150"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    assert out["max_rel_err"] <= MAX_REL_ERR
    ac = out["ac"]
    assert ac["policy"] == policy and ac["recomputed_nodes"] > 0
    saved = ac["saved_activation_bytes"]
    assert 0 < saved["with"] < saved["without"]
    # The backward re-gathers parameters: the program runs more all_gathers than the plan's.
    assert out["collectives"]["measured"] == out["collectives"]["program"]
    assert out["collectives"]["program"]["all_gather"]["count"] > \
        out["collectives"]["predicted"]["all_gather"]["count"]


# ---------------------------------------------------------------------------------------------
# Per-layer policies.
# ---------------------------------------------------------------------------------------------

MIXED = remat.LayerPolicies((ACPolicy.FULL, ACPolicy.SELECTIVE, ACPolicy.NONE))


@pytest.mark.parametrize("model", ["llama-tiny", hf_model_name("gemma2")])
def test_layer_starts_are_one_per_decoder_layer(model):
    """With a fused attention kernel, or transformers' eager attention (Gemma-2: its softmax marks
    the block's attention)."""
    traced = _canonical(model, layers=3)
    gm = traced.gm
    plan = remat.recompute_plan(gm, ACPolicy.FULL)
    fwd = [n for n in gm.graph.nodes if n in plan.kept or n in set(plan.recompute)]
    assert fwd
    regs = remat._regions(gm)
    exit_node = next(a for a in regs.start.all_input_nodes if a in regs.fwd and regions.is_scalar(a))
    spine_nodes = regions.spine(regs.forward, exit_node, regions.input_placeholders(gm))
    starts = remat.layer_starts(spine_nodes, regs.forward)
    assert len(starts) == 3
    layer = remat.layer_of(regs.forward, starts)
    attention = [n for n in regs.forward if remat.marks_attention(n)]
    assert [layer[n] for n in attention] == [0, 1, 2]


def test_uniform_layer_policies_are_the_global_policy():
    gm = _canonical("llama-tiny", layers=3).gm
    for policy in ACPolicy:
        a = remat.recompute_plan(gm, remat.LayerPolicies((policy,) * 3))
        b = remat.recompute_plan(gm, policy)
        assert (a.recompute, a.saved, a.kept) == (b.recompute, b.saved, b.kept)


def test_mixed_layers_lie_between_none_and_full_and_run_the_same():
    """First layer full, second selective, third none: the saved bytes lie strictly between
    all-none and all-full, every recomputed node of the layer run with none is absent, and the
    rewritten step gives the original's loss and gradients."""
    model = "llama-tiny"
    gm = _canonical(model, layers=3).gm
    saved = {p: remat.saved_bytes(gm, remat.recompute_plan(gm, p).saved) for p in ACPolicy}
    mixed = remat.recompute_plan(gm, MIXED)
    got = remat.saved_bytes(gm, mixed.saved)
    assert saved[ACPolicy.FULL] < got < saved[ACPolicy.NONE]
    # Reversing the layers' policies recomputes other nodes, the same number of bytes per layer.
    rev = remat.recompute_plan(gm, remat.LayerPolicies(tuple(reversed(MIXED.layers))))
    assert set(rev.recompute) != set(mixed.recompute)
    args = _runnable(model, gm)
    ref = _outputs(gm, args)
    rewritten = _copy(gm)
    assert remat.apply(rewritten, MIXED) == len(mixed.recompute) > 0
    for a, b in zip(_outputs(rewritten, args), ref, strict=True):
        torch.testing.assert_close(a, b, rtol=MAX_REL_ERR, atol=0.0)
    _, after = run_measured(rewritten, args)
    assert after == got


def test_layer_policies_of_another_depth_are_one_sentence(llama):
    with pytest.raises(UserError, match="names 3 layers but the graph has 2"):
        remat.recompute_plan(llama.gm, MIXED)


@pytest.mark.slow
def test_lowered_program_runs_mixed_layers_on_gloo():
    """The per-rank FSDP x TP program with the first layer fully checkpointed and the second not,
    on 4 gloo ranks: the same loss and gradients as the single-process step."""
    from shardwise.cli.run import make_plan_for, with_remat
    from shardwise.lower import lower
    from shardwise.mesh import parse_mesh
    from shardwise.runtime.launch import run_many

    traced = _canonical("llama-tiny")
    mesh = parse_mesh("2x2", "data,tp", "h100")
    program = lower(traced, make_plan_for("fsdp_tp_sp", traced, mesh, "llama-tiny", True))
    policies = remat.LayerPolicies((ACPolicy.FULL, ACPolicy.NONE))
    rematted, n = with_remat(program, policies)
    assert 0 < n < len(remat.recompute_plan(program.gm, ACPolicy.FULL).recompute)
    base, res = run_many([program, rematted], "gloo", check=True, timeout_s=120, measure_activations=True)
    assert base.max_rel_err <= MAX_REL_ERR and res.max_rel_err <= MAX_REL_ERR
    assert res.loss == base.loss
    assert res.saved_activation_bytes < base.saved_activation_bytes


@pytest.mark.slow
def test_run_executes_the_ac_a_plan_file_records(tmp_path):
    """``shardwise run --plan plan.json`` without --ac runs the plan's per-layer choice (one layer
    full, one none) and checks loss and gradients against the single-process step."""
    from shardwise.cli.run import make_plan_for
    from shardwise.mesh import parse_mesh
    from shardwise.plan.plan import ACChoice, ACGroup

    traced = _canonical("llama-tiny")
    plan = make_plan_for("fsdp", traced, parse_mesh("2", None, "h100"), "llama-tiny", True)
    plan.ac = ACChoice((ACGroup((0, 1), none=1, selective=0, full=1),))
    path = tmp_path / "mixed.json"
    plan.save(path)
    out = json_object(cli("run", "--model", "llama-tiny", "--layers", "2", "--mesh", "2", "--plan", str(path),
                          "--check", "--json", "--timeout", "120"))
    assert out["ac"]["policy"] == "none x 1, full x 1" and out["ac"]["recomputed_nodes"] > 0
    assert out["max_rel_err"] <= MAX_REL_ERR
    saved = out["ac"]["saved_activation_bytes"]
    assert saved["with"] < saved["without"]
