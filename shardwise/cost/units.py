"""Byte sizes in text: ``512``, ``8KiB``, ``1GiB`` (powers of 1024), ``1GB``, ``1.5MB`` (powers of 1000)."""

from __future__ import annotations

import re

from shardwise.errors import UserError

_UNITS = {
    "": 1, "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
    "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40,
}
_SIZE = re.compile(r"\s*(-?\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*")


def parse_bytes(text: str | int) -> int:
    """``"1GiB"`` -> 1073741824; a bare number is bytes. Malformed or negative: ``UserError``."""
    if isinstance(text, int):
        value, unit = text, ""
    else:
        m = _SIZE.fullmatch(str(text))
        if m is None or m.group(2).upper() not in _UNITS:
            raise UserError(f"size {text!r} is malformed; write a number with an optional unit, "
                            "e.g. 512, 8KiB, 1GiB or 1GB.")
        value, unit = float(m.group(1)), m.group(2).upper()
    nbytes = value * _UNITS[unit]
    if nbytes < 0:
        raise UserError(f"size {text!r} is negative; a byte count must be at least 0.")
    if nbytes != int(nbytes):
        raise UserError(f"size {text!r} is not a whole number of bytes.")
    return int(nbytes)


def format_bytes(n: float) -> str:
    """``1073741824`` -> ``"1 GiB"`` (binary units, 3 significant digits)."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{int(n)} B"
