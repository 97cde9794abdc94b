"""The ``shardwise`` command. Each subcommand lives in its own module in this package and
exposes ``add_parser(subparsers)``; its handler returns a JSON-able dict (for ``--json``) and
prints the human report itself. ``UserError`` becomes one sentence on stderr and exit code 2; a
failed ``--check`` (``CheckFailed``) prints its result as usual, the sentence on stderr, exit code 1.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import sys

from shardwise.errors import CheckFailed, UserError
from shardwise.stdio import stdout_to_stderr

# Exit code of a run whose --check found it off its reference (2 is bad input).
CHECK_FAILED_EXIT = 1

# Subcommand modules, in the order ``--help`` lists them.
COMMANDS = ("trace", "plan", "run", "train", "export", "cost", "segment", "estimate")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's own usage errors: one line, exit 2
        sys.stderr.write(f"shardwise: error: {message}\n")
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="shardwise", description="A graph compiler for distributed PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name in COMMANDS:
        try:
            mod = importlib.import_module(f"shardwise.cli.{name}")
        except ModuleNotFoundError as e:
            if e.name == f"shardwise.cli.{name}":
                continue  # not built yet
            raise
        mod.add_parser(sub)
    return parser


def add_model_options(p: argparse.ArgumentParser, default_model: str = "llama3-8b") -> None:
    """The model options shared by trace, plan, run and segment."""
    p.add_argument("--model", default=default_model, help="built-in name or hf:path/to/config.json")
    p.add_argument("--layers", type=int, default=None, help="override the number of decoder layers")
    p.add_argument("--batch", type=int, default=None, help="override the example batch size")
    p.add_argument("--seq", type=int, default=None, help="override the example sequence length")
    p.add_argument("--dtype", choices=("bf16", "fp32", "fp16"), default=None)
    p.add_argument("--inference", action="store_true", help="forward only (default: a training step)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a report")


# Activation checkpointing policies (passes/remat.py's ACPolicy values).
AC_CHOICES = ("none", "selective", "full")


def positive_float(text: str) -> float:
    """An argparse ``type``: a number above 0 (refused as argparse refuses: one line, exit 2)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, not {text}")
    return value


def check_ac_name(name: str) -> None:
    """Refuse an ``--ac`` that names no policy (without importing torch, as ``remat`` does)."""
    if name not in AC_CHOICES:
        raise UserError(f"--ac {name!r}: unknown activation checkpointing policy; use one of "
                        f"{', '.join(AC_CHOICES)}.")


def add_step_options(p: argparse.ArgumentParser) -> None:
    """How the training step runs, as the step schedule prices it (shared by plan and estimate)."""
    p.add_argument("--ac", default=None,
                   help="activation checkpointing of every layer: none, selective or full (default: plan "
                   "chooses per layer; estimate runs the plan's choice, none for a hand plan)")
    p.add_argument("--compile", action="store_true",
                   help="price memory-bound work as torch.compile's fused kernels")
    p.add_argument("--async-tp", action="store_true",
                   help="fuse tensor-parallel collectives with their matmuls")


def step_options(args: argparse.Namespace, mesh_names: tuple[str, ...]) -> dict:
    """The step options ``add_step_options`` parsed, checked (``StepOptions`` fields)."""
    from shardwise.passes.remat import ACPolicy

    if args.ac is not None:
        check_ac_name(args.ac)
    if args.async_tp and "tp" not in mesh_names:
        raise UserError(f"--async-tp needs a tensor-parallel mesh dim named 'tp'; the mesh's dims are "
                        f"{', '.join(mesh_names)}.")
    # ``ac`` None: not given (the planner decides, the estimate runs the plan's choice).
    return {"ac": None if args.ac is None else ACPolicy(args.ac), "compile": args.compile,
            "async_tp": args.async_tp}


def check_output_file(path: str | None, flag: str) -> None:
    """Refuse an output file path that cannot be written (a directory, or in a missing one)
    before the command's work, not after it."""
    from pathlib import Path

    if path is None:
        return
    p = Path(path)
    if p.is_dir():
        raise UserError(f"{flag} {path!r} is a directory; give a file path.")
    if not p.parent.is_dir():
        raise UserError(f"{flag} {path!r}: directory {str(p.parent)!r} does not exist.")


def check_output_dir(path: str | None, flag: str) -> None:
    """Refuse an output directory that is a file before the command's work (it is made later,
    with any missing parents)."""
    from pathlib import Path

    if path is not None and Path(path).exists() and not Path(path).is_dir():
        raise UserError(f"{flag} {path!r} is a file; give a directory.")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # With --json, stdout carries one JSON object: whatever the command, its libraries or their
    # native code print meanwhile goes to stderr.
    guard = stdout_to_stderr() if getattr(args, "json", False) else contextlib.nullcontext()
    code = 0
    try:
        with guard:
            result = args.handler(args)
    except UserError as e:
        sys.stderr.write(f"shardwise {args.command}: error: {e}\n")
        return 2
    except CheckFailed as e:  # the run went through: its result still goes out
        sys.stderr.write(f"shardwise {args.command}: check failed: {e}\n")
        result, code = e.result, CHECK_FAILED_EXIT
    if args.json:
        print(json.dumps(result, indent=None, default=str))
    return code


if __name__ == "__main__":
    raise SystemExit(main())
