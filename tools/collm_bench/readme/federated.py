"""Federated aggregation strategies (`python -m collm_bench federated strategies`; results in
bench/results/federated/)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

BASES = {"peft_init": "PEFT init", "trained": "trained"}


def synthetic_table(doc: Mapping[str, Any]) -> str:
    """FedAvg against product-SVD on synthetic adapters of SmolLM2's shapes: per base and move, the
    aggregates' rel_delta at each heterogeneity (FedAvg / product-SVD), then each one's time range."""
    rows = doc["rows"]
    heteros = sorted({r["hetero"] for r in rows})
    lines = [
        f"{doc['participants']} participants, rank {doc['rank']}; rel_delta FedAvg / product-SVD.",
        "",
        "| base | move | " + " | ".join(f"hetero {h:g}" for h in heteros) + " |",
        "|---|---|" + "---|" * len(heteros),
    ]
    groups: dict[tuple[str, float], dict[float, Mapping[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["base"], r["move"]), {})[r["hetero"]] = r
    for (base, move), by_h in groups.items():
        cells = [
            f"{by_h[h]['fedavg']['rel_delta']:.4f} / {by_h[h]['product_svd']['rel_delta']:.4f}"
            if h in by_h
            else "-"
            for h in heteros
        ]
        lines.append(f"| {BASES.get(base, base)} | {move:g} | " + " | ".join(cells) + " |")
    ms = {k: [1e3 * r[k]["seconds"] for r in rows] for k in ("fedavg", "product_svd")}
    lines += [
        "",
        f"Time per aggregation: FedAvg {min(ms['fedavg']):.0f}-{max(ms['fedavg']):.0f} ms, product-SVD "
        f"{min(ms['product_svd']):.0f}-{max(ms['product_svd']):.0f} ms.",
    ]
    return "\n".join(lines)
