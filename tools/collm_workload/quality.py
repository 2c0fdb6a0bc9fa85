"""Served quality: join each request with the eval loss of the adapter version that served it (pure).

Quality of a request = the held-out eval loss, on the request's domain, of the exact version that
served it (docs/architecture.md, Served quality); quality gain = base-model loss on that domain -
served loss (higher is better).

The table maps version ids to per-domain losses, as the adapter store's quality records do
(`AdapterStore.quality(name, version)` -> {domain: loss}), plus the base model's loss per domain.
JSON form (`--quality FILE`):

    {"base": {"medical": 2.31, "math": 1.92},
     "medical@v3": {"medical": 1.95},
     "math@v2": 1.50}

A bare number is the version's loss on whatever domain it served. Lookups: a request served by
`base` gets the base loss (gain 0); `name@vN` is looked up exactly; a replica-local refresh
`name@vN+rX.Y` has no store record of its own and is joined with its published parent `name@vN`
(counted separately in the summary's `joined_via` as `parent`, since the refresh may be somewhat better).
Requests with no version (a server that does not report one) or no matching record are counted as
unjoined and left out of the averages.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from collm_workload.records import RequestRecord

BASE_VERSION = "base"
_ANY_DOMAIN = "*"


@dataclass
class QualityTable:
    versions: dict[str, dict[str, float]] = field(default_factory=dict)
    base: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_obj(cls, obj: Mapping[str, Any]) -> QualityTable:
        if not isinstance(obj, Mapping):
            raise ValueError("a quality table is a JSON object: version id -> {domain: loss}")
        table = cls()
        for key, value in obj.items():
            if isinstance(value, int | float):
                losses = {_ANY_DOMAIN: float(value)}
            elif isinstance(value, Mapping):
                losses = {str(d): float(v) for d, v in value.items()}
            else:
                raise ValueError(f"quality entry {key!r}: want a number or {{domain: loss}}")
            if key == BASE_VERSION:
                table.base.update(losses)
            else:
                table.versions[str(key)] = losses
        return table

    @classmethod
    def load(cls, path: str | Path) -> QualityTable:
        with Path(path).open(encoding="utf-8") as f:
            return cls.from_obj(json.load(f))

    def merge(self, other: QualityTable) -> QualityTable:
        return QualityTable({**self.versions, **other.versions}, {**self.base, **other.base})

    def base_loss(self, domain: str) -> float | None:
        return self.base.get(domain, self.base.get(_ANY_DOMAIN))

    def served_loss(self, version_id: str | None, domain: str) -> tuple[float | None, str | None]:
        """(loss, how it was joined: "exact" | "parent" | "base") or (None, None)."""
        if not version_id:
            return None, None
        if version_id == BASE_VERSION:
            loss = self.base_loss(domain)
            return (loss, "base") if loss is not None else (None, None)
        for candidate, how in ((version_id, "exact"), (version_id.split("+", 1)[0], "parent")):
            losses = self.versions.get(candidate)
            if losses is not None:
                loss = losses.get(domain, losses.get(_ANY_DOMAIN))
                if loss is not None:
                    return loss, how
        return None, None


def _mean(xs: Sequence[float]) -> float | None:
    return float(np.mean(xs)) if xs else None


def request_quality(rec: RequestRecord, table: QualityTable) -> tuple[float | None, float | None, str | None]:
    """(served loss, quality gain, join kind) of one served request."""
    loss, how = table.served_loss(rec.adapter_version, rec.domain)
    base = table.base_loss(rec.domain)
    gain = base - loss if (loss is not None and base is not None) else None
    return loss, gain, how


def quality_summary(records: Sequence[RequestRecord], table: QualityTable) -> dict[str, Any]:
    """Served quality over the requests that completed (status ok), overall and per domain.

    `last_*` per domain is the version that served the domain's last completed request (by end time):
    the quality users get at the end of the run. `final_quality_gain` averages it over domains.
    """
    served = sorted((r for r in records if r.status == "ok"), key=lambda r: (r.end_s or 0.0, r.index))
    losses: list[float] = []
    gains: list[float] = []
    via: dict[str, int] = {"exact": 0, "parent": 0, "base": 0}
    per_domain: dict[str, dict[str, Any]] = {}
    versions_served: dict[str, int] = {}
    for r in served:
        versions_served[r.adapter_version or "unknown"] = (
            versions_served.get(r.adapter_version or "unknown", 0) + 1
        )
        loss, gain, how = request_quality(r, table)
        d = per_domain.setdefault(r.domain, {"losses": [], "gains": [], "last": None})
        if loss is None or how is None:
            continue
        via[how] += 1
        losses.append(loss)
        d["losses"].append(loss)
        if gain is not None:
            gains.append(gain)
            d["gains"].append(gain)
        d["last"] = (r.adapter_version, loss, gain)
    by_domain: dict[str, Any] = {}
    for name, d in sorted(per_domain.items()):
        last = d["last"]
        by_domain[name] = {
            "requests_joined": len(d["losses"]),
            "base_loss": table.base_loss(name),
            "mean_served_loss": _mean(d["losses"]),
            "mean_quality_gain": _mean(d["gains"]),
            "last_version": last[0] if last else None,
            "last_served_loss": last[1] if last else None,
            "last_quality_gain": last[2] if last else None,
        }
    finals = [v["last_quality_gain"] for v in by_domain.values() if v["last_quality_gain"] is not None]
    return {
        "available": bool(table.versions or table.base),
        "requests_served": len(served),
        "requests_with_version": sum(1 for r in served if r.adapter_version),
        "requests_joined": len(losses),
        "joined_via": via,
        "mean_served_loss": _mean(losses),
        "mean_quality_gain": _mean(gains),
        "final_quality_gain": _mean(finals),
        "versions_served": dict(sorted(versions_served.items())),
        "by_domain": by_domain,
    }
