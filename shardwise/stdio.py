"""Keeping the process's standard output clean.

Native libraries write to file descriptor 1 directly (HiGHS prints its banner when a ``Highs``
object is built, whatever its options say), out of reach of ``sys.stdout``. Two guards point
descriptor 1 elsewhere for the duration of a block and restore it afterwards, even on error:

- ``stdout_to_stderr()``: descriptor 1 and ``sys.stdout`` both go to stderr (the CLI wraps a
  ``--json`` command in it, then prints the one JSON object to the real stdout);
- ``native_stdout_silenced()``: descriptor 1 goes to the null device (the ILP builds its solver
  inside it, dropping the banner; Python's own ``sys.stdout`` is left alone).

And a library's logger that speaks on stderr of what shardwise reports itself is held quiet for
a block (``quiet_logger``).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import sys
from collections.abc import Iterator

STDOUT_FD = 1
STDERR_FD = 2


def _flush_c_stdio() -> None:
    """Flush C's stdio buffers: a native library's ``printf`` into a pipe sits in a buffer and
    would otherwise come out after descriptor 1 is restored."""
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError, TypeError):  # no C library reachable: nothing buffered there
        pass


@contextlib.contextmanager
def _fd1_to(target_fd: int) -> Iterator[None]:
    sys.stdout.flush()
    _flush_c_stdio()
    saved = os.dup(STDOUT_FD)
    try:
        os.dup2(target_fd, STDOUT_FD)
        try:
            yield
        finally:
            sys.stdout.flush()
            _flush_c_stdio()
    finally:
        os.dup2(saved, STDOUT_FD)
        os.close(saved)


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Whatever the block writes to descriptor 1 or ``sys.stdout`` goes to stderr."""
    # sys.stdout may not be descriptor 1 (pytest's capsys): send Python-level writes along too.
    with _fd1_to(STDERR_FD), contextlib.redirect_stdout(sys.stderr):
        yield


@contextlib.contextmanager
def native_stdout_silenced() -> Iterator[None]:
    """What native code writes to descriptor 1 within the block is discarded."""
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        with _fd1_to(null):
            yield
    finally:
        os.close(null)


@contextlib.contextmanager
def quiet_logger(logger: logging.Logger, level: int = logging.ERROR) -> Iterator[None]:
    """``logger``'s records below ``level`` dropped while the block runs."""
    saved = logger.level
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(saved)
