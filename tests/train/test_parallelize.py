"""``shardwise.train.parallelize``: a user's module trained under torchrun with torch's own optimizer,
clipping and DCP, against the same module trained in one process; and the pieces it is built of."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard

from shardwise.errors import UserError
from shardwise.lower.spmd import Layout
from shardwise.runtime.launch import rel_err
from shardwise.train import init_values, params_on_meta
from shardwise.train.module import init_state_dict
from tests.helpers import HF_TINY, spawn
from tests.train import gpt2

REPO = Path(__file__).resolve().parents[2]
TORCHRUN_TIMEOUT_S = 600


def _plain_gpt2(steps: int, seed: int) -> tuple[gpt2.GPT2, list[float]]:
    """The GPT-2 module trained in one process exactly as the torchrun script trains it."""
    model = gpt2.GPT2()
    shapes = {k: (tuple(p.shape), p.dtype) for k, p in model.named_parameters()}
    with torch.no_grad():
        for k, v in init_state_dict(shapes, seed).items():
            model.get_parameter(k).copy_(v)
    opt = torch.optim.AdamW(model.parameters(), lr=gpt2.LR, weight_decay=gpt2.WEIGHT_DECAY)
    losses = []
    for step in range(steps):
        idx, tgt = gpt2.batch(step)
        loss = gpt2.loss_fn(model(idx), idx, tgt)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), gpt2.CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return model, losses


@pytest.mark.slow
def test_user_module_trains_under_torchrun_like_one_process(tmp_path):
    steps = 15
    # A rank that dies of a signal prints its Python stack (torchrun's own report names only the
    # signal, and its summary would push the rank's message out of the tail shown below).
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    torchrun = Path(sys.executable).with_name("torchrun")
    proc = subprocess.run([str(torchrun), "--nproc-per-node", "4", str(REPO / "tests/train/gpt2.py"),
                           str(tmp_path), str(steps)], env=env, capture_output=True, text=True,
                          timeout=TORCHRUN_TIMEOUT_S, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-8000:]
    got = json.loads((tmp_path / "result.json").read_text())
    # Parameters really are sharded (FSDP over dp), under the module's own names, tied head folded.
    assert got["placements"]["h.0.fc.weight"].startswith("(Shard(dim=0)")
    assert "lm_head.weight" not in got["placements"] and "wte.weight" in got["placements"]

    model, want = _plain_gpt2(steps, seed=7)
    assert want[-1] < want[0] - 0.5  # it learns
    rel = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], want, strict=True))
    assert rel <= 1e-4, (got["losses"], want)

    # pm.eval() ran the inference program: the logits of the trained weights.
    with torch.no_grad():
        logits = model(gpt2.batch(steps)[0])
    assert torch.allclose(torch.tensor(got["logits"]), logits, rtol=1e-4, atol=1e-5)

    # The DCP checkpoint the ranks saved loads into the plain single-device module.
    import torch.distributed.checkpoint as dcp

    plain = gpt2.GPT2()
    state = {"model": plain.state_dict()}
    dcp.load(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    plain.load_state_dict(state["model"])
    trained = torch.load(tmp_path / "params.pt")
    for k, p in model.named_parameters():
        assert torch.equal(plain.get_parameter(k).detach(), trained[k]), k
        # Adam normalises gradients, so float-rounding differences in near-zero gradients move a
        # few elements by a visible fraction of a step: compare at the tensor's scale.
        assert rel_err(trained[k], p.detach()) <= 1e-3, k


# ---------------------------------------------------------------------------------------------
# The pieces, in one process.
# ---------------------------------------------------------------------------------------------


def test_init_values_are_the_same_numbers_whatever_the_shard():
    shape = (12, 10)
    full = init_values("layer.w", shape, torch.float32, seed=3)
    assert full.std().item() == pytest.approx(0.02, rel=0.3)
    for placements in [(Shard(0), Shard(1)), (Shard(1), Shard(0)), (Shard(0), Replicate())]:
        lay = Layout("w", shape, torch.float32, placements, (2, 2))
        for coord in [(0, 0), (0, 1), (1, 0), (1, 1)]:
            idx = lay.index(coord)
            assert torch.equal(init_values("layer.w", shape, torch.float32, 3, idx), full[idx])
            assert torch.equal(lay.shard(full, coord), full[idx])
    assert not torch.equal(full, init_values("layer.w", shape, torch.float32, seed=4))
    assert torch.equal(init_values("norm.weight", (5,), torch.float32, 0), torch.ones(5))
    assert torch.equal(init_values("fc.bias", (5,), torch.float32, 0), torch.zeros(5))


def test_a_piece_spanning_several_blocks_is_the_whole_sliced(monkeypatch):
    import shardwise.train.module as module

    monkeypatch.setattr(module, "INIT_BLOCK_ELEMENTS", 24)  # three rows a block
    whole = init_values("emb", (40, 8), torch.float32, seed=1)
    piece = init_values("emb", (40, 8), torch.float32, 1, (slice(7, 23), slice(2, 6)))
    assert torch.equal(piece, whole[7:23, 2:6])


def test_params_on_meta_keeps_buffers_real():
    class WithBuffer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4096, 4096)
            self.register_buffer("table", torch.arange(4.0))

    with params_on_meta():
        m = WithBuffer()
    assert m.lin.weight.is_meta and m.lin.bias.is_meta
    assert torch.equal(m.table, torch.arange(4.0))
    assert not torch.nn.Linear(2, 2).weight.is_meta  # only inside the context


def test_one_device_module_is_the_model(one_process_group):
    """On a mesh of one, the parallel module computes the model's own loss and gradients."""
    import shardwise.train as sw

    torch.manual_seed(0)
    model = gpt2.GPT2()
    idx, tgt = gpt2.batch(0)
    want = gpt2.loss_fn(model(idx), idx, tgt)
    want.backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    pm = sw.parallelize(model, "1", [idx, tgt], plan="ddp", loss_fn=gpt2.loss_fn, time_limit_s=20)
    loss = pm(*pm.shard_inputs(idx, tgt))
    loss.backward()
    assert torch.allclose(loss, want, rtol=1e-5)
    for k, p in pm.named_parameters():
        assert torch.allclose(p.grad.full_tensor(), grads[k], rtol=1e-4, atol=1e-6), k


