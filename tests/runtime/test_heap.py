"""``runtime/heap.py``: after ``retain_freed_memory`` a step that frees all its temporaries at once
does not fault them back in on the next step (each case in a fresh interpreter: the setting is
process-wide)."""

from __future__ import annotations

import subprocess
import sys

# A step-like pattern: many 4 MiB temporaries (each under glibc's mmap threshold, so they come
# from the heap) allocated, written and freed together; the page faults of the later steps.
STEP = """
import resource, sys, torch
from shardwise.runtime.heap import retain_freed_memory
if sys.argv[1] == "retain":
    assert retain_freed_memory()
def step():
    temps = [torch.ones(2**20) for _ in range(16)]
    del temps
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""
PAGE_BYTES = 4096


def faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", STEP, mode], capture_output=True, text=True, check=True)
    return int(out.stdout)


def test_freed_memory_is_reused_instead_of_faulted_back_in():
    default, retained = faults("default"), faults("retain")
    step_pages = 16 * 2**20 * 4 // PAGE_BYTES
    assert default >= step_pages  # the default trims the heap: later steps fault theirs in again
    # A step reuses what the last one freed: over the four steps, 1,024 to 4,096 faults (a few of
    # the 64 temporaries' pages, by where glibc places them), against ~65,000 by default.
    assert retained < step_pages // 2
