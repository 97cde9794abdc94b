"""``shardwise export``: a training checkpoint -> one safetensors state dict under the model's names.

The newest checkpoint in ``--resume DIR`` (saved under any mesh and plan) is loaded into the plain
single-device module (DCP reshards it), then written to ``--out DIR``: for an ``hf:`` model through
``transformers``' ``save_pretrained`` (``config.json`` + ``model.safetensors``, which
``AutoModelForCausalLM.from_pretrained`` loads), for a built-in model as ``model.safetensors`` with
the module's parameter names. ``--json`` prints ``{"out", "files", "step", "model", "parameters"}``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from shardwise.cli import check_output_dir


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="write a training checkpoint as a safetensors state dict")
    p.add_argument("--resume", required=True, help="a save dir of shardwise train")
    p.add_argument("--out", required=True, help="directory to write the state dict into")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a report")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> dict:
    from safetensors.torch import save_model

    from shardwise.models import HF_PREFIX
    from shardwise.train import checkpoint
    from shardwise.train.models import build_model

    check_output_dir(args.out, "--out")
    out = Path(args.out)
    meta = checkpoint.read_meta(checkpoint.latest(args.resume))
    build = {k: meta.extra.get(k) for k in ("layers", "batch", "seq", "dtype")}
    module, _ = build_model(meta.model, meta=False, **build)
    checkpoint.load_plain(args.resume, module)
    out.mkdir(parents=True, exist_ok=True)
    if meta.model.startswith(HF_PREFIX):
        module.model.save_pretrained(out, safe_serialization=True)
    else:
        save_model(module, str(out / "model.safetensors"))
    result = {"out": str(out), "files": sorted(p.name for p in out.iterdir()), "step": meta.step,
              "model": meta.model, "parameters": sum(p.numel() for p in module.parameters())}
    if not args.json:
        print(f"exported {meta.model} at step {meta.step} ({result['parameters']:,} parameters) to {out}: "
              + ", ".join(result["files"]))
    return result