def test_fp32_master_weights_of_a_bf16_model_keep_the_updates_bf16_rounds_away(one_process_group):
    """master_dtype=fp32: the parameters, their gradients and AdamW's moments are fp32 while the
    program computes in bf16 (the same loss as with bf16 weights); so an update under bf16's
    resolution (1e-4 on LayerNorm scales of 1, bf16's spacing there 2^-8) still lands, where in
    bf16 weights it rounds away."""
    import shardwise.train as sw

    idx, tgt = gpt2.batch(0)

    def model() -> gpt2.GPT2:
        torch.manual_seed(0)
        return gpt2.GPT2().to(torch.bfloat16)

    want = gpt2.loss_fn(model()(idx), idx, tgt)
    moved, losses = {}, {}
    for master in (torch.float32, None):
        pm = sw.parallelize(model(), "1", [idx, tgt], plan="ddp", loss_fn=gpt2.loss_fn, time_limit_s=20,
                            master_dtype=master)
        loss = pm(*pm.shard_inputs(idx, tgt))
        loss.backward()
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-4, weight_decay=0.0)
        opt.step()
        scale = pm.get_parameter("h.0.ln_1.weight")
        dtype = master or torch.bfloat16
        assert scale.dtype == scale.grad.dtype == opt.state[scale]["exp_avg"].dtype == dtype
        moved[dtype] = float((scale.detach().full_tensor().double() - 1.0).abs().max())
        losses[dtype] = loss
    assert losses[torch.float32].dtype == torch.bfloat16
    assert torch.equal(losses[torch.float32], losses[torch.bfloat16])
    assert torch.allclose(losses[torch.float32], want, rtol=1e-2)
    assert moved[torch.float32] == pytest.approx(1e-4, rel=0.05)  # Adam's first step: lr * sign(grad)
    assert moved[torch.bfloat16] == 0.0


