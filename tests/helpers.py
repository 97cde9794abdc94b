"""Shared test helpers: real inputs for traced graphs, tiny HF configs, multi-process gloo runs."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.multiprocessing as mp
from torch import fx

DATA = Path(__file__).parent / "data"
REPO = DATA.parents[1]
HF_TINY = {name: DATA / f"hf_tiny_{name}" / "config.json" for name in ("llama", "mistral", "qwen2", "gemma2")}
# A tiny Bloom (write it to a config.json): LayerNorms, ALiBi, transformers' eager attention, a
# fused query_key_value projection and its own module names (dense, dense_h_to_4h, dense_4h_to_h,
# word_embeddings).
BLOOM_TINY = {"model_type": "bloom", "hidden_size": 64, "n_head": 4, "n_layer": 2, "vocab_size": 256}
# llama-tiny shaped so that its activations are worth checkpointing (tests/plan/conftest.py).
AC_LAYERS, AC_BATCH, AC_SEQ = 4, 8, 256


def ddp_plan(traced, mesh, budget: float, ac=None):
    """The ddp hand plan of ``traced`` within ``budget`` bytes, priced by the step schedule with
    activation checkpointing ``ac`` (None: the planner chooses)."""
    from shardwise.plan import make_plan

    return make_plan(traced, mesh, baseline="ddp", memory_budget=budget, step_options={"ac": ac})
# Real parameters are drawn at this scale so a few layers of a tiny model stay well conditioned.
PARAM_SCALE = 0.1


def hf_model_name(arch: str = "llama") -> str:
    """The ``hf:`` model name of a tiny test config (``llama``, ``mistral``, ``qwen2`` or ``gemma2``)."""
    return f"hf:{HF_TINY[arch]}"


def free_port() -> int:
    """A TCP port on localhost that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, results) -> None:
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        results[rank] = fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def spawn(fn: Callable, world_size: int, *args) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; returns each rank's
    result (``fn`` must be a module-level function and its result picklable)."""
    from shardwise.runtime.launch import WORKER_IMPORTS

    # From the forkserver that shardwise's own launcher uses: a process that imported torch once,
    # so a rank starts in milliseconds instead of importing torch again.
    mp.set_forkserver_preload(list(WORKER_IMPORTS))
    # The manager's server from the forkserver too: forked from this process (the default), it
    # copies whatever locks this process's threads (HiGHS, a planner's LP thread) held at the
    # fork, and once waited on one forever, a rank blocked on its reply (a full suite run).
    with mp.get_context("forkserver").Manager() as manager:
        results = manager.dict()
        mp.start_processes(_worker, args=(world_size, free_port(), fn, args, results), nprocs=world_size,
                           join=True, start_method="forkserver")
        return [results[r] for r in range(world_size)]


def real_inputs_for(gm: fx.GraphModule, seed: int = 0, vocab: int = 256) -> list[torch.Tensor]:
    """One real tensor per placeholder of ``gm``, shaped and typed like its fake value.

    Floating placeholders get ``PARAM_SCALE * randn``; integer ones (token ids, labels) get
    ``randint(0, vocab)``; both reproducible from ``seed``.
    """
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        v = n.meta["val"]
        if v.dtype.is_floating_point:
            out.append((PARAM_SCALE * torch.randn(tuple(v.shape), generator=g)).to(v.dtype))
        else:
            out.append(torch.randint(0, vocab, tuple(v.shape), generator=g, dtype=v.dtype))
    return out

# Multi-process tests start several ranks on a machine with few cores (CI: 2) where start-up
# alone can take tens of seconds under load; they get this run timeout instead of the default.
SLOW_MACHINE_TIMEOUT_S = 150.0


# Seconds one ``shardwise`` subprocess may take on a loaded 2-core machine before a test gives up.
CLI_TIMEOUT_S = 600


def cli(*argv: str, timeout_s: float = CLI_TIMEOUT_S) -> subprocess.CompletedProcess:
    """``python -m shardwise ARGV`` as a user runs it: a subprocess, its stdout and stderr as text."""
    return cli_all([argv], timeout_s)[0]


def json_object(proc: subprocess.CompletedProcess) -> dict:
    """A command's whole stdout parsed as JSON: it must have succeeded and printed one object."""
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Nothing the command's processes left behind is reported at its exit (multiprocessing's
    # resource tracker warns of semaphores a killed rank never released).
    assert "resource_tracker" not in proc.stderr, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert isinstance(out, dict)
    return out


def failed_check(proc: subprocess.CompletedProcess, err_key: str, sentence: str) -> dict:
    """A bf16 command run with ``--check --tolerance 1e-4 --json``, over fp32's tolerance: exit 1,
    ``sentence`` starting its one line on stderr, its result still one JSON object (returned)."""
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(sentence) and last.endswith("over the tolerance 0.0001 for bfloat16."), last
    out = json.loads(proc.stdout)
    assert out["tolerance"] == 1e-4 < out[err_key]
    return out


def cli_all(argvs: Sequence[Sequence[str]],
            timeout_s: float = CLI_TIMEOUT_S) -> list[subprocess.CompletedProcess]:
    """Independent ``shardwise`` commands run side by side (most of a short one's wall time is
    importing torch and waiting on its ranks, which overlap), their results in ``argvs``' order."""
    procs = [(list(argv), subprocess.Popen([sys.executable, "-m", "shardwise", *argv], cwd=REPO, text=True,
                                           stdout=subprocess.PIPE, stderr=subprocess.PIPE))
             for argv in argvs]
    done = []
    for argv, proc in procs:
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            for _, p in procs:
                p.kill()
            raise
        done.append(subprocess.CompletedProcess(argv, proc.returncode, out, err))
    return done
