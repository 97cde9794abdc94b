"""Training with shardwise: ``parallelize`` (a DTensor module for torch.optim and DCP), data,
checkpoints and the ``shardwise train`` loop."""

from shardwise.train.models import build_model, meta_inputs, params_on_meta
from shardwise.train.module import ParallelModule, init_values, parallelize

__all__ = ["ParallelModule", "build_model", "init_values", "meta_inputs", "parallelize", "params_on_meta"]