class _TorchAttention(torch.nn.Module):
    """Attention from torch.nn (no ``layers.N`` in its parameters' names): the planner finds no
    decoder layer to checkpoint, the remat pass one attention block."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(50, 32)
        self.att = torch.nn.MultiheadAttention(32, 4, batch_first=True)
        self.head = torch.nn.Linear(32, 50)

    def forward(self, idx: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        a, _ = self.att(h, h, h, need_weights=False)
        return torch.nn.functional.cross_entropy(self.head(a + h).flatten(0, 1), tgt.flatten())


def test_attention_outside_named_layers_plans_auto_and_is_the_model(one_process_group):
    """The auto plan's checkpointing choice names no layer; it runs as none (it failed: "names 0
    layers but the graph has 1")."""
    import shardwise.train as sw

    torch.manual_seed(0)
    model = _TorchAttention()
    idx, tgt = torch.randint(0, 50, (8, 16)), torch.randint(0, 50, (8, 16))
    want = model(idx, tgt)
    want.backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    pm = sw.parallelize(model, "1", [idx, tgt], plan="auto", time_limit_s=20)
    loss = pm(*pm.shard_inputs(idx, tgt))
    loss.backward()
    assert torch.allclose(loss, want, rtol=1e-5)
    for k, p in pm.named_parameters():
        assert torch.allclose(p.grad.full_tensor(), grads[k], rtol=1e-4, atol=1e-6), k


def test_a_forward_of_the_tokens_alone_trains_through_loss_fn(one_process_group):
    """With ``loss_fn`` the model's forward takes the inputs but the last, the labels, which reach
    ``loss_fn`` only: the step's loss is the model's, the inference program's output its logits."""
    import shardwise.train as sw

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 32), torch.nn.Linear(32, 50))
    idx, tgt = torch.randint(0, 50, (8, 16)), torch.randint(0, 50, (8, 16))

    def loss_fn(logits: torch.Tensor, idx: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tgt.flatten())

    with torch.no_grad():
        logits = model(idx)
    want = loss_fn(logits, idx, tgt)
    pm = sw.parallelize(model, "1", [idx, tgt], plan="ddp", loss_fn=loss_fn, time_limit_s=20)
    assert torch.allclose(pm(*pm.shard_inputs(idx, tgt)), want, rtol=1e-5)
    pm.eval()
    with torch.no_grad():
        out = pm(*pm.shard_inputs(idx))
    assert torch.allclose(out.full_tensor(), logits, rtol=1e-5, atol=1e-6)


def test_a_transformers_model_as_it_comes_trains_and_answers_with_its_own_output(one_process_group):
    """A transformers causal LM handed over unwrapped: ``loss_fn`` reads its ``ModelOutput``'s
    logits, and the inference program answers with a ``ModelOutput`` too. Its key/value cache is
    no tensor an inference program can return: one sentence says to turn it off."""
    import transformers

    import shardwise.train as sw

    config = json.loads(HF_TINY["llama"].read_text())
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))
    ids = torch.randint(0, model.config.vocab_size, (4, 16))

    def loss_fn(out, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())

    with torch.no_grad():
        logits = model(ids).logits
    pm = sw.parallelize(model, "1", [ids, ids], plan="ddp", loss_fn=loss_fn, time_limit_s=20)
    want = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    assert torch.allclose(pm(*pm.shard_inputs(ids, ids)), want, rtol=1e-5)
    pm.eval()
    with torch.no_grad(), pytest.raises(UserError, match="returns a DynamicCache among its outputs; .* "
                                                          "set config.use_cache = False"):
        pm(*pm.shard_inputs(ids))
    model.config.use_cache = False
    with torch.no_grad():
        out = pm(*pm.shard_inputs(ids))
    assert isinstance(out, transformers.modeling_outputs.CausalLMOutputWithPast)
    assert torch.allclose(out.logits.full_tensor(), logits, rtol=1e-5, atol=1e-6)


