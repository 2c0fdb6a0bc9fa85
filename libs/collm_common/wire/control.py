"""Commands to replicas (`subjects.replica(id, "control")`) and the coordinator's published decisions.

Every control command gets a `ControlReply`. Commands carry a `ttl_s` where a stale value would be
unsafe: a replica that stops hearing from the coordinator falls back to its local default share.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, TypeAdapter

from collm_common.wire.base import WireModel


class SetFineTuneShare(WireModel):
    op: Literal["set_share"] = "set_share"
    share: float = Field(ge=0.0, le=1.0)
    ttl_s: float = Field(10.0, gt=0)
    reason: str = ""
    # The part of the share training takes beyond the requests' slack, at their latency's cost: the SLO
    # budget the coordinator's attainment target leaves unspent (0: training only in the slack).
    spend: float = Field(0.0, ge=0.0, le=1.0)


class StartTraining(WireModel):
    """Start (or restart) the local training job of `adapter`, from `base_version` (None: current)."""

    op: Literal["start_training"] = "start_training"
    adapter: str
    token_budget: int = Field(ge=1)
    learning_rate: float = Field(1e-3, gt=0)
    base_version: int | None = None
    round_id: int | None = None
    deadline_unix_s: float | None = None


class StopTraining(WireModel):
    op: Literal["stop_training"] = "stop_training"
    adapter: str


class PauseTraining(WireModel):
    op: Literal["pause"] = "pause"


class ResumeTraining(WireModel):
    op: Literal["resume"] = "resume"


class PublishNow(WireModel):
    """Publish the live copy of `adapter` into its shadow now (a replica-local refresh)."""

    op: Literal["publish_now"] = "publish_now"
    adapter: str


class SyncAdapter(WireModel):
    """Load (or refresh to the current version of) `adapter` from the store. With `create`, an adapter
    that has no version yet is created first: v1, a LoRA whose B is zero (the base model's behaviour)."""

    op: Literal["sync_adapter"] = "sync_adapter"
    adapter: str
    version: int | None = None
    create: bool = False


ControlCommand = Annotated[
    SetFineTuneShare
    | StartTraining
    | StopTraining
    | PauseTraining
    | ResumeTraining
    | PublishNow
    | SyncAdapter,
    Field(discriminator="op"),
]
CONTROL_COMMAND = TypeAdapter(ControlCommand)
CONTROL_COMMAND.schema_name = "collm.v1.ControlCommand"  # type: ignore[attr-defined]


class ControlReply(WireModel):
    ok: bool
    message: str = ""
    detail: dict[str, str] = Field(default_factory=dict)


class RoutingWeights(WireModel):
    """Fast-loop routing decision: a weight per replica, optionally per adapter (affinity)."""

    ts_unix_s: float
    ttl_s: float
    weights: dict[str, float]
    adapter_weights: dict[str, dict[str, float]] = Field(default_factory=dict)
    policy: str = "collm"


class ReplicaDecision(WireModel):
    replica_id: str
    ft_share: float
    routing_weight: float
    reason: str
    # Additive (v1): a short stable code of the reason (`slack`, `burst`, `slo_risk`, `stale`, ...).
    reason_code: str = ""


class CoordinatorDecisions(WireModel):
    """What the coordinator decided at one tick and why (for `collm status` and metrics)."""

    ts_unix_s: float
    policy: str
    loop: Literal["fast", "slow"]
    replicas: list[ReplicaDecision] = Field(default_factory=list)
    virtual_queue: float | None = None
    note: str = ""


class CoordinatorStatusRequest(WireModel):
    """Ask the coordinator (`subjects.coordinator("status")`) for its last decisions and reasons."""


class PlannedParticipant(WireModel):
    replica_id: str
    token_budget: int
    share: float
    reason: str = ""


class PlannedRound(WireModel):
    """A round the coordinator planned and has not seen finish."""

    adapter: str
    round_id: int | None = None
    state: str
    base_version: int
    deadline_unix_s: float
    expected_gain: float = 0.0
    participants: list[PlannedParticipant] = Field(default_factory=list)
    reason: str = ""


class CoordinatorStatus(WireModel):
    """Reply of the coordinator's `status` endpoint."""

    ts_unix_s: float
    policy: str
    live: list[str] = Field(default_factory=list)
    stale: list[str] = Field(default_factory=list)
    virtual_queue: float = 0.0
    # 0..1: grows while attainment stays above the target; a share counts (1 - h) against capacity.
    headroom: float = 0.0
    # 0..1: the part of a training share the replicas train beyond their requests' slack (SetFineTuneShare).
    spend: float = 0.0
    attainment: float | None = None
    # The attainment target in force: the configured one, or under overload a fraction of `attainable`
    # (the attainment the requests would have had without training meanwhile; None: not measured yet).
    target: float | None = None
    attainable: float | None = None
    demand: float = 0.0
    fast: CoordinatorDecisions | None = None
    slow: CoordinatorDecisions | None = None
    rounds: list[PlannedRound] = Field(default_factory=list)
    routing: RoutingWeights | None = None
    aggregator_available: bool | None = None
    notes: list[str] = Field(default_factory=list)


class SetPolicy(WireModel):
    """Read (`policy=None`) or set the coordinator's policy (`subjects.coordinator("policy")`)."""

    policy: str | None = None


class PolicyReply(WireModel):
    policy: str
    previous: str
    policies: list[str] = Field(default_factory=list)


class ErrorReply(WireModel):
    """Body of an error reply on any request/reply endpoint (the code also travels in headers)."""

    code: int
    type: str
    message: str
    # Additive (v1): the request field at fault, when one is.
    param: str | None = None
    # Additive (v1): the OpenAI error code the gateway sends (e.g. "context_length_exceeded"), when one
    # says more than the status.
    error_code: str | None = None
