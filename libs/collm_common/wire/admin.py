"""Aggregator admin endpoints (`subjects.aggregator(verb)`): status, round records, rollback, import.

Every request gets either its reply type or an error reply (`ErrorReply`, code in the headers):
400 bad request, 403 an import path outside the import roots or not readable, 404 unknown
adapter/version/round or an import path that names nothing, 409 conflict (a concurrent publication; an
import whose LoRA spec or base model differs from the adapter's), 422 an adapter that cannot be imported
(with the reason), 500 otherwise.

| verb       | request            | reply              |
|------------|--------------------|--------------------|
| open_round | rounds.RoundPlan   | rounds.RoundOutcome (state "opened", or "aborted" with the reason) |
| status     | StatusRequest      | AggregatorStatus   |
| rounds     | ListRounds         | RoundList          |
| round      | GetRound           | RoundDetail        |
| rollback   | RollbackAdapter    | AdapterVersionInfo |
| import     | ImportAdapter      | AdapterVersionInfo |
"""

from __future__ import annotations

from pydantic import Field

from collm_common.wire.base import WireModel
from collm_common.wire.rounds import EvalReport, LocalUpdate, RoundOutcome, RoundPlan


class StatusRequest(WireModel):
    pass


class ActiveRound(WireModel):
    round_id: int
    adapter: str
    state: str
    base_version: int
    participants: list[str] = Field(default_factory=list)
    received: list[str] = Field(default_factory=list)
    quorum: int = 1
    deadline_unix_s: float = 0.0
    policy: str = ""


class AggregatorStatus(WireModel):
    instance_id: str
    started_unix_s: float
    strategy: str
    late_policy: str
    default_plan: bool
    last_coordinator_plan_unix_s: float | None = None
    active: list[ActiveRound] = Field(default_factory=list)
    last_round_id: int = 0
    rounds_by_state: dict[str, int] = Field(default_factory=dict)


class ListRounds(WireModel):
    adapter: str | None = None
    state: str | None = None
    limit: int = Field(20, ge=1, le=1000)


class RoundList(WireModel):
    rounds: list[RoundOutcome] = Field(default_factory=list)


class GetRound(WireModel):
    round_id: int = Field(ge=1)


class UpdateRecord(WireModel):
    """A local update as the aggregator recorded it (before its validation verdict)."""

    update: LocalUpdate
    received_unix_s: float
    size_bytes: int = 0
    late: bool = False


class RoundDetail(WireModel):
    plan: RoundPlan
    outcome: RoundOutcome
    updates: list[UpdateRecord] = Field(default_factory=list)
    evals: list[EvalReport] = Field(default_factory=list)
    candidate_key: str | None = None
    candidate_sha256: str | None = None


class RollbackAdapter(WireModel):
    """Republish the content of `adapter@v{to_version}` as a new version (the pointer never rewinds)."""

    adapter: str
    to_version: int = Field(ge=1)
    reason: str = ""


class ImportAdapter(WireModel):
    """Import a PEFT adapter directory (`adapter_config.json` + `adapter_model.safetensors`) readable by
    the aggregator as a new adapter, or as a new version of an existing one (same LoRA spec and tensors).
    `base_model`, when given, must match the adapter's `base_model_name_or_path` (and an existing
    adapter's base model); it is also recorded as the version's base model."""

    adapter: str
    path: str
    base_model: str | None = None
    domains: list[str] | None = None


class AdapterVersionInfo(WireModel):
    name: str
    version: int
    version_id: str
    sha256: str
    size_bytes: int
    base_model: str
    source: str
    parent: int | None = None
    round_id: int | None = None
    created_unix_s: float = 0.0
