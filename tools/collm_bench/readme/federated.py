"""Federated aggregation strategies (bench/federated/strategies_bench.py; bench/results/federated/)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

BASES = {"peft_init": "PEFT init", "trained": "trained"}


def synthetic_table(doc: Mapping[str, Any]) -> str:
    """FedAvg against product-SVD on synthetic adapters of SmolLM2's shapes: error and time per setting."""
    lines = [
        f"{doc['participants']} participants, rank {doc['rank']}.",
        "",
        "| base | move | hetero | FedAvg rel_delta | product-SVD rel_delta | FedAvg ms | product-SVD ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in doc["rows"]:
        fa, ps = r["fedavg"], r["product_svd"]
        lines.append(
            f"| {BASES.get(r['base'], r['base'])} | {r['move']:g} | {r['hetero']:g} | {fa['rel_delta']:.4f} "
            f"| {ps['rel_delta']:.4f} | {1e3 * fa['seconds']:.0f} | {1e3 * ps['seconds']:.0f} |"
        )
    return "\n".join(lines)
