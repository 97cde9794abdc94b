"""Token streams for training: each global sample is a window of ``seq + 1`` tokens (inputs and
next-token labels), and each rank reads only the rows and columns of the batch it holds.

Sample ``j`` of the run (step ``t`` holds samples ``t * batch .. t * batch + batch - 1``) is a pure
function of ``j``, so the data position is the step: resuming at step ``t`` continues the same
stream, whatever the mesh, plan or number of ranks.

Sources:
- ``SyntheticSource``: chains through a fixed random permutation of a fixed random set of
  ``SYNTHETIC_ALPHABET`` ids (each next token is the image of the current one), from a start drawn
  per sample: a bigram table that a model learns within a few steps, so the loss visibly falls;
  free and endless.
- ``TokenFileSource``: a flat array of token ids on disk, memory-mapped: the bytes of a text file
  (byte-level tokens) or a ``.npy`` of ids that ``tokenize_file`` wrote with a Hugging Face
  ``tokenizer.json``. Windows start every ``seq`` tokens and wrap around the file.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from shardwise.errors import UserError
from shardwise.train.options import existing_file

# Byte-level tokens: one id per byte.
BYTE_VOCAB = 256
# Ids the synthetic chains use: few enough that a small batch shows most bigrams every step.
SYNTHETIC_ALPHABET = 64


@dataclass(frozen=True)
class SyntheticSource:
    vocab_size: int
    seed: int = 0

    @functools.cached_property
    def _chain(self) -> tuple[np.ndarray, np.ndarray]:
        """The ids used and, for each position k among them, the position that follows it."""
        rng = np.random.default_rng([self.seed])
        ids = rng.choice(self.vocab_size, size=min(SYNTHETIC_ALPHABET, self.vocab_size), replace=False)
        return ids, rng.permutation(len(ids))

    def window(self, sample: int, seq: int) -> np.ndarray:
        ids, nxt = self._chain
        pos = np.empty(seq + 1, dtype=np.int64)
        pos[0] = np.random.default_rng([self.seed, sample]).integers(0, len(ids))
        for i in range(seq):
            pos[i + 1] = nxt[pos[i]]
        return ids[pos].astype(np.int64)

    def describe(self) -> str:
        return "synthetic"


@dataclass(frozen=True)
class TokenFileSource:
    path: str
    dtype: str  # numpy dtype of the stored ids ("uint8" for raw bytes)
    offset: int = 0  # bytes of header before the ids (a .npy file's)

    def _ids(self) -> np.ndarray:
        return np.memmap(self.path, dtype=self.dtype, mode="r", offset=self.offset)

    def window(self, sample: int, seq: int) -> np.ndarray:
        ids = self._ids()
        n = len(ids)
        start = (sample * seq) % n
        idx = (start + np.arange(seq + 1)) % n
        return np.asarray(ids[idx], dtype=np.int64)

    def describe(self) -> str:
        return self.path


def byte_source(path: str, vocab_size: int) -> TokenFileSource:
    """A text file read as byte-level tokens (needs a vocabulary of at least 256 ids)."""
    p = existing_file(path, "data file")
    if p.stat().st_size < 2:
        raise UserError(f"data file {path!r} is empty; give a text file with some content.")
    if vocab_size < BYTE_VOCAB:
        raise UserError(f"byte-level tokens need a vocabulary of {BYTE_VOCAB} ids and the model has "
                        f"{vocab_size}; pass --tokenizer.")
    return TokenFileSource(str(p), "uint8")


def tokenize_file(path: str, tokenizer: str, out_dir: str | Path, vocab_size: int) -> TokenFileSource:
    """Encode a text file with a local Hugging Face ``tokenizer.json`` into ``out_dir/tokens.npy``
    once (the ranks then memory-map it and read only their windows)."""
    p = existing_file(path, "data file")
    t = existing_file(tokenizer, "tokenizer file")
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(t))
    except Exception as e:  # tokenizers raises its own exception types for malformed files
        raise UserError(f"tokenizer file {tokenizer!r} cannot be read as a tokenizer.json "
                        f"({type(e).__name__}).") from None
    ids = np.asarray(tok.encode(p.read_text(errors="replace")).ids, dtype=np.uint32)
    if len(ids) < 2:
        raise UserError(f"data file {path!r} holds fewer than 2 tokens; give it more text.")
    if int(ids.max()) >= vocab_size:
        raise UserError(f"the tokenizer produces id {int(ids.max())} but the model's vocabulary has "
                        f"{vocab_size} ids; use a tokenizer of this model.")
    out = Path(out_dir) / "tokens.npy"
    out.parent.mkdir(parents=True, exist_ok=True)
    np.save(out, ids)
    with open(out, "rb") as f:
        np.lib.format.read_magic(f)
        np.lib.format.read_array_header_1_0(f)
        offset = f.tell()
    return TokenFileSource(str(out), "uint32", offset)


def batch_rows(source, step: int, batch: int, seq: int, rows: slice, cols: slice) -> tuple[torch.Tensor, ...]:
    """``(tokens, labels)`` of step ``step`` restricted to ``rows`` x ``cols`` of the global
    ``batch x seq`` batch: only those samples are read."""
    windows = np.stack([source.window(step * batch + i, seq) for i in range(*rows.indices(batch))])
    tokens = torch.from_numpy(windows[:, :-1][:, cols].copy())
    labels = torch.from_numpy(windows[:, 1:][:, cols].copy())
    return tokens, labels


def global_batch(source, step: int, batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    return batch_rows(source, step, batch, seq, slice(0, batch), slice(0, seq))
