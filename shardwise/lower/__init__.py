"""Lowering a plan to the per-rank program (``lower/spmd.py``)."""

from shardwise.lower.spmd import Layout, SPMDProgram, lower, lower_on  # noqa: F401
