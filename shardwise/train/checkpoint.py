"""Checkpoints: torch.distributed.checkpoint (DCP) directories, written atomically, resharded on load.

Layout of a save dir::

    DIR/latest                 the name of the newest complete checkpoint (replaced atomically)
    DIR/step-000010/           a DCP checkpoint: {"model": ..., "optim": ...} from get_state_dict
    DIR/step-000010/shardwise.json   step, LR schedule, model name and parameter shapes
    DIR/step-000010/rng.pt     rank 0's torch RNG states: the CPU's, and on GPUs its device's
                               (every rank seeds alike)

A save writes ``step-N.tmp`` (every rank its shards), then rank 0 adds the metadata, renames it to
``step-N`` and replaces ``latest``: a crash at any point leaves ``latest`` naming the previous
complete checkpoint, and half-written ``.tmp`` dirs are never read (the next save removes them).
Loading goes through DCP's resharding, so a checkpoint saved under one mesh and plan loads under
any other, into one process, or into the plain module (``load_plain``).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from shardwise.errors import UserError

LATEST = "latest"
META = "shardwise.json"
RNG = "rng.pt"
TMP_SUFFIX = ".tmp"
FORMAT_VERSION = 1


@dataclass
class CheckpointMeta:
    step: int
    model: str
    params: dict[str, list[int]]  # parameter name -> global shape
    scheduler: dict
    extra: dict

    def to_json(self) -> dict:
        return {"version": FORMAT_VERSION, "step": self.step, "model": self.model, "params": self.params,
                "scheduler": self.scheduler, "extra": self.extra}


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:06d}"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def param_shapes(module: nn.Module) -> dict[str, list[int]]:
    return {k: list(p.shape) for k, p in module.named_parameters()}


def save(root: str | Path, step: int, module: nn.Module, optimizer: torch.optim.Optimizer,
         scheduler, model_name: str, extra: dict | None = None) -> Path:
    """Write checkpoint ``step`` under ``root`` (collective: every rank calls it)."""
    root = Path(root)
    final = _step_dir(root, step)
    tmp = final.with_name(final.name + TMP_SUFFIX)
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(f"step-*{TMP_SUFFIX}"):
            shutil.rmtree(stale, ignore_errors=True)
    _barrier()
    model_sd, optim_sd = get_state_dict(module, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
    _barrier()
    if _rank() == 0:
        meta = CheckpointMeta(step, model_name, param_shapes(module), scheduler.state_dict(), extra or {})
        (tmp / META).write_text(json.dumps(meta.to_json(), indent=1))
        torch.save(generator_states(_device_type(module)), tmp / RNG)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        pointer = root / (LATEST + TMP_SUFFIX)
        pointer.write_text(final.name)
        os.replace(pointer, root / LATEST)
    _barrier()
    return final


def latest(root: str | Path) -> Path:
    """The newest complete checkpoint under ``root``, or one clear error."""
    root = Path(root)
    pointer = root / LATEST
    if not root.is_dir():
        what = "is a file, not a directory" if root.exists() else "does not exist"
        raise UserError(f"resume dir {str(root)!r} {what}.")
    if not pointer.is_file():
        raise UserError(f"resume dir {str(root)!r} holds no checkpoint (no {LATEST} file); train with "
                        "--save-dir first.")
    path = root / pointer.read_text().strip()
    if not (path / META).is_file():
        raise UserError(f"resume dir {str(root)!r} names checkpoint {path.name} but it is incomplete.")
    return path


def read_meta(path: Path) -> CheckpointMeta:
    try:
        doc = json.loads((path / META).read_text())
        return CheckpointMeta(doc["step"], doc["model"], doc["params"], doc["scheduler"],
                              doc.get("extra", {}))
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise UserError(f"checkpoint {str(path)!r} has unreadable metadata ({type(e).__name__}).") from None


def check_compatible(meta: CheckpointMeta, module: nn.Module, model_name: str, path: Path) -> None:
    """Refuse a checkpoint of another model (by name or parameter shapes)."""
    shapes = param_shapes(module)
    if meta.model != model_name:
        raise UserError(f"checkpoint {str(path)!r} is of model {meta.model!r}, not {model_name!r}.")
    if meta.params != shapes:
        names = sorted(set(shapes) | set(meta.params))
        diff = next(k for k in names if shapes.get(k) != meta.params.get(k))
        saved = "not in it" if diff not in meta.params else f"{meta.params[diff]} in it"
        here = "none here" if diff not in shapes else f"{shapes[diff]} here"
        raise UserError(f"checkpoint {str(path)!r} is of another shape of {model_name!r} (--layers, sizes): "
                        f"parameter {diff} is {saved}, {here}.")


def load(root: str | Path, module: nn.Module, optimizer: torch.optim.Optimizer, scheduler,
         model_name: str) -> CheckpointMeta:
    """Restore parameters, optimizer state, LR schedule and RNG from the newest checkpoint
    (resharded to ``module``'s placements); returns its metadata (the step to continue from)."""
    path = latest(root)
    meta = read_meta(path)
    check_compatible(meta, module, model_name, path)
    model_sd, optim_sd = get_state_dict(module, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    scheduler.load_state_dict(meta.scheduler)
    _set_rng_states(module, torch.load(path / RNG))
    return meta


def _device_type(module: nn.Module) -> str:
    """Where the module's parameters live ("cpu", "cuda", ...)."""
    p = next(module.parameters(), None)
    return p.device.type if p is not None else "cpu"


def generator_states(device_type: str) -> dict[str, torch.Tensor]:
    """The states of the generators a step on ``device_type`` draws from (its dropout masks): the
    CPU's, and on an accelerator the current device's."""
    states = {"cpu": torch.get_rng_state()}
    if device_type != "cpu":
        states[device_type] = torch.get_device_module(device_type).get_rng_state()
    return states


def _set_rng_states(module: nn.Module, states: dict[str, torch.Tensor] | torch.Tensor) -> None:
    if isinstance(states, torch.Tensor):  # a checkpoint written before the device's state was kept
        states = {"cpu": states}
    torch.set_rng_state(states["cpu"])
    kind = _device_type(module)
    if kind != "cpu" and kind in states:
        torch.get_device_module(kind).set_rng_state(states[kind])


def load_plain(root: str | Path, module: nn.Module) -> CheckpointMeta:
    """Load the newest checkpoint's parameters into a plain single-device module (no process
    group needed)."""
    path = latest(root)
    meta = read_meta(path)
    state = {"model": {k: v.detach().clone() for k, v in module.state_dict().items()}}
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    module.load_state_dict(state["model"])
    return meta
