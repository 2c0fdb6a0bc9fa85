"""The gateway's added latency (bench/gateway_overhead.py, results in bench/results/gateway/)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def overhead_table(docs: Sequence[Mapping[str, Any]]) -> str:
    """One row per replica model: direct NATS against via the gateway, their difference and ratio."""
    lines = [
        "| replica model | requests each | direct NATS ms (median / p99) | via gateway ms (median / p99) "
        "| added ms (median / p99) | per-pair difference ms (median / p99) | ratio (median / p99) |",
        "|---|---|---|---|---|---|---|",
    ]
    for d in docs:
        dn, gw, add, pair, ratio = (
            d["direct_nats"],
            d["via_gateway"],
            d["added_ms"],
            d["paired_added_ms"],
            d["ratio"],
        )
        lines.append(
            f"| {d['replica_model']} | {d['requests']} | {dn['median_ms']:.2f} / {dn['p99_ms']:.2f} "
            f"| {gw['median_ms']:.2f} / {gw['p99_ms']:.2f} | {add['median']:.2f} / {add['p99']:.2f} "
            f"| {pair['median']:.2f} / {pair['p99']:.2f} | {ratio['median']:.3f} / {ratio['p99']:.3f} |"
        )
    return "\n".join(lines)
