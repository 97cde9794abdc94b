"""``shardwise train`` and ``shardwise export`` as users call them: subprocesses, one JSON object on
stdout, one sentence and exit 2 on bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from tests.helpers import HF_TINY, REPO, cli, cli_all, failed_check, json_object

MESH_2X2 = ["--mesh", "2x2", "--mesh-names", "dp,tp"]


def shardwise(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = cli(*args)
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def train(*args: str) -> dict:
    return json.loads(shardwise("train", "--json", *args).stdout)


def max_rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


@pytest.mark.slow
def test_train_fsdp_tp_sp_with_passes_matches_one_process_and_resumes_anywhere(tmp_path):
    """The headline run, then the same curve cut in two: resumed on the same plan, and on another
    plan and mesh (DCP reshards the checkpoint). Independent runs go side by side."""
    common = ["train", "--json", "--model", "llama-tiny", "--steps", "20"]
    sp = [*MESH_2X2, "--plan", "fsdp_tp_sp", "--passes", "sequence_parallel,collective_matmul"]
    ck = tmp_path / "ck"
    straight, first = map(json_object, cli_all([
        [*common, *sp, "--check"],
        [*common, *sp, "--stop-at", "10", "--save-dir", str(ck), "--save-every", "5"],
    ]))
    assert straight["world_size"] == 4 and straight["plan"] == "fsdp_tp_sp"
    assert len(straight["losses"]) == 20 and straight["max_rel_diff"] <= 1e-4
    assert straight["losses"][-1] < straight["losses"][0] - 1.0
    assert straight["tokens_per_s"] > 0 and straight["step_s"] > 0

    assert first["checkpoints"] == [str(ck / "step-000005"), str(ck / "step-000010")]
    assert (ck / "latest").read_text() == "step-000010"
    assert len((ck / "metrics.jsonl").read_text().splitlines()) == 10 and (ck / "loss.png").stat().st_size
    assert max_rel(first["losses"], straight["losses"][:10]) <= 1e-6

    # A save that died half-way (a step-15 dir never completed) leaves step 10 in charge.
    (ck / "step-000015.tmp").mkdir()
    (ck / "step-000015.tmp" / "__0_0.distcp").write_bytes(b"partial")
    same, other = map(json_object, cli_all([
        [*common, *sp, "--resume", str(ck)],
        [*common, "--mesh", "4", "--plan", "ddp", "--resume", str(ck), "--check"],
    ]))
    assert same["first_step"] == 10 and max_rel(same["losses"], straight["losses"][10:]) <= 1e-6
    assert max_rel(other["losses"], straight["losses"][10:]) <= 1e-5
    assert other["max_rel_diff"] <= 1e-4  # its reference resumed from the same checkpoint


@pytest.mark.slow
def test_train_hf_model_on_text_with_a_tokenizer_then_export_for_transformers(tmp_path):
    """An HF config with attention dropout trains on a local text file through a local
    tokenizer.json, its curve the one-process reference's (every rank and the reference seeded
    alike, each rank drawing a mask whole and keeping its slice); the checkpoint exports to a
    directory transformers loads, with the trained weights; training starts again from that
    directory (--init-from), each rank reading its shards of the weights."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    text = tmp_path / "corpus.txt"
    text.write_text(" ".join(["the quick brown fox jumps over the lazy dog"] * 200))
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train([str(text)], trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    config = json.loads(HF_TINY["llama"].read_text())
    config["attention_dropout"] = 0.1
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = f"hf:{tmp_path / 'config.json'}"
    ck = tmp_path / "ck"
    res = train("--model", model, *MESH_2X2, "--plan", "fsdp_tp", "--steps", "8", "--data", str(text),
                "--tokenizer", str(tmp_path / "tokenizer.json"), "--save-dir", str(ck), "--save-every", "8",
                "--check")
    assert res["max_rel_diff"] <= 1e-4 and res["losses"][-1] < res["losses"][0]

    out = json.loads(shardwise("export", "--resume", str(ck), "--out", str(tmp_path / "hf"), "--json").stdout)
    assert out["step"] == 8 and "model.safetensors" in out["files"] and "config.json" in out["files"]
    import transformers

    from shardwise.train import checkpoint
    from shardwise.train.models import build_model

    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    ours, _ = build_model(model, meta=False)
    checkpoint.load_plain(ck, ours)
    ours.eval()  # no dropout, as transformers loads it
    ids = torch.randint(0, 10, (1, 8))
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=ids).logits, ours(ids), atol=1e-5)

    again = train("--model", model, *MESH_2X2, "--plan", "fsdp_tp", "--steps", "2", "--data", str(text),
                  "--tokenizer", str(tmp_path / "tokenizer.json"), "--init-from", str(tmp_path / "hf"),
                  "--check")
    assert again["init_from"] == str(tmp_path / "hf") and again["max_rel_diff"] <= 1e-4
    # the trained weights, not a fresh draw: the first batch's loss is the trained model's
    assert again["losses"][0] < res["losses"][0] - 0.5


