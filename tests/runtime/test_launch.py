"""Running lowered programs on real gloo groups: the distributed step equals the single-process
fp32 reference, what runs equals what the graph (and the plan) says, and faults end the run
quickly, naming the rank, with no process left behind."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import Shard

from shardwise.ir.trace import trace_model
from shardwise.lower import lower
from shardwise.mesh import Mesh
from shardwise.models import get_model
from shardwise.passes.pipeline import canonicalize
from shardwise.plan import make_plan
from shardwise.runtime import Fault, RunError, run, run_many
from shardwise.runtime.counter import as_json, count_graph
from tests.helpers import CLI_TIMEOUT_S, REPO, SLOW_MACHINE_TIMEOUT_S, hf_model_name
from tests.lower.hand_plans import S0, R, hand_plan, tiny_mlp_traced, transpose_plan

pytestmark = pytest.mark.slow

# The acceptance bound on the distributed step's error against the fp32 reference.
MAX_REL_ERR = 1e-4
# Tiny shapes: one layer, batch 4, sequence 8 (the batch splits over 4 ranks).
SHAPE = {"layers": 1, "batch": 4, "seq": 8}


def _children() -> list[int]:
    """Processes whose parent is this one."""
    me, kids = str(os.getpid()), []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == me:
            kids.append(int(stat.parent.name))
    return kids


def _program(model: str, train: bool, mesh: Mesh, baseline: str | None):
    traced = trace_model(model, train=train, **SHAPE)
    canonicalize(traced)
    plan = make_plan(traced, mesh, baseline=baseline)
    assert plan is not None, f"{baseline} does not apply to {mesh}"
    prog = lower(traced, plan)
    prog.model = get_model(model, **SHAPE)
    # Consistency: the lowered graph's collectives are exactly the plan's.
    assert as_json(prog.collectives()) == as_json(plan.collectives), (baseline, prog.node_collectives)
    return prog


def _check(results, programs) -> None:
    for res, prog in zip(results, programs, strict=True):
        name = f"{prog.plan.name} {prog.traced.model_name}"
        assert res.max_rel_err is not None and res.max_rel_err <= MAX_REL_ERR, (name, res.worst)
        assert as_json(res.measured) == as_json(count_graph(prog.gm)), name
        assert all(as_json(r) == as_json(res.measured) for r in res.rank_measured), name


def test_hand_plans_on_two_ranks_match_the_reference():
    """DDP- and FSDP-like placements, an S(1) -> S(0) all_to_all, on one launch of two ranks."""
    mlp = tiny_mlp_traced()
    llama = trace_model("llama-tiny", **SHAPE)
    transpose, tplan = transpose_plan(1024, 1024)  # large enough that the all_to_all pays
    programs = [
        lower(mlp, hand_plan(mlp, (2,), (R,), (S0,))),
        lower(llama, hand_plan(llama, (2,), (S0,), (S0,))),
        lower(transpose, tplan),
    ]
    programs[1].model = get_model("llama-tiny", **SHAPE)
    results = run_many(programs, check=True, timeout_s=SLOW_MACHINE_TIMEOUT_S)
    _check(results, programs)
    assert "all_to_all" in as_json(results[2].measured)


def test_hand_plan_on_a_2x2_mesh_matches_the_reference():
    """Parameters sharded over the second mesh dim, the batch over the first."""
    llama = trace_model("llama-tiny", **SHAPE)
    prog = lower(llama, hand_plan(llama, (2, 2), (R, Shard(0)), (S0, R)))
    prog.model = get_model("llama-tiny", **SHAPE)
    _check([run(prog, check=True, timeout_s=SLOW_MACHINE_TIMEOUT_S)], [prog])


def test_planned_steps_match_reference_and_prediction():
    """Planner plans (baselines and auto), training and inference: exact comm, fp32 numerics."""
    mesh = Mesh((2,))
    programs = [
        _program("llama-tiny", True, mesh, "ddp"),
        _program("llama-tiny", True, mesh, None),
        _program("llama-tiny", False, mesh, None),
        _program("llama-tiny", False, mesh, "fsdp"),
    ]
    results = run_many(programs, check=True, timeout_s=SLOW_MACHINE_TIMEOUT_S)
    _check(results, programs)
    for res, prog in zip(results, programs, strict=True):
        assert as_json(res.measured) == as_json(prog.plan.collectives)
    assert results[0].loss == pytest.approx(results[0].loss_ref, rel=MAX_REL_ERR)


def test_tensor_parallel_plan_on_a_2x2_mesh():
    """FSDP on dp with Megatron TP and sequence-parallel norms on tp."""
    prog = _program("llama-tiny", True, Mesh((2, 2), ("dp", "tp")), "fsdp_tp_sp")
    res = run(prog, check=True, timeout_s=SLOW_MACHINE_TIMEOUT_S)
    _check([res], [prog])
    assert as_json(res.measured) == as_json(prog.plan.collectives)
    assert {"all_gather", "reduce_scatter"} <= set(as_json(res.measured))


def test_hf_llama_steps_match_the_reference():
    """A transformers Llama (SDPA with an explicit mask), training and inference, data parallel."""
    name = hf_model_name("llama")
    programs = []
    for train in (True, False):
        traced = trace_model(name, train=train, **SHAPE)
        canonicalize(traced)
        prog = lower(traced, hand_plan(traced, (2,), (R,), (S0,)))
        prog.model = get_model(name, **SHAPE)
        programs.append(prog)
    results = run_many(programs, check=True, timeout_s=SLOW_MACHINE_TIMEOUT_S)
    _check(results, programs)
    assert results[0].loss == pytest.approx(results[0].loss_ref, rel=MAX_REL_ERR)
    assert results[1].outputs[0].shape == (4, 8, 256)


def test_a_rank_that_raises_ends_the_run_naming_it():
    prog = lower(tiny_mlp_traced(), hand_plan(tiny_mlp_traced(), (2,), (R,), (S0,)))
    before = set(_children())  # helpers other tests left (e.g. multiprocessing's resource tracker)
    t0 = time.monotonic()
    with pytest.raises(RunError, match="rank 1 failed: RuntimeError: planted fault") as err:
        run(prog, fault=Fault(1, "raise"))
    assert err.value.rank == 1
    assert time.monotonic() - t0 < 60
    assert set(_children()) - before == set()
    # The error is one sentence; the rank's traceback is in the file it names.
    traceback = Path(err.value.stacks)
    assert str(traceback) in str(err.value)
    assert "planted fault" in traceback.read_text() and "Traceback" in traceback.read_text()
    shutil.rmtree(traceback.parent)


def test_a_rank_that_hangs_ends_the_run_naming_it():
    prog = lower(tiny_mlp_traced(), hand_plan(tiny_mlp_traced(), (2,), (R,), (S0,)))
    before = set(_children())
    t0 = time.monotonic()
    with pytest.raises(RunError, match="rank 1 hung: no report within 8 s") as err:
        run(prog, fault=Fault(1, "hang"), timeout_s=8)
    assert err.value.rank == 1
    assert time.monotonic() - t0 < 60
    assert set(_children()) - before == set()
    # It says where the hung rank was: its threads' stacks, the planted sleep among them.
    stacks = Path(err.value.stacks)
    assert str(stacks) in str(err.value)
    assert "_run_rank" in stacks.read_text()
    shutil.rmtree(stacks.parent)


def test_two_runs_at_once_do_not_collide():
    traced = tiny_mlp_traced()
    prog = lower(traced, hand_plan(traced, (2,), (R,), (S0,)))
    results: list = [None, None]
    errors: list = [None, None]

    def go(i: int) -> None:
        try:  # generous timeout: four workers and two references share the machine's cores
            results[i] = run(prog, check=True, seed=i, timeout_s=150)
        except Exception as e:  # noqa: BLE001  (reported by the assertion below)
            errors[i] = e

    threads = [threading.Thread(target=go, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=200)
    assert errors == [None, None]
    assert all(r is not None and r.max_rel_err <= MAX_REL_ERR for r in results)
    assert results[0].loss != results[1].loss  # different seeds, different steps
    assert torch.isfinite(torch.tensor([r.loss for r in results])).all()


_HELD: list = []


def _holds_a_semaphore_and_exits_slowly(rank: int, backend: str, payload: bytes, send) -> int:
    """A rank whose libraries made a named semaphore (as tqdm does inside fx.Interpreter) and
    whose exit takes a moment before it releases it (exit handlers run by priority)."""
    import multiprocessing
    from multiprocessing import util

    lock = multiprocessing.Lock()  # registered with the resource tracker the parent shares
    util.Finalize(lock, time.sleep, args=(0.5,), exitpriority=10)
    _HELD.append(lock)
    return rank


def test_ranks_that_succeed_exit_on_their_own_and_leak_nothing():
    """The ranks of a run that succeeded are not killed in their exit: a rank killed there never
    releases its semaphores, which the resource tracker reports when the parent exits."""
    script = ("from shardwise.runtime.launch import spawn\n"
              "from tests.runtime.test_launch import _holds_a_semaphore_and_exits_slowly as fn\n"
              "print(spawn(fn, [b'', b''], 'gloo', 60.0))\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True,
                          timeout=CLI_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[0, 1]"
    assert "resource_tracker" not in proc.stderr, proc.stderr[-3000:]
