"""The stdout guards move native (descriptor 1) and Python writes, and restore stdout after."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import ctypes, os, sys
from shardwise.stdio import native_stdout_silenced, stdout_to_stderr
libc = ctypes.CDLL(None)
with stdout_to_stderr():
    os.write(1, b"native-to-err\\n")
    libc.printf(b"buffered-c-to-err\\n")  # sits in C's buffer when stdout is a pipe
    print("python-to-err")
with native_stdout_silenced():
    os.write(1, b"dropped\\n")
    libc.printf(b"dropped-too\\n")
try:
    with stdout_to_stderr():
        raise KeyError("boom")
except KeyError:
    pass
print("after")
"""


def test_guards_route_native_and_python_writes_and_restore_stdout():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True)
    assert proc.stdout == "after\n"
    for line in ("native-to-err", "buffered-c-to-err", "python-to-err"):
        assert line in proc.stderr
    assert "dropped" not in proc.stdout + proc.stderr
