"""The fixed-width table the planning benchmarks print: one column per key, floats to 3 places."""

from __future__ import annotations

WIDTH = 12


def print_rows(rows: list[dict], cols: tuple[str, ...]) -> None:
    print(" ".join(f"{c:>{WIDTH}}" for c in cols))
    for r in rows:
        print(" ".join(f"{r.get(c, ''):>{WIDTH}.3f}" if isinstance(r.get(c), float)
                       else f"{r.get(c, '')!s:>{WIDTH}}" for c in cols))
