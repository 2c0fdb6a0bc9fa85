"""One comparable quality number per adapter version and domain, from scores on fixed sites (pure).

A *site* is one replica's held-out share of one domain, named by the digest of exactly what it scores
(`DomainLoss.eval_set`): a replica scores the same first examples of its share for every version, so two
scores of one site compare like with like. Which sites score a round changes (a replica is down, its
update was refused, the evaluator cap picks others), so the mean over whichever sites answered would mix
example sets from version to version. The ledger keeps each version's scores per site and chains:

    Q(v)[d] = Q(parent)[d] + sum_s t_s * (L_v,s - L_parent,s) / sum_s t_s

over the sites s of domain d that scored both versions in the round that produced v (the pairs the
promotion gate compared; t_s the site's response tokens). The first version an adapter's domain is
scored on anchors the chain at its token-weighted mean over its sites. When every round is scored on
the same sites this is exactly each version's mean loss on that fixed set; when sites come and go, each
link still compares like with like. A domain a round scored on no paired site starts a new anchor at
its candidate's plain mean (`chained` says so in its result).

Task metrics (`task_summary`) are example-weighted means over the sites that generated them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class SiteScore:
    """One version's held-out loss on one site (mean nats per response token)."""

    domain: str
    replica_id: str
    eval_set: str
    loss: float
    tokens: int
    examples: int

    @property
    def key(self) -> str:
        return f"{self.domain}|{self.replica_id}|{self.eval_set}"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> SiteScore:
        return cls(
            str(d["domain"]), str(d["replica_id"]), str(d["eval_set"]), float(d["loss"]),
            int(d["tokens"]), int(d["examples"]),
        )  # fmt: skip


def _weight(s: SiteScore) -> int:
    return s.tokens if s.tokens > 0 else s.examples


def site_mean(sites: Iterable[SiteScore]) -> dict[str, float]:
    """Per domain, the token-weighted mean loss over `sites` (finite losses only)."""
    num: dict[str, float] = {}
    den: dict[str, int] = {}
    for s in sites:
        if math.isfinite(s.loss) and _weight(s) > 0:
            num[s.domain] = num.get(s.domain, 0.0) + s.loss * _weight(s)
            den[s.domain] = den.get(s.domain, 0) + _weight(s)
    return {d: num[d] / den[d] for d in num}


@dataclass(frozen=True)
class Chained:
    """The new version's comparable loss per domain, the parent's (with anchors it lacked), and the
    domains whose chain restarted (no site scored both versions)."""

    quality: dict[str, float]
    parent_quality: dict[str, float]
    restarted: tuple[str, ...]


def chained(
    parent_quality: Mapping[str, float], before: Iterable[SiteScore], after: Iterable[SiteScore]
) -> Chained:
    """Chain the new version's quality onto its parent's (module docstring). `before`: the parent's scores
    on the round's sites; `after`: the new version's."""
    before_by = {s.key: s for s in before if math.isfinite(s.loss)}
    after_list = [s for s in after if math.isfinite(s.loss)]
    parent = dict(parent_quality)
    for d, v in site_mean(before_by.values()).items():
        parent.setdefault(d, v)  # the first scores of a domain anchor its chain
    num: dict[str, float] = {}
    den: dict[str, int] = {}
    for s in after_list:
        b = before_by.get(s.key)
        w = min(_weight(s), _weight(b)) if b is not None else 0
        if b is not None and w > 0:
            num[s.domain] = num.get(s.domain, 0.0) + (s.loss - b.loss) * w
            den[s.domain] = den.get(s.domain, 0) + w
    plain = site_mean(after_list)
    quality: dict[str, float] = {}
    restarted: list[str] = []
    for d in sorted(plain):
        if d in den and d in parent:
            quality[d] = parent[d] + num[d] / den[d]
        else:
            quality[d] = plain[d]
            restarted.append(d)
    return Chained(quality, parent, tuple(restarted))


@dataclass(frozen=True)
class SiteTask:
    """One version's task metric on one site."""

    domain: str
    replica_id: str
    metric: str
    score: float
    examples: int


def task_summary(sites: Iterable[SiteTask]) -> dict[str, dict[str, Any]]:
    """Per domain: the metric, its example-weighted mean score, the examples and sites it covers."""
    acc: dict[str, dict[str, Any]] = {}
    for s in sites:
        if s.examples <= 0 or not math.isfinite(s.score):
            continue
        a = acc.setdefault(s.domain, {"metric": s.metric, "total": 0.0, "examples": 0, "sites": 0})
        a["total"] += s.score * s.examples
        a["examples"] += s.examples
        a["sites"] += 1
    return {
        d: {"metric": a["metric"], "score": a["total"] / a["examples"], "examples": a["examples"],
            "sites": a["sites"]}
        for d, a in sorted(acc.items())
    }  # fmt: skip
