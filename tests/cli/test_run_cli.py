"""``shardwise run``: the JSON report of a real two-rank step, and one-sentence refusals of bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from torch.distributed.tensor import Replicate

from shardwise.cli import main
from shardwise.ir.trace import trace_model
from shardwise.passes.pipeline import canonicalize
from shardwise.plan.plan import NodeSpec, Plan, graph_fingerprint
from tests.helpers import BLOOM_TINY, DATA, HF_TINY, cli, cli_all, failed_check, json_object

JSON_KEYS = {"world_size", "plan", "loss", "loss_ref", "max_rel_err", "tolerance", "collectives", "rewrites",
             "wall_s"}
TINY = ["--model", "llama-tiny", "--layers", "1", "--batch", "4", "--seq", "8"]


@pytest.mark.slow
def test_json_report_of_a_checked_ddp_step(capsys):
    assert main(["run", *TINY, "--mesh", "2", "--plan", "ddp", "--check", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == JSON_KEYS
    assert out["world_size"] == 2 and out["plan"] == "ddp"
    assert out["max_rel_err"] <= out["tolerance"] == 1e-4  # fp32's
    assert out["loss"] == pytest.approx(out["loss_ref"], rel=1e-5)
    assert out["collectives"]["measured"] == out["collectives"]["predicted"] == out["collectives"]["program"]
    assert out["rewrites"] == {} and out["wall_s"] > 0


@pytest.mark.slow
def test_a_step_with_dropout_draws_the_references_masks(capsys, tmp_path):
    """Every rank and the reference seed the generator alike; each rank draws the attention's
    dropout mask whole and keeps its slice: the step is the reference's."""
    config = json.loads(HF_TINY["llama"].read_text())
    config["attention_dropout"] = 0.1
    (tmp_path / "config.json").write_text(json.dumps(config))
    argv = ["run", "--model", f"hf:{tmp_path / 'config.json'}", "--layers", "1", "--batch", "4", "--seq", "8",
            "--mesh", "2", "--plan", "fsdp", "--check", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["max_rel_err"] <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("family, fused", [("gemma2", 8), ("bloom", 10)])
def test_eager_attention_families_run_fused_and_match_the_reference(family, fused, tmp_path):
    """Gemma-2 (its attention soft-capped and, every other layer, windowed: transformers' eager
    attention, as matmuls and a softmax) and Bloom (above) over FSDP x sequence-parallel TP,
    their projections fused with their collectives (Bloom's: every column-parallel one reads its
    LayerNorm's output sequence-sharded): the step is the one-process step's. (Bloom's count was
    11 while its lowering ran an all_gather the plan had not priced, ``cluster._unline_other_producers``.)"""
    config = HF_TINY["gemma2"] if family == "gemma2" else tmp_path / "config.json"
    if family == "bloom":
        config.write_text(json.dumps(BLOOM_TINY))
    argv = ["run", "--model", f"hf:{config}", "--batch", "4", "--seq", "8", "--mesh", "2x2",
            "--mesh-names", "dp,tp", "--plan", "fsdp_tp_sp",
            "--passes", "sequence_parallel,collective_matmul", "--check", "--json"]
    out = json_object(cli(*argv))
    assert out["world_size"] == 4 and out["rewrites"]["collective_matmul"] >= fused
    assert out["max_rel_err"] <= 1e-4


@pytest.mark.slow
def test_passes_from_the_command_line_fuse_and_keep_the_numbers(capsys):
    """The training step with sequence parallelism and collective-matmul fusion: the rewritten
    program runs exactly its own collectives (the fused ones move theirs as ring transfers) and
    matches the reference."""
    argv = ["run", *TINY, "--layers", "2", "--mesh", "2", "--mesh-names", "tp", "--plan", "fsdp_tp_sp",
            "--passes", "sequence_parallel,collective_matmul", "--check", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["rewrites"]["collective_matmul"] >= 9  # every forward projection of 2 layers, the head
    assert out["collectives"]["measured"] == out["collectives"]["program"]
    assert out["collectives"]["program"] != out["collectives"]["predicted"]
    assert out["max_rel_err"] <= 1e-4


@pytest.mark.slow
def test_a_step_off_the_reference_by_more_than_the_tolerance_fails_the_command():
    """A bf16 step is checked within bf16's rounding (the default tolerance); asked for fp32's,
    the same step fails the check: exit 1, one sentence naming the worst tensor, the result
    still printed as one JSON object."""
    argv = ["run", *TINY, "--dtype", "bf16", "--mesh", "2", "--plan", "fsdp", "--check", "--json"]
    ok, tight = cli_all([argv, [*argv, "--tolerance", "1e-4"]])
    out = json_object(ok)
    assert out["tolerance"] == 5e-2 and out["max_rel_err"] <= 5e-2  # bf16's default
    failed = failed_check(tight, "max_rel_err", "shardwise run: check failed: the step's grad ")
    assert failed["max_rel_err"] == out["max_rel_err"]


def _error(capsys, *argv: str) -> str:
    assert main(["run", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err
    return err


def test_nccl_without_gpus_is_refused(capsys):
    assert "--backend nccl needs 2 GPU(s)" in _error(capsys, *TINY, "--mesh", "2", "--backend", "nccl")


def test_mesh_larger_than_the_batch_is_refused(capsys):
    err = _error(capsys, *TINY, "--mesh", "8")
    assert "batch 4 cannot be split over the 8 data-parallel ranks" in err


def test_a_hand_plan_that_does_not_apply_says_why():
    """Run as a user runs it: the sentence names what the plan needs or the weight it cannot split
    (GPT-2's vocabulary, 50257 rows, over 4 ranks), on one line of stderr."""
    gpt2 = ["run", "--model", f"hf:{DATA / 'gpt2.json'}", "--layers", "1", "--batch", "4", "--seq", "8"]
    cases = {
        "the fsdp_tp plan does not apply to mesh 2 (dp): it needs a mesh dim named tp.":
            ["run", *TINY, "--mesh", "2", "--plan", "fsdp_tp"],
        "the fsdp_tp plan does not apply to mesh 2x2 (dp,tp): it splits model.transformer.wte.weight "
        "[50257, 768] as S(0),S(0), which the mesh does not divide.":
            [*gpt2, "--mesh", "2x2", "--mesh-names", "dp,tp", "--plan", "fsdp_tp"],
    }
    for sentence, proc in zip(cases, cli_all([[*argv, "--json"] for argv in cases.values()]), strict=True):
        assert proc.returncode == 2 and proc.stdout == ""
        assert proc.stderr == f"shardwise run: error: {sentence}\n"


def test_batch_is_only_split_over_data_parallel_dims(capsys):
    """A 2x4 (dp, tp) mesh splits batch 4 two ways only; 4x2 would need four."""
    assert "over the 4 data-parallel ranks" in _error(capsys, *TINY, "--mesh", "4x2", "--batch", "2")


def _plan_file(tmp_path, model: str, mesh_shape: tuple[int, ...]) -> str:
    traced = trace_model("llama-tiny", layers=1, batch=4, seq=8)
    canonicalize(traced)
    rep = (Replicate(),) * len(mesh_shape)
    plan = Plan(name="hand", model=model, mesh_shape=mesh_shape, mesh_names=("dp",)[: len(mesh_shape)],
                hardware="h100", train=True, fingerprint=graph_fingerprint(traced.gm),
                nodes={n: NodeSpec((rep,)) for n in traced.inputs})
    path = tmp_path / "plan.json"
    plan.save(path)
    return str(path)


def test_plan_file_for_another_mesh_is_refused(capsys, tmp_path):
    path = _plan_file(tmp_path, "llama-tiny", (2,))
    assert "the plan was made for mesh 2, not 4." in _error(capsys, *TINY, "--mesh", "4", "--plan", path)


def test_plan_file_for_another_model_is_refused(capsys, tmp_path):
    path = _plan_file(tmp_path, "llama3-8b", (2,))
    err = _error(capsys, *TINY, "--mesh", "2", "--plan", path)
    assert "made for model 'llama3-8b', not 'llama-tiny'" in err


def test_a_plan_that_does_not_fit_is_refused_before_running(capsys):
    """DDP keeps all of llama3-8b with its Adam state on every rank: it cannot fit an H100."""
    err = _error(capsys, "--model", "llama3-8b", "--batch", "4", "--seq", "128", "--mesh", "2x2",
                 "--plan", "ddp")
    assert "plan ddp: no plan fits" in err and "the ddp plan needs at least" in err


def test_unknown_plan_and_pass_are_refused(capsys):
    assert "neither one of auto" in _error(capsys, *TINY, "--plan", "zero3")
    assert "unknown pass 'fuse_all'" in _error(capsys, *TINY, "--passes", "fuse_all")
    with pytest.raises(SystemExit) as refused:  # argparse's own refusal: one line, exit 2
        main(["run", *TINY, "--check", "--tolerance", "-1"])
    assert refused.value.code == 2
    assert capsys.readouterr().err == "shardwise: error: argument --tolerance: must be positive, not -1\n"


@pytest.mark.slow
def test_a_failed_rank_exits_nonzero_naming_it(capsys, monkeypatch):
    """A planted fault on rank 1 (the API's test-only option, reached through the CLI's runner)."""
    from shardwise.runtime import Fault, launch

    real_run = launch.run
    monkeypatch.setattr(launch, "run", lambda program, backend, **kw: real_run(
        program, backend, fault=Fault(1, "raise"), **kw))
    with pytest.raises(SystemExit) as exit_info:
        main(["run", *TINY, "--mesh", "2", "--plan", "ddp", "--json"])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    said, where = err.split("; its traceback is in ")
    assert said == "shardwise run: error: rank 1 failed: RuntimeError: planted fault on rank 1"
    assert "planted fault" in Path(where.removesuffix(".")).read_text()
