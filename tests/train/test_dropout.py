"""Dropout: a model that draws masks in its forward traces to a functional graph and trains on
gloo ranks with the masks one process draws from the same seed; what shardwise refuses (ranks
seeded apart, a forward that writes its buffers)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardwise.errors import UserError
from shardwise.ir.match import draws_random, writes_in_place
from shardwise.ir.trace import trace
from tests.helpers import spawn

aten = torch.ops.aten
VOCAB, BATCH, SEQ = 64, 8, 16
STEPS = 3


class DropoutMLP(nn.Module):
    """Dropout on the embedding and on the hidden activation of an MLP (its w1 column-parallel
    and w2 row-parallel under a tensor-parallel plan: the hidden activation sharded over tp),
    then a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 32)
        self.w1 = nn.Linear(32, 48, bias=False)
        self.w2 = nn.Linear(48, 32, bias=False)
        self.head = nn.Linear(32, VOCAB)
        self.drop = nn.Dropout(0.3)

    def forward(self, idx: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.emb(idx))
        h = h + self.w2(self.drop(F.gelu(self.w1(h))))
        return F.cross_entropy(self.head(h).flatten(0, 1), tgt.flatten())


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return tuple(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(2))


class AttentionDropout(nn.Module):
    """Attention with dropout on its probabilities (on the CPU, PyTorch's math attention: the
    mask has the attention's shape)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 32)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, idx, tgt):
        h = self.emb(idx).unflatten(-1, (4, 8)).transpose(1, 2)
        h = F.scaled_dot_product_attention(h, h, h, dropout_p=0.1, is_causal=True)
        return F.cross_entropy(self.head(h.transpose(1, 2).flatten(2)).flatten(0, 1), tgt.flatten())


class Noisy(nn.Module):
    """Noise added to the embedding: a draw that reads a value (for its shape)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 32)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, idx, tgt):
        h = self.emb(idx)
        return F.cross_entropy(self.head(h + 0.1 * torch.randn_like(h)).flatten(0, 1), tgt.flatten())


@pytest.mark.parametrize(("module", "n_draws"), [(DropoutMLP, 2), (AttentionDropout, 1), (Noisy, 1)])
def test_dropout_traces_to_a_functional_draw_that_reads_no_value_and_draws_what_eager_draws(module, n_draws):
    torch.manual_seed(0)
    model = module()
    idx, tgt = _batch()
    traced = trace(model, idx, tgt)
    nodes = list(traced.gm.graph.nodes)
    draws = [n for n in nodes if draws_random(n)]
    assert len(draws) == n_draws
    assert not any(writes_in_place(n) for n in nodes)
    # A mask's buffer is made from the shape alone: drawing it needs no activation.
    buffers = [d.args[0] for d in draws if d.target is aten.bernoulli.p]
    assert all(b.target is aten.empty_strided.default and not b.all_input_nodes for b in buffers)

    params = dict(model.named_parameters())
    torch.manual_seed(1)
    loss, *grads = traced.gm(*params.values(), idx, tgt)
    torch.manual_seed(1)
    want = model(idx, tgt)
    want.backward()
    assert torch.equal(loss, want)
    for (name, p), g in zip(params.items(), grads, strict=True):
        assert torch.allclose(g, p.grad, rtol=1e-6, atol=1e-7), name


class _BatchNormed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 32)
        self.norm = nn.BatchNorm1d(32)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, idx, tgt):
        return F.cross_entropy(self.head(self.norm(self.emb(idx).flatten(0, 1))), tgt.flatten())


def test_a_forward_that_writes_its_buffers_is_refused_in_one_sentence():
    with pytest.raises(UserError, match="BatchNorm's running statistics") as err:
        trace(_BatchNormed(), *_batch())
    assert str(err.value).count(". ") == 0 and str(err.value).endswith(".")


def _train(rank: int, world: int, plan: str, mesh: str, seed_by_rank: bool, model=None,
           compiled: bool = False) -> dict:
    from shardwise.train import parallelize

    model = model or DropoutMLP
    torch.manual_seed(0)
    module = model()
    reference = model()
    reference.load_state_dict(module.state_dict())
    idx, tgt = _batch()
    pm = parallelize(module, mesh, [idx, tgt], plan=plan, mesh_names=("dp", "tp") if "x" in mesh else None,
                     compile=compiled)
    torch.manual_seed(1 + (rank if seed_by_rank else 0))
    try:
        losses = []
        for _ in range(STEPS):
            loss = pm(*pm.shard_inputs(idx, tgt))
            loss.backward()
            losses.append(loss.item())
    except UserError as e:
        return {"error": str(e)}
    torch.manual_seed(1)
    want = []
    for _ in range(STEPS):
        loss = reference(idx, tgt)
        loss.backward()
        want.append(loss.item())
    grads = dict(reference.named_parameters())
    grad_err = max(((p.grad.full_tensor() - grads[n].grad).abs().max() / grads[n].grad.abs().max()).item()
                   for n, p in pm.named_parameters())
    placements = {n: str(p.placements) for n, p in pm.named_parameters()}
    return {"losses": losses, "want": want, "grad_err": grad_err, "placements": placements}


@pytest.mark.slow
@pytest.mark.parametrize(("plan", "mesh", "world", "model", "compiled"), [
    ("fsdp", "2", 2, DropoutMLP, False),
    ("fsdp_tp", "2x2", 4, DropoutMLP, False),  # the hidden activation and its mask's slice split over tp
    ("auto", "2", 2, DropoutMLP, False),  # no decoder layers: none for the planner to checkpoint
    ("fsdp", "2", 2, Noisy, False),  # noise the size of a batch-split activation
    ("fsdp", "2", 2, Noisy, True),  # Inductor, drawing with PyTorch's kernels
])
def test_dropout_trains_on_gloo_ranks_with_the_masks_of_one_process(plan, mesh, world, model, compiled):
    for got in spawn(_train, world, plan, mesh, False, model, compiled):
        assert got["losses"][0] != got["losses"][1]  # every step draws new masks
        for a, b in zip(got["losses"], got["want"], strict=True):
            assert abs(a - b) <= 1e-6 * abs(b)
        assert got["grad_err"] <= 1e-5
    if plan == "fsdp_tp":
        # Column-parallel on tp; FSDP over dp splits its other dim (FSDP2's strided shard's bytes).
        assert got["placements"]["w1.weight"] == "(Shard(dim=1), Shard(dim=0))"


@pytest.mark.slow
def test_ranks_whose_generators_differ_are_refused():
    for got in spawn(_train, 2, "fsdp", "2", True):
        assert "seed every rank alike" in got["error"]