def test_gradients_reach_every_way_autograd_hands_them_out(one_process_group):
    """``loss.backward()`` puts the gradients in ``.grad`` directly, but hooks, accumulation,
    ``backward(inputs=...)`` and ``torch.autograd.grad`` see the same gradients as through
    autograd."""
    import shardwise.train as sw

    torch.manual_seed(0)
    model = gpt2.GPT2()
    idx, tgt = gpt2.batch(0)
    pm = sw.parallelize(model, "1", [idx, tgt], plan="ddp", loss_fn=gpt2.loss_fn, time_limit_s=20)
    params = dict(pm.named_parameters())
    step = pm.shard_inputs(idx, tgt)

    want = dict(zip(params, torch.autograd.grad(pm(*step), list(params.values())), strict=True))
    assert all(p.grad is None for p in params.values())  # autograd.grad leaves .grad alone

    pm(*step).backward()
    for k, p in params.items():
        assert torch.equal(p.grad.full_tensor(), want[k].full_tensor()), k
    (2.0 * pm(*step)).backward()  # accumulated, and scaled by the loss's incoming gradient
    for k, p in params.items():
        assert torch.allclose(p.grad.full_tensor(), 3.0 * want[k].full_tensor(), rtol=1e-6), k
    # The gradients take in-place updates: clipping scales them, an optimizer working on the local
    # shards writes those, zero_grad zeroes them.
    norm = torch.nn.utils.clip_grad_norm_(pm.parameters(), 1e-3)
    assert norm > 1e-3
    clipped = torch.cat([p.grad.full_tensor().flatten() for p in params.values()])
    assert torch.allclose(clipped.norm(), torch.tensor(1e-3), rtol=1e-3)
    for p in params.values():
        p.grad.to_local().mul_(2.0)
    assert torch.allclose(torch.cat([p.grad.full_tensor().flatten() for p in params.values()]), 2.0 * clipped)
    pm.zero_grad(set_to_none=False)
    assert all(not p.grad.full_tensor().any() for p in params.values())

    pm.zero_grad()
    hooked, only = params["wte.weight"], params["h.0.fc.weight"]
    seen = []
    hooked.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.full_tensor().clone()))
    doubled = params["ln_f.weight"]
    doubled.register_hook(lambda g: 2.0 * g)
    pm(*step).backward(inputs=[hooked, only, doubled])
    assert len(seen) == 1 and torch.equal(seen[0], want["wte.weight"].full_tensor())
    assert torch.equal(only.grad.full_tensor(), want["h.0.fc.weight"].full_tensor())
    assert torch.equal(doubled.grad.full_tensor(), 2.0 * want["ln_f.weight"].full_tensor())
    assert all(p.grad is None for k, p in params.items()
               if k not in ("wte.weight", "h.0.fc.weight", "ln_f.weight"))


def test_meta_model_refuses_to_run_before_init(one_process_group):
    import shardwise.train as sw

    with params_on_meta():
        model = gpt2.GPT2()
    idx, tgt = gpt2.batch(0)
    pm = sw.parallelize(model, "1", [idx, tgt], plan="ddp", loss_fn=gpt2.loss_fn, time_limit_s=20)
    with pytest.raises(UserError, match="init_weights"):
        pm(*pm.shard_inputs(idx, tgt))
    pm.init_weights(0)
    assert torch.isfinite(pm(*pm.shard_inputs(idx, tgt)))


def test_inputs_of_other_shapes_are_refused(one_process_group):
    import shardwise.train as sw

    idx, tgt = gpt2.batch(0)
    pm = sw.parallelize(gpt2.GPT2(), "1", [idx, tgt], plan="ddp", loss_fn=gpt2.loss_fn, time_limit_s=20)
    with pytest.raises(UserError, match=r"input 0 has shape .*traced for"):
        pm.shard_inputs(idx[:1], tgt)
    with pytest.raises(UserError, match=r"input 1 has shape .*this rank's slice of it is"):
        pm(idx, tgt[:, :-1])
    with pytest.raises(UserError, match="takes 2 inputs, got 1"):
        pm(idx)
    assert torch.isfinite(pm(*pm.shard_inputs(idx, tgt)))


