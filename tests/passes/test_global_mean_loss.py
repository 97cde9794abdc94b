"""global_mean_loss: a mean cross entropy over tokens split between ranks is reported as the
mean over all of them, what one process computes, where the ranks count different numbers of
tokens (labels ignored unevenly); what the pass must leave alone."""

from __future__ import annotations

import copy

import pytest
import torch

from shardwise.ir.match import Reduction, all_collectives
from shardwise.mesh import Mesh
from shardwise.passes import global_mean_loss, simplify
from tests.helpers import spawn
from tests.passes.test_bucket import _programs

aten = torch.ops.aten
IGNORE = -100
BATCH, SEQ = 8, 32


def _batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and labels whose first half of the batch is mostly padding: a data-parallel rank
    holding those rows counts 8 tokens a row, the others 32."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
    labels[: BATCH // 2, : SEQ - 8] = IGNORE
    return tokens, labels


def _one_step(rank: int, world: int, plan: str, mesh: str, passes: tuple[str, ...]) -> dict:
    from shardwise.train import parallelize
    from shardwise.train.models import build_model, meta_inputs

    torch.manual_seed(0)
    module, spec = build_model("llama-tiny", layers=2, batch=BATCH, seq=SEQ, meta=False)
    reference = copy.deepcopy(module)
    tokens, labels = _batch(spec.vocab_size)
    pm = parallelize(module, mesh, meta_inputs(spec), plan=plan, passes=passes)
    loss = pm(*pm.shard_inputs(tokens, labels))
    loss.backward()
    want = reference(tokens, labels)
    want.backward()
    grads = dict(reference.named_parameters())
    grad_err = max(((p.grad.full_tensor() - grads[n].grad).abs().max() / grads[n].grad.abs().max()).item()
                   for n, p in pm.named_parameters())
    return {"loss": loss.item(), "want": want.item(), "grad_err": grad_err}


@pytest.mark.slow
@pytest.mark.parametrize(("plan", "mesh", "world", "passes"), [
    ("fsdp", "2", 2, ()),  # the loss reduced on its own: this pass
    ("ddp", "2", 2, ("bucket",)),  # the loss in the gradient bucket: loss_in_bucket
])
def test_the_loss_of_unevenly_padded_batches_is_the_one_process_loss_on_gloo(plan, mesh, world, passes):
    for got in spawn(_one_step, world, plan, mesh, passes):
        # The ranks' means average to 5.62314 here; all the tokens' mean is 5.62559.
        assert abs(got["loss"] - got["want"]) <= 1e-6 * abs(got["want"])
        assert got["grad_err"] <= 1e-5


def _loss_reduction(gm):
    """The collective whose result the graph's first output, the loss, is made of."""
    loss = gm.graph.output_node().args[0][0]
    return next(c for c in all_collectives(gm.graph) if c.wait in (loss, *loss.all_input_nodes)
                or any(c.wait in a.all_input_nodes for a in loss.all_input_nodes))


def test_the_average_of_the_ranks_means_becomes_a_sum_with_the_count():
    _, fsdp = _programs("fsdp", Mesh((2,), ("dp",)))
    gm = fsdp.gm
    simplify.apply(gm)  # moves the backward's seed off the reduced loss, as parallelize runs it
    before = _loss_reduction(gm)
    assert before.reduce_op == "avg" and before.input.meta["val"].dim() == 0
    assert global_mean_loss.apply(gm) == 1
    after = _loss_reduction(gm)
    # One collective still, of the count-weighted loss and the count, summed; the loss is their
    # quotient.
    assert after.op is before.op and after.reduce_op == "sum" and after.input.target is aten.cat.default
    assert after.input.meta["val"].shape == (2,)
    assert gm.graph.output_node().args[0][0].target is aten.div.Tensor
    assert global_mean_loss.apply(gm) == 0  # nothing left to match


def test_a_summed_or_class_weighted_loss_stays():
    summed = lambda fwd: fwd.update_arg(3, int(Reduction.SUM))  # noqa: E731
    class_weighted = lambda fwd: fwd.update_arg(2, fwd.args[0])  # noqa: E731  (any node stands for weights)
    for change in (summed, class_weighted):
        _, fsdp = _programs("fsdp", Mesh((2,), ("dp",)))
        gm = fsdp.gm
        simplify.apply(gm)
        assert len(global_mean_loss.find(gm)) == 1
        change(next(n for n in gm.graph.nodes if n.target is aten.nll_loss_forward.default))
        assert global_mean_loss.find(gm) == []
