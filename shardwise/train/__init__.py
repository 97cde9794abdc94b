"""Training with shardwise: ``parallelize`` (a DTensor module for torch.optim and DCP), data,
checkpoints and the ``shardwise train`` loop.

Names are imported on first use: the train command checks its options (``options.py``) before
anything imports torch."""

from __future__ import annotations

import importlib

_EXPORTS = {
    "ParallelModule": "shardwise.train.module",
    "init_values": "shardwise.train.module",
    "parallelize": "shardwise.train.module",
    "build_model": "shardwise.train.models",
    "meta_inputs": "shardwise.train.models",
    "params_on_meta": "shardwise.train.models",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'shardwise.train' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