def test_forward_without_scalar_loss_is_refused(one_process_group):
    import shardwise.train as sw

    class Logits(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(gpt2.VOCAB, 8)

        def forward(self, idx: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
            return self.emb(idx)

    idx, tgt = gpt2.batch(0)
    with pytest.raises(UserError, match="scalar loss"):
        sw.parallelize(Logits(), "1", [idx, tgt], plan="ddp")
    # GPT2.forward takes the tokens alone: without a loss_fn it would be given the labels too
    with pytest.raises(UserError, match=r"^GPT2.forward cannot take the 2 input\(s\) the step gives it "):
        sw.parallelize(gpt2.GPT2(), "1", [idx, tgt], plan="ddp")


def test_unknown_plan_and_pass_are_refused(one_process_group):
    import shardwise.train as sw

    idx, tgt = gpt2.batch(0)
    with pytest.raises(UserError, match="neither auto"):
        sw.parallelize(gpt2.GPT2(), "1", [idx, tgt], plan="zero3", loss_fn=gpt2.loss_fn)
    with pytest.raises(UserError, match="unknown pass"):
        sw.parallelize(gpt2.GPT2(), "1", [idx, tgt], loss_fn=gpt2.loss_fn, passes=["fuse_everything"])


def test_mesh_without_process_group_is_refused():
    import shardwise.train as sw

    idx, tgt = gpt2.batch(0)
    assert not dist.is_initialized() or dist.get_backend() == "fake"
    with pytest.raises(UserError, match="torchrun"):
        sw.parallelize(gpt2.GPT2(), "2x2", [idx, tgt], loss_fn=gpt2.loss_fn)


def test_a_checkpoint_restores_the_generator_dropout_draws_from(one_process_group, tmp_path):
    """Resuming draws the numbers training would have drawn next (a dropout model's masks), from a
    checkpoint of this format or of the one that kept the CPU state alone."""
    import shardwise.train as sw
    from shardwise.train import checkpoint

    model = gpt2.GPT2()
    idx, tgt = gpt2.batch(0)
    pm = sw.parallelize(model, "1", [idx, tgt], plan="ddp", loss_fn=gpt2.loss_fn, time_limit_s=20)
    opt = torch.optim.AdamW(pm.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    torch.manual_seed(3)
    path = checkpoint.save(tmp_path, 1, pm, opt, sched, "gpt2")
    want = torch.rand(4)
    assert set(torch.load(path / checkpoint.RNG)) == {"cpu"}
    torch.manual_seed(99)
    checkpoint.load(tmp_path, pm, opt, sched, "gpt2")
    assert torch.equal(torch.rand(4), want)
    torch.manual_seed(3)  # the format before: the CPU state alone
    torch.save(torch.get_rng_state(), path / checkpoint.RNG)
    torch.manual_seed(99)
    checkpoint.load(tmp_path, pm, opt, sched, "gpt2")
    assert torch.equal(torch.rand(4), want)


def _share(rank: int, world: int) -> dict:
    """``share_program`` over a 2x2 mesh, lowering, then failing with a user's error and with a
    bug: what each rank received and whether it lowered."""
    from torch.distributed.device_mesh import init_device_mesh

    from shardwise.ir.match import all_collectives
    from shardwise.ir.trace import trace_model
    from shardwise.lower.spmd import lower_on
    from shardwise.mesh import Mesh
    from shardwise.passes.pipeline import canonicalize
    from shardwise.plan.planner import make_plan
    from shardwise.train.module import share_program

    device_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    traced = trace_model("llama-tiny", train=True, layers=1, batch=4, seq=16)
    canonicalize(traced)
    plan = make_plan(traced, Mesh((2, 2), ("dp", "tp")), baseline="fsdp_tp")
    out: dict = {}
    for failure in (None, "user", "bug"):
        made = []

        def make(failure=failure, made=made):
            made.append(rank)
            if failure == "user":
                raise UserError("this plan cannot be lowered.")
            if failure == "bug":
                raise ValueError("a bug in the lowering")
            return lower_on(traced, plan, device_mesh, rank=rank)

        try:
            program = share_program(make, traced, plan, device_mesh)
        except Exception as e:
            out[failure] = {"made": made, "error": f"{type(e).__name__}: {e}"}
            continue
        own = {device_mesh.get_group(d).group_name for d in range(2)}
        groups = {c.group_name for c in all_collectives(program.gm.graph)}
        out[failure] = {"made": made, "own": sorted(own), "groups": sorted(groups), "rank": program.rank,
                        "code_lines": len(program.gm.code.splitlines()),
                        "placeholders": [lay.name for lay in program.placeholders]}
    return out


@pytest.mark.slow
def test_one_rank_lowers_and_every_rank_runs_its_program_on_its_own_groups():
    """Rank 0 alone lowers; the others get its graph with the collectives on their own groups
    (their names differ from rank 0's: each rank's dp group is another set of ranks). A failure
    on rank 0 reaches every rank as an exception instead of a wait forever."""
    ranks = spawn(_share, 4)
    got = [r[None] for r in ranks]
    assert [g["made"] for g in got] == [[0], [], [], []]
    assert all(g["groups"] and set(g["groups"]) <= set(g["own"]) for g in got)
    assert {tuple(g["own"]) for g in got} != {tuple(got[0]["own"])}  # ranks name their groups differently
    assert len({g["code_lines"] for g in got}) == 1 and [g["rank"] for g in got] == [0, 1, 2, 3]
    assert all(g["placeholders"] == got[0]["placeholders"] for g in got)
    # Rank 0 raises its own exception; the others a user's error as it is, a bug as a RuntimeError.
    user = "UserError: this plan cannot be lowered."
    bug = "RuntimeError: rank 0 failed to lower the plan: a bug in the lowering"
    assert [r["user"]["error"] for r in ranks] == [user] * 4
    assert [r["bug"]["error"] for r in ranks] == ["ValueError: a bug in the lowering", bug, bug, bug]
    assert [r["bug"]["made"] for r in ranks] == [[0], [], [], []]


def _ddp_grads(rank: int, world: int) -> dict:
    """One DDP step of the bf16 GPT-2 over ``world`` gloo ranks, with fp32 master weights and
    with bf16 ones: each parameter's gradient, gathered."""
    import shardwise.train as sw

    idx, tgt = gpt2.batch(0)
    out = {}
    for master in (torch.float32, None):
        torch.manual_seed(0)
        pm = sw.parallelize(gpt2.GPT2().to(torch.bfloat16), str(world), [idx, tgt], plan="ddp",
                            loss_fn=gpt2.loss_fn, time_limit_s=20, master_dtype=master)
        pm(*pm.shard_inputs(idx, tgt)).backward()
        # As lists (exact: each value is a float). Tensors would travel by file descriptor
        # (multiprocessing's resource sharer), which failed beside the rest of the suite.
        out[str(master)] = {k: (str(p.grad.dtype), p.grad.full_tensor().tolist())
                            for k, p in pm.named_parameters()}
    return out


@pytest.mark.slow
def test_fp32_master_weights_reduce_the_gradients_in_fp32():
    """With fp32 master weights the program all-reduces fp32 gradients, as torchtitan's
    ``reduce_dtype`` does and as ``estimate`` prices it: the two ranks' bf16 terms summed in fp32
    keep bits a bf16 sum rounds away, and rounded to bf16 they are that sum exactly (the same
    terms, one rounding)."""
    got = spawn(_ddp_grads, 2)
    assert got[0] == got[1]  # every rank holds the same gradients
    wide, narrow = got[0][str(torch.float32)], got[0][str(None)]
    assert {dtype for dtype, _ in wide.values()} == {"torch.float32"}
    assert {dtype for dtype, _ in narrow.values()} == {"torch.bfloat16"}
    rounded = []
    for k, (_, g) in wide.items():
        g = torch.tensor(g, dtype=torch.float32)
        assert torch.equal(g.to(torch.bfloat16), torch.tensor(narrow[k][1], dtype=torch.bfloat16)), k
        rounded.append(torch.equal(g, g.to(torch.bfloat16).float()))
    assert not all(rounded)
