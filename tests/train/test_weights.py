"""``train/weights.py`` and ``ParallelModule.load_weights``: training starts from safetensors
weights (a file, or a directory of one or of several with an index), each rank reading only
its pieces; weights of another model are refused in one sentence."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file, save_model

from shardwise.errors import UserError
from shardwise.mesh import destroy_world
from shardwise.train import params_on_meta
from shardwise.train.weights import Pretrained
from tests.train import gpt2


def _seeded_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(3)
    return {k: v.detach().clone() for k, v in gpt2.GPT2().named_parameters()}


def test_pieces_and_whole_tensors_from_a_file(tmp_path):
    full = torch.arange(24.0).reshape(4, 6)
    save_file({"w": full, "b": torch.ones(6)}, str(tmp_path / "w.safetensors"))
    piece, whole = torch.empty(2, 3, dtype=torch.float64), torch.empty(6)
    Pretrained(tmp_path / "w.safetensors").fill([("w", piece, (4, 6), (slice(2, 4), slice(3, 6))),
                                                 ("b", whole, (6,), None)])
    assert piece.dtype == torch.float64 and torch.equal(piece, full[2:4, 3:6].double())
    assert torch.equal(whole, torch.ones(6))
    # an hf: model's names carry its wrapper's prefix; the file holds the transformers names
    out = torch.empty(6)
    Pretrained(tmp_path / "w.safetensors", "model.").fill([("model.b", out, (6,), None)])
    assert torch.equal(out, torch.ones(6))


def test_other_weights_are_refused_in_one_sentence(tmp_path):
    save_file({"w": torch.zeros(4, 6)}, str(tmp_path / "w.safetensors"))
    src = Pretrained(tmp_path / "w.safetensors")
    with pytest.raises(UserError, match="hold no tensor 'v' for parameter v"):
        src.check([("w", (4, 6)), ("v", (2,))])
    with pytest.raises(UserError, match=r"hold 'w' in shape \[4, 6\], parameter w is \[4, 5\]"):
        src.check([("w", (4, 5))])
    with pytest.raises(UserError, match="holds no weights"):
        Pretrained(tmp_path)  # a directory without model.safetensors or an index
    (tmp_path / "bad.safetensors").write_bytes(b"not a header")
    with pytest.raises(UserError, match="is no safetensors file"):
        Pretrained(tmp_path / "bad.safetensors")
    index = {"weight_map": {"w": "gone.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(UserError, match="names gone.safetensors, which is not there"):
        Pretrained(tmp_path)


def test_a_meta_module_starts_from_the_weights_of_a_file_or_a_sharded_directory(one_process_group, tmp_path):
    import shardwise.train as sw

    want = _seeded_state()
    torch.manual_seed(3)
    save_model(gpt2.GPT2(), str(tmp_path / "model.safetensors"))  # the tied head stored once
    # the same weights split over two files with an index, as save_pretrained shards them
    shards = tmp_path / "sharded"
    shards.mkdir()
    names = sorted(want)
    parts = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
    for file, keys in parts.items():
        save_file({k: want[k].contiguous() for k in keys}, str(shards / file))
    index = {"weight_map": {k: f for f, keys in parts.items() for k in keys}}
    (shards / "model.safetensors.index.json").write_text(json.dumps(index))

    idx, tgt = gpt2.batch(0)
    for path in (tmp_path, shards):
        with params_on_meta():
            model = gpt2.GPT2()
        pm = sw.parallelize(model, "1", [idx, tgt], plan="ddp", loss_fn=gpt2.loss_fn, time_limit_s=20)
        pm.load_weights(path)
        for k, p in pm.named_parameters():
            assert torch.equal(p.full_tensor(), want[k]), (path, k)
        assert torch.isfinite(pm(*pm.shard_inputs(idx, tgt)))
        destroy_world()
