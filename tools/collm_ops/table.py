"""Plain-text tables and value formatting for the `collm` CLI (pure, no I/O)."""

from __future__ import annotations

import time
from collections.abc import Sequence


def render_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Left-aligned columns separated by two spaces; `None` prints as `-`."""
    cells = [[str(h) for h in headers]] + [["-" if v is None else str(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    return "\n".join(lines)


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} ms"


def pct(value: float | None) -> str:
    return "-" if value is None else f"{100.0 * value:.0f}%"


def num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def when(unix_s: float | None) -> str:
    """UTC time of day for recent instants, full date otherwise."""
    if not unix_s:
        return "-"
    if abs(time.time() - unix_s) < 86400:
        return time.strftime("%H:%M:%S", time.gmtime(unix_s))
    return time.strftime("%Y-%m-%d %H:%M", time.gmtime(unix_s))


def size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)
