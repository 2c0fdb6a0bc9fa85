"""Tables and plots of the simulator's benchmarks (`python -m collm_bench sim NAME`, results in
bench/results/sim/)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def f(x: Any, nd: int = 2) -> str:
    """A figure for a table cell: `-` when absent, floats to `nd` decimals."""
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def speed_table(doc: Mapping[str, Any]) -> str:
    """Simulated seconds per wall second at each cluster size (the whole run: routing, ticks, rounds)."""
    out = [
        "| replicas | rate (req/s) | simulated s | wall s | simulated s per wall s | iterations |",
        "|---|---|---|---|---|---|",
    ]
    for r in doc["runs"]:
        out.append(
            f"| {r['replicas']} | {r['rate_rps']:.2f} | {r['sim_time_s']:.0f} | {r['wall_s']:.1f} | "
            f"{r['sim_seconds_per_wall_second']:.1f} | {r['iterations']} |"
        )
    return "\n".join(out)


def routing_table(doc: Mapping[str, Any]) -> str:
    """collm with its routing weights not published (least-loaded routing) and published, by rate."""
    by = {(r["rate_rps"], r["publish_weights"]): r for r in doc["runs"]}
    out = [
        "| rate (req/s) | goodput / attainment / ft tokens, weights not published | ... published |",
        "|---|---|---|",
    ]
    for rate in sorted({r["rate_rps"] for r in doc["runs"]}):
        cells = [
            "-"
            if (r := by.get((rate, pub))) is None
            else f"{r['goodput_rps']:.3f} / {r['attainment']:.3f} / {r['ft_tokens']}"
            for pub in (False, True)
        ]
        out.append(f"| {rate:.3f} | {cells[0]} | {cells[1]} |")
    return "\n".join(out)
