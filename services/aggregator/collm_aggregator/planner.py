"""The built-in round plan (pure): used until the coordinator plans rounds, and whenever it falls silent.

Every `period_s`, for each adapter it plans: every replica that reported telemetry recently, holds local
training samples and covers one of the adapter's domains (an adapter with no domains takes every replica
with data) trains with the same token budget and learning rate until `now + deadline_s`; the quorum is
`ceil(quorum_fraction * participants)`. An adapter with a round still running, or with no current
version in the store yet (replicas create v1 themselves), is skipped with a reason.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ReplicaView:
    """What the planner needs from a replica's latest telemetry."""

    replica_id: str
    seen_unix_s: float
    local_samples: int
    domains: tuple[str, ...] = ()


@dataclass(frozen=True)
class PlanDraft:
    adapter: str
    base_version: int
    participants: tuple[str, ...]
    quorum: int
    token_budget: int
    learning_rate: float
    opened_unix_s: float
    deadline_unix_s: float
    reason: str


@dataclass(frozen=True)
class Skip:
    adapter: str
    reason: str


@dataclass(frozen=True)
class PlanConfig:
    token_budget: int
    learning_rate: float
    deadline_s: float
    quorum_fraction: float
    telemetry_stale_s: float
    min_participants: int = 1
    adapters: Mapping[str, Sequence[str]] = field(default_factory=dict)


def eligible(
    replicas: Sequence[ReplicaView], domains: Sequence[str], now_unix_s: float, stale_s: float
) -> list[str]:
    wanted = set(domains)
    out = []
    for r in replicas:
        if now_unix_s - r.seen_unix_s > stale_s or r.local_samples <= 0:
            continue
        if wanted and not wanted.intersection(r.domains):
            continue
        out.append(r.replica_id)
    return sorted(out)


def choose_evaluators(
    participants: Sequence[str],
    holders: Sequence[str],
    max_evaluators: int | None,
    exclude: Collection[str] = (),
) -> list[str]:
    """The replicas that score a round's versions for the promotion gate: the replicas holding the
    domain's data (its participants among them), none of `exclude` (a participant whose update the round
    refused), at most `max_evaluators` (None: all), the first in name order whoever trained: the same
    replicas, so the same held-out sites, judge successive rounds, each reusing its score of the version it
    judged as the next round's current one, and a version's quality is measured where its parent's was
    (`quality_ledger`). Every evaluation scores up to `eval_max_tokens` held-out tokens on its replica
    while that replica serves, so the cap keeps the gate's work per round fixed as the cluster grows
    instead of growing with every holder."""
    ordered = sorted((set(participants) | set(holders)) - set(exclude))
    return ordered if max_evaluators is None else ordered[: max(1, max_evaluators)]


def quorum_for(n: int, fraction: float) -> int:
    return max(1, min(n, math.ceil(fraction * n - 1e-9)))


def default_plans(
    replicas: Sequence[ReplicaView],
    adapter_domains: Mapping[str, Sequence[str]],
    current_versions: Mapping[str, int | None],
    busy: set[str],
    cfg: PlanConfig,
    now_unix_s: float,
) -> list[PlanDraft | Skip]:
    """One draft (or the reason for none) per adapter, in name order."""
    out: list[PlanDraft | Skip] = []
    for adapter in sorted(adapter_domains):
        domains = adapter_domains[adapter]
        if adapter in busy:
            out.append(Skip(adapter, "a round of this adapter is still running"))
            continue
        version = current_versions.get(adapter)
        if version is None:
            out.append(Skip(adapter, f"adapter {adapter!r} has no current version yet (replicas create v1)"))
            continue
        who = eligible(replicas, domains, now_unix_s, cfg.telemetry_stale_s)
        if len(who) < cfg.min_participants:
            scope = f"domains {sorted(domains)}" if domains else "any domain"
            out.append(
                Skip(
                    adapter, f"{len(who)} replica(s) with local data for {scope}; need {cfg.min_participants}"
                )
            )
            continue
        out.append(
            PlanDraft(
                adapter=adapter,
                base_version=version,
                participants=tuple(who),
                quorum=quorum_for(len(who), cfg.quorum_fraction),
                token_budget=cfg.token_budget,
                learning_rate=cfg.learning_rate,
                opened_unix_s=now_unix_s,
                deadline_unix_s=now_unix_s + cfg.deadline_s,
                reason="built-in plan: every replica with local data, fixed budget and period",
            )
        )
    return out
