"""Federated evaluation: combining replicas' held-out losses and the promotion gate (pure).

Replicas evaluate the candidate and the current version on their own held-out data and send back only
losses with example counts (held-out data never leaves them). Losses are averaged weighted by examples,
per domain and overall. The gate compares candidate and current on the *same* examples: only entries
that report both losses enter the comparison, so a replica that could not score the current version
does not bias it.

The current version is scored while participants train (it does not depend on the round), the candidate
after aggregation; `pair_with_current` joins the two only where a replica scored exactly the same tokens
(equal eval-set digests), and otherwise says that both must be scored together.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class LossEntry:
    replica_id: str
    domain: str
    num_examples: int
    current_loss: float | None
    candidate_loss: float


@dataclass(frozen=True)
class EvalSummary:
    """Example-weighted losses. `before`/`after` are over the paired entries (both losses known)."""

    before: float | None
    after: float | None
    domains_before: dict[str, float] = field(default_factory=dict)
    domains_after: dict[str, float] = field(default_factory=dict)
    num_examples: int = 0
    replicas: tuple[str, ...] = ()


def _wmean(pairs: Iterable[tuple[float, int]]) -> float | None:
    total = n = 0.0
    for loss, count in pairs:
        total += (loss if math.isfinite(loss) else math.inf) * count
        n += count
    return total / n if n > 0 else None


def summarize(entries: Iterable[LossEntry]) -> EvalSummary:
    usable = [e for e in entries if e.num_examples > 0]
    paired = [e for e in usable if e.current_loss is not None]
    domains = sorted({e.domain for e in usable})
    after_by_domain = {
        d: _wmean((e.candidate_loss, e.num_examples) for e in usable if e.domain == d) for d in domains
    }
    before_by_domain = {
        d: _wmean(
            (e.current_loss, e.num_examples) for e in paired if e.domain == d and e.current_loss is not None
        )
        for d in domains
    }
    if paired:
        before = _wmean((e.current_loss, e.num_examples) for e in paired if e.current_loss is not None)
        after = _wmean((e.candidate_loss, e.num_examples) for e in paired)
    else:
        before, after = None, _wmean((e.candidate_loss, e.num_examples) for e in usable)
    return EvalSummary(
        before=before,
        after=after,
        domains_before={d: v for d, v in before_by_domain.items() if v is not None},
        domains_after={d: v for d, v in after_by_domain.items() if v is not None},
        num_examples=sum(e.num_examples for e in usable),
        replicas=tuple(sorted({e.replica_id for e in usable})),
    )


@dataclass(frozen=True)
class ScoredDomain:
    """One replica's loss on one domain, with the digest of the held-out tokens it scored."""

    domain: str
    eval_set: str
    loss: float


def pair_with_current(
    current: Iterable[ScoredDomain], candidate: Iterable[ScoredDomain]
) -> dict[str, float] | None:
    """The current version's loss for each of the candidate's domains, from an earlier scoring by the same
    replica on the same eval set; None when any domain has none (its held-out data changed meanwhile, or
    a digest is unknown): then that replica must score both versions together, so the gate never compares
    losses measured on different examples."""
    by_domain = {c.domain: c for c in current}
    out: dict[str, float] = {}
    for c in candidate:
        cur = by_domain.get(c.domain)
        if cur is None or not c.eval_set or cur.eval_set != c.eval_set:
            return None
        out[c.domain] = cur.loss
    return out


@dataclass(frozen=True)
class GateDecision:
    publish: bool
    reason: str


def promotion_gate(
    before: float | None, after: float | None, tolerance: float, publish_without_eval: bool
) -> GateDecision:
    """Publish only if the candidate's held-out loss is not worse than the current's by > `tolerance`."""
    if after is None:
        if publish_without_eval:
            return GateDecision(True, "no held-out evaluation was available; published by setting")
        return GateDecision(False, "no held-out evaluation was available (no replica reported eval losses)")
    if not math.isfinite(after):
        return GateDecision(False, f"candidate held-out loss is not finite ({after})")
    if before is None:
        return GateDecision(True, f"candidate held-out loss {after:.4f}; no current-version loss to compare")
    if after <= before + tolerance:
        return GateDecision(True, f"held-out loss {before:.4f} -> {after:.4f} (tolerance {tolerance:g})")
    return GateDecision(
        False, f"held-out loss would rise {before:.4f} -> {after:.4f}, more than the tolerance {tolerance:g}"
    )
