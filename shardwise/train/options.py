"""What a training run is asked for (``shardwise train``'s options), checked without torch:
the command refuses a mistyped option at once, before the seconds that importing torch takes."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from shardwise.errors import UserError

# AdamW's peak learning rate where none is given: torchtitan's Llama 3 8B and 70B configurations
# train at 3e-4 (width 4096) and 1.5e-4 (8192), REFERENCE_LR x REFERENCE_WIDTH / width; narrow
# models at MAX_DEFAULT_LR at most (what the tiny models were tuned at). 3e-3 diverges at width
# 4096: a 2-layer Llama of that width (an hf config with vocab 2048, batch 2 x 64, synthetic
# data, 8 steps) went 8.25 -> 34.0 by step 4 and stayed near 5, where 3e-4 reached 0.14.
REFERENCE_LR = 3e-4
REFERENCE_WIDTH = 4096
MAX_DEFAULT_LR = 3e-3


def default_lr(width: int) -> float:
    """The peak learning rate ``shardwise train`` uses for a model of this width by default."""
    return min(MAX_DEFAULT_LR, REFERENCE_LR * REFERENCE_WIDTH / width)


@dataclass
class TrainOptions:
    steps: int = 20  # length of the schedule (and of the run, unless stop_at)
    lr: float | None = None  # None: ``default_lr`` of the model's width (set by ``cli/train.py``)
    warmup: int = 2
    weight_decay: float = 0.1
    clip: float = 1.0  # max gradient norm; 0 disables clipping
    seed: int = 0
    save_dir: str | None = None
    save_every: int = 0
    resume: str | None = None
    stop_at: int | None = None  # stop after this step (the schedule still spans ``steps``)
    init_from: str | None = None  # safetensors weights to start from (``train/weights.py``)

    @property
    def last_step(self) -> int:
        """The step the run ends after."""
        return self.stop_at or self.steps

    def check(self) -> None:
        if self.steps <= 0:
            raise UserError(f"--steps must be a positive integer, got {self.steps}.")
        for name in ("warmup", "save_every"):
            if getattr(self, name) < 0:
                raise UserError(f"--{name.replace('_', '-')} must not be negative.")
        if (self.lr is not None and self.lr <= 0) or self.clip < 0 or self.weight_decay < 0:
            raise UserError("--lr must be positive, --clip and --weight-decay not negative.")
        if self.save_every and not self.save_dir:
            raise UserError("--save-every needs --save-dir.")
        if self.save_dir and Path(self.save_dir).exists() and not Path(self.save_dir).is_dir():
            raise UserError(f"save dir {self.save_dir!r} is a file, not a directory.")
        if self.stop_at is not None and not 0 < self.stop_at <= self.steps:
            raise UserError(f"--stop-at must lie in 1..{self.steps} (--steps).")
        if self.init_from is not None:
            if self.resume:
                raise UserError("--init-from starts a run from weights, --resume continues a run; give one.")
            if not Path(self.init_from).exists():
                raise UserError(f"--init-from {self.init_from!r} does not exist.")


def existing_file(path: str, what: str) -> Path:
    """``path`` as a ``Path``; one sentence naming ``what`` it is where it is no file."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{what} {path!r} {'is not a file' if p.exists() else 'does not exist'}.")
    return p
