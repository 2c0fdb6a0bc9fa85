"""Federated rounds: plans, local updates and round outcomes.

A round is planned by the coordinator and run by the aggregator: `RoundPlan` -> participants train and
send `LocalUpdate`s (JetStream, `subjects.update(round, replica)`) -> the aggregator publishes
`RoundOutcome` events on `subjects.round_event(round, event)`. Updates carry a reference to a blob in
the adapter store, never the tensors (NATS payloads stay small).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from collm_common.wire.base import WireModel


class ParticipantPlan(WireModel):
    replica_id: str
    token_budget: int = Field(ge=1)
    learning_rate: float = Field(1e-3, gt=0)


class RoundPlan(WireModel):
    """Sent by the coordinator to `subjects.aggregator("open_round")`; `round_id=0` lets the aggregator
    assign the next id (the reply is a `RoundOutcome` with state "opened")."""

    round_id: int = Field(0, ge=0)
    adapter: str
    base_version: int = Field(ge=1)
    participants: list[ParticipantPlan] = Field(min_length=1)
    quorum: int = Field(ge=1)
    opened_unix_s: float
    deadline_unix_s: float
    policy: str = "collm"
    reason: str = ""


class LocalUpdate(WireModel):
    round_id: int
    adapter: str
    replica_id: str
    base_version: int
    # Store reference of the trained LoRA weights (safetensors blob) and its sha256.
    blob_key: str
    sha256: str
    num_samples: int = Field(ge=0)
    num_tokens: int = Field(ge=0)
    train_loss: float | None = None
    # Held-out losses the sender measured itself (None: not measured; round jobs leave that to the gate).
    eval_loss_before: float | None = None
    eval_loss_after: float | None = None
    created_unix_s: float = 0.0


class RejectedUpdate(WireModel):
    replica_id: str
    reason: str
    # Stable label of the reason (`collm_aggregator.validation` codes: not_finite, wrong_base_version, ...).
    code: str = ""


RoundState = Literal["opened", "collecting", "aggregating", "evaluating", "published", "held_back", "aborted"]


class RoundOutcome(WireModel):
    round_id: int
    adapter: str
    state: RoundState
    base_version: int
    new_version: int | None = None
    accepted: list[str] = Field(default_factory=list)
    rejected: list[RejectedUpdate] = Field(default_factory=list)
    late: list[str] = Field(default_factory=list)
    eval_loss_before: float | None = None
    eval_loss_after: float | None = None
    strategy: str = ""
    reason: str = ""
    ts_unix_s: float = 0.0
    # Additive (v1): the plan's participants, held-out losses per domain (example-weighted, before =
    # current version, after = candidate), when each phase began, and the round's trace id.
    participants: list[str] = Field(default_factory=list)
    domain_losses_before: dict[str, float] = Field(default_factory=dict)
    domain_losses_after: dict[str, float] = Field(default_factory=dict)
    timeline: dict[str, float] = Field(default_factory=dict)
    deadline_unix_s: float | None = None
    trace_id: str | None = None
    policy: str = ""
    # Additive (v1): the promotion gate's paired test (collm_aggregator.evaluation.paired_gain): the
    # candidate's change of held-out loss per response token on the same examples, and its standard error.
    gain_diff_nats: float | None = None
    gain_se_nats: float | None = None
    gain_examples: int = 0
    # Additive (v1): the published version's comparable held-out loss per domain (chained over the same
    # sites from the adapter's first scored version: the store's quality record).
    new_version_quality: dict[str, float] = Field(default_factory=dict)


class EvaluateCandidate(WireModel):
    """Ask a replica (`subjects.replica(id, "evaluate")`) for the held-out loss of a candidate adapter.

    Evaluation is federated like training: held-out data never leaves the replica, only losses do.
    `candidate_key`/`candidate_sha256` reference a blob in the store (an update or an aggregate);
    `current_version` is evaluated beside it (None: the base model) so the gate compares like with like.
    """

    adapter: str
    candidate_key: str
    candidate_sha256: str
    current_version: int | None = None
    round_id: int | None = None
    max_examples: int = Field(64, ge=1)
    # Additive (v1). `score_current=False`: score the candidate only (the aggregator scored the current
    # version earlier in the round, while participants trained; it pairs the two by `DomainLoss.eval_set`).
    score_current: bool = True
    # When set, the candidate is the stored version `adapter@v{candidate_version}` (key/sha256 are then
    # ignored and may be empty): how the current version is scored on its own, at a round's opening.
    candidate_version: int | None = Field(None, ge=1)
    # At most this many held-out tokens per domain (None: the replica's own bound only).
    max_tokens: int | None = Field(None, ge=1)
    # Additive (v1). When the requester stops waiting (unix s; None: no deadline): a loaded replica paces
    # the evaluation to finish before it instead of scoring only in its slack.
    deadline_unix_s: float | None = None
    # Additive (v1). With a stored `candidate_version`: also generate greedy answers to the first this many
    # held-out examples of each domain that has a task metric, and score them (`DomainLoss.task_score`).
    task_examples: int = Field(0, ge=0, le=64)


class DomainLoss(WireModel):
    domain: str
    num_examples: int
    num_tokens: int
    current_loss: float | None
    candidate_loss: float
    # Additive (v1): digest of exactly the held-out tokens scored (example ids, tokens, labels); two losses
    # are comparable only when their eval sets are equal ("" : unknown, an older replica).
    eval_set: str = ""
    # Additive (v1): per example of the eval set, in the order of their ids, its response tokens and the
    # summed loss (nats) of the candidate and (when scored) of the current version: the promotion gate's
    # paired test (`collm_aggregator.evaluation.paired_gain`). Empty: not reported (an older replica).
    example_tokens: list[int] = Field(default_factory=list)
    candidate_example_loss: list[float] = Field(default_factory=list)
    current_example_loss: list[float] = Field(default_factory=list)
    # Additive (v1), when `EvaluateCandidate.task_examples` asked for it and the domain has a task metric:
    # its name, the candidate's mean score in [0, 1] and the examples it was generated on.
    task_metric: str = ""
    task_score: float | None = None
    task_examples: int = 0


class EvalReport(WireModel):
    replica_id: str
    adapter: str
    losses: list[DomainLoss] = Field(default_factory=list)
