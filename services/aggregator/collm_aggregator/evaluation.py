"""Federated evaluation: combining replicas' held-out losses and the promotion gate (pure).

Replicas evaluate the candidate and the current version on their own held-out data and send back only
losses with example counts (held-out data never leaves them). Losses are averaged weighted by examples,
per domain and overall. The gate compares candidate and current on the *same* examples: only entries
that report both losses enter the comparison, so a replica that could not score the current version
does not bias it.

The current version is scored while participants train (it does not depend on the round), the candidate
after aggregation; `pair_with_current` joins the two only where a replica scored exactly the same tokens
(equal eval-set digests), and otherwise says that both must be scored together.

The promotion gate (`promotion_gate`) is a paired test. Replicas report, per held-out example, its
response tokens t_i and the summed loss of each version; `paired_gain` pools every paired example of every
replica and domain into the change of the mean loss per token, D = sum(d_i) / sum(t_i) with
d_i = candidate_i - current_i, and its standard error by the ratio estimator,
SE = sqrt(n / (n - 1) * sum((d_i - D * t_i)^2)) / sum(t_i). A candidate is published only when it is
better by more than the evaluation's noise: when the upper end of the change's confidence interval,
D + z * SE, is at most -min_gain (`GateRule`; defaults and the measurements behind them:
services/aggregator/README.md). A candidate whose loss is higher is never published unless `min_gain` is
set below zero.
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
    # Per example (same order in all three; empty when not reported): response tokens, summed losses.
    example_tokens: tuple[int, ...] = ()
    candidate_examples: tuple[float, ...] = ()
    current_examples: tuple[float, ...] = ()
    tokens: int = 0  # response tokens scored
    eval_set: str = ""  # digest of what was scored (the site: `quality_ledger`)

    @property
    def paired_examples(self) -> bool:
        n = len(self.example_tokens)
        return n > 0 and len(self.candidate_examples) == n and len(self.current_examples) == n


@dataclass(frozen=True)
class PairedGain:
    """The candidate's change of held-out loss against the current version on the same examples: the
    mean per response token (`diff_nats`, negative = better) and its standard error."""

    diff_nats: float
    se_nats: float
    examples: int
    tokens: int


def paired_gain(entries: Iterable[LossEntry]) -> PairedGain | None:
    """Pool every example that both versions scored (module docstring); None with fewer than 2."""
    d: list[float] = []
    t: list[int] = []
    for e in entries:
        if e.paired_examples:
            for cand, cur, n in zip(e.candidate_examples, e.current_examples, e.example_tokens, strict=True):
                if n > 0:
                    d.append(cand - cur)
                    t.append(n)
    n_ex, tokens = len(d), sum(t)
    if n_ex < 2 or tokens <= 0:
        return None
    if not all(math.isfinite(x) for x in d):
        return PairedGain(math.inf, math.inf, n_ex, tokens)
    diff = sum(d) / tokens
    resid = sum((di - diff * ti) ** 2 for di, ti in zip(d, t, strict=True))
    se = math.sqrt(n_ex / (n_ex - 1) * resid) / tokens
    return PairedGain(diff, se, n_ex, tokens)


@dataclass(frozen=True)
class EvalSummary:
    """Example-weighted losses. `before`/`after` are over the paired entries (both losses known)."""

    before: float | None
    after: float | None
    domains_before: dict[str, float] = field(default_factory=dict)
    domains_after: dict[str, float] = field(default_factory=dict)
    num_examples: int = 0
    replicas: tuple[str, ...] = ()
    paired: PairedGain | None = None
    entries: tuple[LossEntry, ...] = ()  # what it summarises (per replica and domain)


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
        paired=paired_gain(usable),
        entries=tuple(usable),
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


@dataclass(frozen=True)
class GateRule:
    """Publish when D + z * SE <= -min_gain_nats (module docstring). Without per-example losses (replicas
    that report none) the change of the summary losses must be <= -min_gain_nats."""

    min_gain_nats: float = 0.001
    z: float = 2.0
    publish_without_eval: bool = False


def promotion_gate(summary: EvalSummary, rule: GateRule) -> GateDecision:
    """Publish only a candidate that is better than the current version by more than the evaluation's
    noise (`GateRule`); hold back anything else."""
    before, after = summary.before, summary.after
    if after is None:
        if rule.publish_without_eval:
            return GateDecision(True, "no held-out evaluation was available; published by setting")
        return GateDecision(False, "no held-out evaluation was available (no replica reported eval losses)")
    if not math.isfinite(after):
        return GateDecision(False, f"candidate held-out loss is not finite ({after})")
    if before is None:
        return GateDecision(True, f"candidate held-out loss {after:.4f}; no current-version loss to compare")
    p = summary.paired
    losses = f"held-out loss {before:.4f} -> {after:.4f}"
    if p is None:
        diff = after - before
        ok = diff <= -rule.min_gain_nats
        test = f"change {diff:+.4f} nats/token (no per-example losses), needs <= {-rule.min_gain_nats:+.4f}"
    else:
        bound = p.diff_nats + rule.z * p.se_nats
        ok = bound <= -rule.min_gain_nats
        test = (
            f"paired change {p.diff_nats:+.4f} +- {p.se_nats:.4f} nats/token over {p.examples} examples, "
            f"change + {rule.z:g} SE = {bound:+.4f}, needs <= {-rule.min_gain_nats:+.4f}"
        )
    return GateDecision(ok, f"{losses}: {test}")
