"""A GPT-2 style model that shardwise does not ship (LayerNorm with bias, GELU, learned positions,
an embedding tied to the head), and the script that trains it under torchrun with
``shardwise.train.parallelize`` + ``torch.optim.AdamW`` + ``clip_grad_norm_``.

Run as a script (``torchrun --nproc-per-node 4 tests/train/gpt2.py OUT_DIR STEPS``), rank 0 writes
``OUT_DIR/result.json`` (losses, the eval logits) and ``params.pt`` (the trained parameters,
gathered), and every rank saves a DCP checkpoint of the
model in ``OUT_DIR/dcp``.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HEADS, LAYERS, CTX = 96, 32, 4, 2, 16
BATCH, SEQ = 8, 16
LR, CLIP, WEIGHT_DECAY = 3e-3, 1.0, 0.1


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(DIM)
        self.attn = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.ln_2 = nn.LayerNorm(DIM)
        self.fc = nn.Linear(DIM, 4 * DIM)
        self.fc_proj = nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.attn(self.ln_1(x)).split(DIM, dim=-1)
        q, k, v = (t.view(b, s, HEADS, DIM // HEADS).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, DIM))
        return x + self.fc_proj(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))


class GPT2(nn.Module):
    """``forward(idx) -> logits``; the loss comes from ``loss_fn``."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, DIM)
        self.wpe = nn.Embedding(CTX, DIM)
        self.h = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight  # tied

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def loss_fn(logits: torch.Tensor, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global batch of ``step``: shifted windows of a fixed learnable token chain."""
    g = torch.Generator().manual_seed(1000 + step)
    starts = torch.randint(0, VOCAB, (BATCH, 1), generator=g)
    seq = (starts + 3 * torch.arange(SEQ + 1)) % VOCAB
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def main(out_dir: str, steps: int) -> None:
    from pathlib import Path

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    import shardwise.train as sw

    with sw.params_on_meta():
        model = GPT2()
    idx, tgt = batch(0)
    pm = sw.parallelize(model, "2x2", [idx, tgt], plan="fsdp_tp", mesh_names=("dp", "tp"), loss_fn=loss_fn,
                        time_limit_s=30)
    pm.init_weights(seed=7)
    opt = torch.optim.AdamW(pm.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    losses = []
    for step in range(steps):
        loss = pm(*pm.shard_inputs(*batch(step)))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(pm.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    pm.eval()
    with torch.no_grad():
        logits = pm(*pm.shard_inputs(batch(steps)[0])).full_tensor()
    dcp.save({"model": get_model_state_dict(pm)}, checkpoint_id=str(Path(out_dir) / "dcp"))
    full = {k: p.full_tensor() for k, p in pm.named_parameters()}  # collective: every rank
    if dist.get_rank() == 0:
        torch.save(full, Path(out_dir) / "params.pt")
        placements = {k: str(tuple(p.placements)) for k, p in pm.named_parameters()}
        (Path(out_dir) / "result.json").write_text(json.dumps(
            {"losses": losses, "logits": logits.tolist(), "placements": placements}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