@pytest.mark.slow
def test_gradient_accumulation_equals_the_batch_whole():
    """--grad-accum 2: each step two micro-batches of 4 through a program planned for 4, their
    gradients summed. The curve and the gradient norms are those of the same 8 samples in one
    program (a 1/2 share missed would double the norms; one micro-batch read twice, or one
    gradient lost, would move the curve), and the one-process reference's."""
    base = ["train", "--json", "--model", "llama-tiny", "--mesh", "2", "--plan", "fsdp", "--batch", "8",
            "--steps", "4"]
    accum, whole = map(json_object, cli_all([[*base, "--grad-accum", "2", "--check"], base]))
    assert accum["grad_accum"] == 2 and whole["grad_accum"] == 1 and accum["batch"] == whole["batch"] == 8
    assert max_rel(accum["losses"], whole["losses"]) <= 1e-5
    assert max_rel(accum["grad_norms"], whole["grad_norms"]) <= 1e-5
    assert accum["max_rel_diff"] <= 1e-4 and accum["losses"][-1] < accum["losses"][0]


@pytest.mark.slow
def test_train_byte_level_text_on_the_auto_plan_with_full_activation_checkpointing(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("shardwise trains on the bytes of this sentence. " * 50)
    res = train("--model", "llama-tiny", "--mesh", "2", "--steps", "6", "--data", str(text), "--check",
                "--ac", "full")
    assert res["plan"] == "auto" and res["data"] == str(text) and res["ac"] == "full"
    assert res["max_rel_diff"] <= 1e-4 and res["losses"][-1] < res["losses"][0]


@pytest.mark.slow
def test_train_compiled_matches_one_process():
    """Each rank's step through torch.compile (Inductor's fused kernels, its own wait placement)
    trains the same curve as the reference, on the fsdp plan with its gathers and reductions
    bucketed."""
    res = train("--model", "llama-tiny", "--layers", "1", "--mesh", "2", "--plan", "fsdp",
                "--passes", "bucket", "--steps", "4", "--check", "--compile")
    assert res["compile"] is True and res["plan"] == "fsdp"
    assert res["max_rel_diff"] <= 1e-4 and res["losses"][-1] < res["losses"][0]


@pytest.mark.slow
def test_a_curve_off_the_reference_by_more_than_the_tolerance_fails_the_command():
    """bf16 training in bf16 weights asked for fp32's tolerance fails the check (bf16's own
    default is run's test): exit 1, one sentence, the result still printed. The same steps with
    fp32 master weights (the default: mixed precision) keep within it."""
    bf16 = ("--model", "llama-tiny", "--layers", "1", "--dtype", "bf16", "--mesh", "2", "--plan", "ddp",
            "--steps", "3", "--check", "--tolerance", "1e-4")
    proc = cli("train", "--json", *bf16, "--master-dtype", "bf16")
    out = failed_check(proc, "max_rel_diff", "shardwise train: check failed: the loss curve is")
    assert len(out["losses"]) == len(out["reference_losses"]) == 3
    mixed = train(*bf16)
    assert mixed["master_dtype"] == "fp32" and mixed["max_rel_diff"] <= 1e-4 < out["max_rel_diff"]


@pytest.mark.slow
def test_the_default_learning_rate_falls_with_the_models_width(tmp_path):
    """Without --lr the peak learning rate is torchtitan's rule for Llama 3, 3e-4 x 4096 / width
    (3e-3 diverged at width 4096): 2.4e-3 at width 512; 3e-3 for llama-tiny (width 64), at most."""
    config = json.loads(HF_TINY["llama"].read_text())
    wide = tmp_path / "config.json"
    wide.write_text(json.dumps({**config, "hidden_size": 512, "num_hidden_layers": 1}))
    base = ["train", "--json", "--mesh", "1", "--steps", "3", "--batch", "2", "--seq", "8"]
    wider, tiny = map(json_object, cli_all([[*base, "--model", f"hf:{wide}"],
                                            [*base, "--model", "llama-tiny", "--layers", "1"]]))
    assert max(wider["lrs"]) == pytest.approx(2.4e-3, rel=1e-12)
    assert max(tiny["lrs"]) == pytest.approx(3e-3, rel=1e-12)
    given = train(*base[2:], "--model", "llama-tiny", "--layers", "1", "--lr", "1e-3")
    assert max(given["lrs"]) == pytest.approx(1e-3, rel=1e-12)


def test_master_weights_narrower_than_the_model_are_refused():
    proc = cli("train", "--json", "--model", "llama-tiny", "--mesh", "2", "--master-dtype", "bf16")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == ("shardwise train: error: --master-dtype bf16 is narrower than the model's fp32; "
                           "keep the weights in fp32 or wider.\n")


def test_options_alone_are_refused_before_torch_is_imported(tmp_path):
    """What the options alone show wrong is refused at once: the process never imports torch
    (seconds), for a typo as for a missing file."""
    script = ("import sys; from shardwise.cli import main; rc = main(sys.argv[1:]); "
              "print(rc, 'torch' in sys.modules)")
    base = ["train", "--model", "llama-tiny", "--mesh", "2"]
    for argv in ([*base, "--steps", "0"], [*base, "--data", str(tmp_path / "missing.txt")],
                 [*base, "--ac", "most"], [*base, "--save-every", "2"], [*base, "--tokenizer", "t.json"],
                 [*base, "--grad-accum", "0"], [*base, "--init-from", str(tmp_path / "none")]):
        proc = subprocess.run([sys.executable, "-c", script, *argv], cwd=REPO, capture_output=True, text=True,
                              check=False)
        assert proc.stdout.split() == ["2", "False"], (argv, proc.stdout, proc.stderr)
        assert proc.stderr.startswith("shardwise train: error: ") and proc.stderr.count("\n") == 1


def test_bad_input_is_one_sentence_and_exit_2(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (tmp_path / "ck").mkdir()
    other, shaped = tmp_path / "other", tmp_path / "shaped"
    for root, model, params in ((other, "llama3-8b", {}), (shaped, "llama-tiny", {"norm.weight": [3]})):
        meta = {"version": 1, "step": 4, "model": model, "params": params, "scheduler": {}, "extra": {}}
        (root / "step-000004").mkdir(parents=True)
        (root / "step-000004" / "shardwise.json").write_text(json.dumps(meta))
        (root / "latest").write_text("step-000004")
    weights = tmp_path / "other.safetensors"  # another model's
    save_file({"wte.weight": torch.zeros(4, 2)}, str(weights))
    base = ["train", "--model", "llama-tiny", "--mesh", "2", "--steps", "2"]
    cases = {
        "holds no checkpoint": [*base, "--resume", str(empty)],
        "is of model 'llama3-8b', not 'llama-tiny'": [*base, "--resume", str(other)],
        "is of another shape of 'llama-tiny' (--layers, sizes): parameter layers.0.attention.wk.weight "
        "is not in it, [32, 64] here": [*base, "--resume", str(shaped)],
        "does not exist": [*base, "--data", str(tmp_path / "missing.txt")],
        "cannot be split": ["train", "--model", "llama-tiny", "--mesh", "8", "--batch", "4"],
        "unknown pass": [*base, "--passes", "fuse_everything"],
        "needs --save-dir": [*base, "--save-every", "2"],
        "--tokenizer needs --data": [*base, "--tokenizer", "tok.json"],
        "positive integer": [*base[:-2], "--steps", "0"],
        "unknown activation checkpointing policy": [*base, "--ac", "most"],
        "is a file, not a directory": [*base, "--save-dir", str(other / "latest"), "--save-every", "1"],
        "is not a file": [*base, "--data", str(tmp_path)],
        "argument --tolerance: must be positive": [*base, "--check", "--tolerance", "0"],
        "cannot be split into 3 micro-batches": [*base, "--grad-accum", "3"],
        "--init-from 'nowhere' does not exist": [*base, "--init-from", "nowhere"],
        "give one": [*base, "--init-from", str(other), "--resume", str(other)],
        "holds no weights": [*base, "--init-from", str(empty)],
        "hold no tensor 'tok_embeddings.weight'": [*base, "--init-from", str(weights)],
    }
    for needle, proc in zip(cases, cli_all([[*argv, "--json"] for argv in cases.values()]), strict=True):
        assert proc.returncode == 2, (needle, proc.stderr)
        assert needle in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
        assert proc.stdout == "" and proc.stderr.count("\n") == 1, proc.stderr
    assert not any((tmp_path / "ck").iterdir())  # nothing half-written
    proc = shardwise("export", "--resume", str(empty), "--out", str(tmp_path / "x"), check=False)
    assert proc.returncode == 2 and "holds no checkpoint" in proc.stderr
    proc = shardwise("export", "--resume", str(other), "--out", str(other / "latest"), check=False)
    assert proc.returncode == 2 and "is a file; give a directory" in proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr  # refused before the checkpoint is read
