"""Running lowered programs on real process groups (``launch.py``) and counting what they send."""

from shardwise.runtime.launch import Fault, FaultKind, RunError, RunResult, run, run_many  # noqa: F401
