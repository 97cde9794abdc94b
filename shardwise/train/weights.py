"""Pretrained weights from safetensors files: each rank reads only the pieces it keeps.

``shardwise train --init-from PATH`` and ``ParallelModule.load_weights(PATH)`` start training
from the weights in PATH instead of ``init_weights``: a ``.safetensors`` file, or a directory
holding ``model.safetensors`` or a sharded ``model.safetensors.index.json`` (what
``transformers``' ``save_pretrained`` writes, and what ``shardwise export`` writes).

Names: a parameter is looked up under the model's own name; for an ``hf:`` model, whose
module wraps the transformers model as ``model`` (``models/hf.HFCausalLM``), under the
transformers name, the way ``save_pretrained`` wrote it. A tied weight (an output head sharing
the embedding) is one parameter with several names, stored under any one of them
(``save_pretrained`` keeps the embedding's, safetensors' ``save_model`` may keep the head's).

safetensors maps the file and slices a tensor before reading it (``get_slice``), so a rank
copies out only the block its shard holds (``Layout.index``), never the whole tensor (the
pages it touches are the file's, which the kernel may drop). Values are cast to the
parameter's dtype.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from shardwise.errors import UserError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SUFFIX = ".safetensors"
HF_WRAPPED = "model."  # ``HFCausalLM``'s attribute holding the transformers model
# (parameter name, the tensor to fill, the parameter's global shape, where the tensor lies in it)
Piece = tuple[str, torch.Tensor, Sequence[int], tuple[slice, ...] | None]


def weight_files(path: str | Path) -> dict[str, Path]:
    """The file of every tensor name in ``path`` (a safetensors file, or a directory with one or
    with an index of several); one sentence where there is none, or a file is missing or no
    safetensors file."""
    from safetensors import SafetensorError, safe_open

    p = Path(path)
    if p.is_file() and p.suffix == SUFFIX:
        files = [p]
    elif (p / INDEX_FILE).is_file():
        try:
            names = json.loads((p / INDEX_FILE).read_text())["weight_map"].values()
        except (ValueError, KeyError, AttributeError):
            raise UserError(f"{p / INDEX_FILE} is no safetensors index (it lacks a weight_map).") from None
        files = [p / f for f in dict.fromkeys(names)]
    elif (p / SINGLE_FILE).is_file():
        files = [p / SINGLE_FILE]
    else:
        raise UserError(f"{str(path)!r} holds no weights: give a .safetensors file or a directory with "
                        f"{SINGLE_FILE} or {INDEX_FILE}.")
    out: dict[str, Path] = {}
    for f in files:
        if not f.is_file():
            raise UserError(f"{INDEX_FILE} in {str(path)!r} names {f.name}, which is not there.")
        try:
            with safe_open(str(f), framework="pt") as handle:
                out.update(dict.fromkeys(handle.keys(), f))
        except SafetensorError as e:
            raise UserError(f"{str(f)!r} is no safetensors file ({e}).") from None
    return out


def stored_prefix(module: nn.Module) -> str:
    """What ``module``'s parameter names carry beyond the names its weights are stored under."""
    from shardwise.models.hf import HFCausalLM

    return HF_WRAPPED if isinstance(module, HFCausalLM) else ""


def aliases(module: nn.Module) -> dict[str, list[str]]:
    """Every name of each of ``module``'s parameters (a tied one has several), keyed by the name
    ``named_parameters()`` gives it."""
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return {all_names[0]: all_names for all_names in names.values()}


class Pretrained:
    """The tensors of ``path`` as a module's parameters, read a piece at a time: their names carry
    ``prefix`` (``stored_prefix``), a tied one's ``names`` are all its names (``aliases``)."""

    def __init__(self, path: str | Path, prefix: str = "",
                 names: dict[str, list[str]] | None = None) -> None:
        self.path = str(path)
        self.files = weight_files(path)
        self.prefix = prefix
        self.aliases = names or {}

    def key(self, name: str) -> str:
        """The name parameter ``name`` is stored under (its own where none of its names is)."""
        keys = [n.removeprefix(self.prefix) for n in self.aliases.get(name, [name])]
        return next((k for k in keys if k in self.files), keys[0])

    def check(self, shapes: Sequence[tuple[str, Sequence[int]]]) -> None:
        """Refuse weights that lack a parameter of ``shapes`` (name, global shape) or hold it in
        another shape: one sentence, naming the first (only the files' headers are read)."""
        from safetensors import safe_open

        missing = [n for n, _ in shapes if self.key(n) not in self.files]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise UserError(f"the weights at {self.path!r} hold no tensor {self.key(missing[0])!r} for "
                            f"parameter {missing[0]}{more}; are they this model's?")
        for name, shape in shapes:
            key = self.key(name)
            with safe_open(str(self.files[key]), framework="pt") as handle:
                stored = list(handle.get_slice(key).get_shape())
            if stored != list(shape):
                raise UserError(f"the weights at {self.path!r} hold {key!r} in shape {stored}, parameter "
                                f"{name} is {list(shape)}; are they this model's (--layers)?")

    def fill(self, pieces: Sequence[Piece]) -> None:
        """Copy each piece in (its index None: the whole parameter), once the weights are known
        to hold every parameter in its shape."""
        from safetensors import safe_open

        self.check([(name, shape) for name, _, shape, _ in pieces])
        with torch.no_grad():
            for name, out, shape, index in pieces:
                key = self.key(name)
                with safe_open(str(self.files[key]), framework="pt") as handle:
                    piece = handle.get_slice(key)
                    out.copy_(piece[index or tuple(slice(0, d) for d in shape)])
