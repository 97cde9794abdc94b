"""The placement ILP is the same model whatever the process: its rows do not follow hash order."""

from __future__ import annotations

import os
import subprocess
import sys

# Builds a small training step's ILP (schedule objective, its memory rows) and prints a digest of
# every column and row. Partial placements hash by their reduce op's string, which Python's hash
# seed changes from process to process.
DIGEST = """
import hashlib
import numpy as np
from shardwise.ir.trace import trace_model
from shardwise.mesh import Mesh
from shardwise.passes.pipeline import canonicalize
from shardwise.plan.planner import prepare_plan
tr = trace_model("llama-tiny", layers=1, batch=4, seq=32)
canonicalize(tr)
m = prepare_plan(tr, Mesh((4,), ("dp",), "h100"), step_options={}).model.m
h = hashlib.sha256()
for a in (m.cost, m.lb, m.ub, m.row_lb, m.row_ub, m.starts, m.index, m.value):
    h.update(np.asarray(a, dtype=np.float64).tobytes())
print(len(m.cost), len(m.row_lb), h.hexdigest())
"""


def test_the_ilp_is_the_same_under_any_hash_seed():
    runs = [subprocess.Popen([sys.executable, "-c", DIGEST], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONHASHSEED": seed}) for seed in ("1", "2")]
    outs = [run.communicate(timeout=300)[0].strip() for run in runs]
    assert all(run.returncode == 0 for run in runs)
    assert outs[0] and outs[0] == outs[1]
