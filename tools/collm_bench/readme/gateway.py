"""The gateway's added latency and overload (`python -m collm_bench gateway overhead|overload`); results in
bench/results/gateway/."""

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


def overload_table(doc: Mapping[str, Any]) -> str:
    """One row per phase of `python -m collm_bench gateway overload`: what came back, and the 200s'
    latency."""
    lines = [
        "| phase | sent | 200 | 429 (with Retry-After) | 503 | other 5xx | other | 200 latency p50 / p99 s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, p in doc["phases"].items():
        lat = p["ok_latency_s"]
        latency = f"{lat['median']} / {lat['p99']}" if lat else "-"
        refused = f"{p['refused_429']} ({p['refused_429_with_retry_after']})"
        other = p["other_4xx"] + p["no_response"]
        lines.append(
            f"| {name} | {p['sent']} | {p['ok_200']} | {refused} | {p['unavailable_503']} | "
            f"{p['other_5xx']} | {other} | {latency} |"
        )
    return "\n".join(lines)
