"""The round state machine: one federated round from plan to publication, with an injected notion of time.

    opened -> collecting -> aggregating -> evaluating -> published | held_back
         \\-> aborted (from any non-final phase: quorum not reached, adapter moved, failure)

The machine is pure: it never reads a clock (every method takes `now_unix_s`), never touches NATS,
Redis or tensors, and is driven by the service shell, which also replays a round's durable updates into
a fresh machine after a restart. What it decides:

* **Admission** of an arriving update: only from a participant of this round, once, for this adapter,
  trained from the round's base version (or, under the `staleness` late policy, from a base at most
  `max_staleness` versions older, weighted down by `staleness_weight ** gap`). Arrivals after the
  collection closed are *late*: recorded, never aggregated into this round (the shell may carry them
  into the adapter's next round under the `staleness` policy).
* **Closing** the collection: as soon as every participant has been heard from (accepted or rejected),
  or `quorum_grace_s` after the quorum of valid updates was reached, or at the deadline. At close, an
  update whose change from the base is more than `norm_outlier_factor` times the median of the others'
  is rejected (with at least 3 accepted). Fewer valid updates than the quorum aborts the round.
* **Rebasing** (async rounds): a round that opened while an earlier round of its adapter was finishing
  is rebased onto the version that round published (`rebase`): its updates count as that much staler.
* **The gate** (see `evaluation.promotion_gate`) after federated evaluation: published or held back.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal

from collm_aggregator.evaluation import EvalSummary, GateDecision, GateRule, promotion_gate
from collm_aggregator.validation import (
    DUPLICATE,
    NO_SAMPLES,
    NORM_OUTLIER,
    NOT_PARTICIPANT,
    WRONG_ADAPTER,
    WRONG_BASE,
    Rejection,
)


class Phase(StrEnum):
    OPENED = "opened"
    COLLECTING = "collecting"
    AGGREGATING = "aggregating"
    EVALUATING = "evaluating"
    PUBLISHED = "published"
    HELD_BACK = "held_back"
    ABORTED = "aborted"


FINAL = frozenset({Phase.PUBLISHED, Phase.HELD_BACK, Phase.ABORTED})
LatePolicy = Literal["drop", "staleness"]


class PhaseError(RuntimeError):
    """A transition that the current phase does not allow (a bug in the shell, never user input)."""


@dataclass(frozen=True)
class RoundRules:
    quorum: int
    deadline_unix_s: float
    quorum_grace_s: float | None = None
    late_policy: LatePolicy = "drop"
    staleness_weight: float = 0.5
    max_staleness: int = 1
    norm_outlier_factor: float | None = 4.0
    gate: GateRule = GateRule()

    def __post_init__(self) -> None:
        if self.quorum < 1:
            raise ValueError("quorum must be >= 1")
        if not 0 < self.staleness_weight <= 1:
            raise ValueError("staleness_weight must be in (0, 1]")


@dataclass
class Entry:
    """One update as the round sees it."""

    replica_id: str
    base_version: int
    num_samples: int
    arrived_unix_s: float
    staleness: int = 0
    delta_norm: float | None = None
    rejection: Rejection | None = None
    carried_from: int | None = None  # round id, for a late update carried into this round

    def weight(self, staleness_weight: float) -> float:
        return float(self.num_samples) * (staleness_weight**self.staleness)


@dataclass(frozen=True)
class Admitted:
    staleness: int


@dataclass(frozen=True)
class Late:
    reason: str


@dataclass(frozen=True)
class Wait:
    until_unix_s: float


@dataclass(frozen=True)
class Close:
    reason: str


@dataclass(frozen=True)
class Abort:
    reason: str


Decision = Wait | Close | Abort


@dataclass
class RoundMachine:
    round_id: int
    adapter: str
    base_version: int
    participants: tuple[str, ...]
    rules: RoundRules
    opened_unix_s: float
    phase: Phase = Phase.OPENED
    entries: dict[str, Entry] = field(default_factory=dict)
    late: dict[str, float] = field(default_factory=dict)
    refused: list[Entry] = field(default_factory=list)  # duplicates and strangers, kept for the record
    timeline: dict[str, float] = field(default_factory=dict)
    reason: str = ""
    quorum_reached_unix_s: float | None = None
    new_version: int | None = None
    gate: GateDecision | None = None
    rebased_from: int | None = None  # the plan's base version, when the round was rebased (`rebase`)

    def __post_init__(self) -> None:
        if not self.participants:
            raise ValueError("a round needs at least one participant")
        self.participants = tuple(self.participants)
        self.timeline.setdefault(Phase.OPENED.value, self.opened_unix_s)

    # --- views ------------------------------------------------------------------------------------------
    @property
    def final(self) -> bool:
        return self.phase in FINAL

    @property
    def accepted(self) -> list[Entry]:
        return [e for e in self.entries.values() if e.rejection is None]

    @property
    def rejected(self) -> list[Entry]:
        return [e for e in self.entries.values() if e.rejection is not None]

    @property
    def all_rejections(self) -> list[Entry]:
        return self.rejected + self.refused

    @property
    def valid_from_participants(self) -> int:
        return sum(1 for e in self.accepted if e.carried_from is None)

    def weights(self) -> dict[str, float]:
        return {e.replica_id: e.weight(self.rules.staleness_weight) for e in self.accepted}

    def _to(self, phase: Phase, now_unix_s: float, allowed: Sequence[Phase]) -> None:
        if self.phase not in allowed:
            raise PhaseError(f"round {self.round_id}: cannot go from {self.phase} to {phase}")
        self.phase = phase
        self.timeline[phase.value] = now_unix_s

    # --- collecting ---------------------------------------------------------------------------------
    def start_collecting(self, now_unix_s: float) -> None:
        self._to(Phase.COLLECTING, now_unix_s, (Phase.OPENED,))

    def admit(self, replica_id: str, adapter: str, base_version: int) -> Admitted | Late | Rejection:
        """May an update from `replica_id` enter this round? (Validation of its tensors comes after.)"""
        if replica_id not in self.participants:
            return Rejection(NOT_PARTICIPANT, f"{replica_id} is not a participant of round {self.round_id}")
        if self.phase is not Phase.COLLECTING:
            return Late(f"arrived while round {self.round_id} was {self.phase}")
        if replica_id in self.entries:
            return Rejection(DUPLICATE, f"{replica_id} already sent an update for round {self.round_id}")
        if adapter != self.adapter:
            return Rejection(
                WRONG_ADAPTER, f"update is for adapter {adapter!r}, round trains {self.adapter!r}"
            )
        return self._base_check(base_version)

    def _base_check(self, base_version: int) -> Admitted | Rejection:
        gap = self.base_version - base_version
        if gap == 0:
            return Admitted(0)
        if self.rules.late_policy == "staleness" and 0 < gap <= self.rules.max_staleness:
            return Admitted(gap)
        return Rejection(
            WRONG_BASE,
            f"trained from {self.adapter}@v{base_version}; "
            f"round {self.round_id} is based on v{self.base_version}",
        )

    def record(
        self,
        replica_id: str,
        base_version: int,
        num_samples: int,
        now_unix_s: float,
        *,
        staleness: int = 0,
        delta_norm: float | None = None,
        rejection: Rejection | None = None,
    ) -> Entry:
        """Record an admitted participant's update with the outcome of its validation."""
        if self.phase is not Phase.COLLECTING:
            raise PhaseError(f"round {self.round_id} is {self.phase}, not collecting")
        if rejection is None and num_samples <= 0:
            rejection = Rejection(NO_SAMPLES, "the update was trained on 0 samples")
        entry = Entry(replica_id, base_version, num_samples, now_unix_s, staleness, delta_norm, rejection)
        self.entries[replica_id] = entry
        if self.quorum_reached_unix_s is None and self.valid_from_participants >= self.rules.quorum:
            self.quorum_reached_unix_s = now_unix_s
        return entry

    def reject(
        self, replica_id: str, rejection: Rejection, now_unix_s: float, base_version: int = 0
    ) -> Entry:
        """Record a refused arrival (one that `admit` refused, or whose blob could not be read)."""
        entry = Entry(replica_id, base_version, 0, now_unix_s, rejection=rejection)
        if replica_id in self.entries or replica_id not in self.participants:
            # A duplicate or a stranger must not replace a participant's recorded entry.
            self.refused.append(entry)
        else:
            self.entries[replica_id] = entry
        return entry

    def carry(self, entry: Entry) -> Admitted | Rejection:
        """A late update of an earlier round of this adapter, offered under the `staleness` policy."""
        if self.rules.late_policy != "staleness":
            return Rejection(WRONG_BASE, "late updates are dropped (late_policy=drop)")
        if self.phase is not Phase.COLLECTING:
            return Rejection(WRONG_BASE, f"round {self.round_id} is no longer collecting")
        key = f"{entry.replica_id}@r{entry.carried_from}"
        if key in self.entries:
            return Rejection(DUPLICATE, f"{key} was already carried into round {self.round_id}")
        verdict = self._base_check(entry.base_version)
        if isinstance(verdict, Admitted):
            self.entries[key] = Entry(
                key, entry.base_version, entry.num_samples, entry.arrived_unix_s, verdict.staleness,
                entry.delta_norm, entry.rejection, entry.carried_from,
            )  # fmt: skip
        return verdict

    def mark_late(self, replica_id: str, now_unix_s: float) -> None:
        self.late.setdefault(replica_id, now_unix_s)

    def heard_from_all(self) -> bool:
        return all(p in self.entries for p in self.participants)

    def poll(self, now_unix_s: float) -> Decision:
        """What to do now while collecting: wait (until when), close, or abort."""
        if self.phase is not Phase.COLLECTING:
            raise PhaseError(f"round {self.round_id} is {self.phase}, not collecting")
        valid = self.valid_from_participants
        enough = valid >= self.rules.quorum
        if self.heard_from_all():
            if enough:
                return Close("every participant reported")
            return Abort(self._quorum_text(valid, "every participant reported"))
        if now_unix_s >= self.rules.deadline_unix_s:
            return Close("deadline") if enough else Abort(self._quorum_text(valid, "deadline passed"))
        until = self.rules.deadline_unix_s
        if enough and self.rules.quorum_grace_s is not None and self.quorum_reached_unix_s is not None:
            grace_end = self.quorum_reached_unix_s + self.rules.quorum_grace_s
            if now_unix_s >= grace_end:
                return Close("quorum reached and grace period over")
            until = min(until, grace_end)
        return Wait(until)

    def _quorum_text(self, valid: int, when: str) -> str:
        return f"quorum not reached: {valid} valid update(s) of {self.rules.quorum} needed ({when})"

    def close(self, now_unix_s: float) -> list[Entry]:
        """Stop collecting; apply the norm-outlier rule. Returns the updates to aggregate ([] = aborted)."""
        self._to(Phase.AGGREGATING, now_unix_s, (Phase.COLLECTING,))
        self._reject_norm_outliers()
        valid = self.valid_from_participants
        if valid < self.rules.quorum:
            self.abort(self._quorum_text(valid, "after rejecting norm outliers"), now_unix_s)
            return []
        return self.accepted

    def _reject_norm_outliers(self) -> None:
        factor = self.rules.norm_outlier_factor
        norms = {e.replica_id: e.delta_norm for e in self.accepted if e.delta_norm is not None}
        if factor is None or len(norms) < 3:
            return
        for rid, n in norms.items():
            others = [v for k, v in norms.items() if k != rid]
            med = statistics.median(others)
            if med > 0 and n > factor * med:
                self.entries[rid].rejection = Rejection(
                    NORM_OUTLIER, f"change norm {n:.4g} is more than {factor:g}x the others' median {med:.4g}"
                )

    # --- after collection -----------------------------------------------------------------------------
    def rebase(self, version: int) -> None:
        """Aggregate onto `version`, published from this round's base by an earlier round of the adapter
        while this one collected (async rounds): every accepted update is that much staler."""
        if self.phase is not Phase.AGGREGATING:
            raise PhaseError(f"round {self.round_id} is {self.phase}, not aggregating")
        gap = version - self.base_version
        if gap <= 0:
            raise PhaseError(
                f"round {self.round_id}: v{version} is not newer than its base v{self.base_version}"
            )
        for e in self.accepted:
            e.staleness += gap
        if self.rebased_from is None:
            self.rebased_from = self.base_version
        self.base_version = version

    def candidate_ready(self, now_unix_s: float) -> None:
        self._to(Phase.EVALUATING, now_unix_s, (Phase.AGGREGATING,))

    def decide(self, summary: EvalSummary) -> GateDecision:
        if self.phase is not Phase.EVALUATING:
            raise PhaseError(f"round {self.round_id} is {self.phase}, not evaluating")
        self.gate = promotion_gate(summary, self.rules.gate)
        return self.gate

    def published(self, version: int, now_unix_s: float) -> None:
        if self.gate is None or not self.gate.publish:
            raise PhaseError(f"round {self.round_id}: the gate did not allow publication")
        self._to(Phase.PUBLISHED, now_unix_s, (Phase.EVALUATING,))
        self.new_version = version
        self.reason = self.gate.reason

    def held_back(self, now_unix_s: float) -> None:
        if self.gate is None or self.gate.publish:
            raise PhaseError(f"round {self.round_id}: the gate did not hold the candidate back")
        self._to(Phase.HELD_BACK, now_unix_s, (Phase.EVALUATING,))
        self.reason = self.gate.reason

    def abort(self, reason: str, now_unix_s: float) -> None:
        if self.final:
            raise PhaseError(f"round {self.round_id} is already {self.phase}")
        self.phase = Phase.ABORTED
        self.timeline[Phase.ABORTED.value] = now_unix_s
        self.reason = reason
