"""The boundary between the coordinator core (pure decision logic) and whatever drives it.

The service shell (NATS), the cluster simulator and the unit tests all speak to the core through these
plain frozen dataclasses: they hand `TickInputs` to `CoordinatorCore.on_tick(now_s, inputs)` and act on
the `Decisions` it returns. Nothing here imports NATS, Redis, asyncio or pydantic, so the same decisions
are a function of explicit inputs wherever the core runs.

Units are in the names (`_s`, `_ms`, `_per_s`); every time is seconds on the driver's clock (the wall
clock in the service, the virtual clock in the simulator and the tests).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

# --- inputs ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ResidentAdapterView:
    """An adapter version held by a replica (what routing affinity looks at)."""

    name: str
    version: int
    in_flight: int = 0


@dataclass(frozen=True)
class TrainingProgress:
    """A replica's local training job, as its telemetry reports it."""

    adapter: str
    state: str
    round_id: int | None
    tokens_done: int
    token_budget: int
    eval_loss: float | None = None


@dataclass(frozen=True)
class ReplicaObservation:
    """One telemetry snapshot of one replica, as the core sees it.

    `received_s` is when the driver received it on its own clock: liveness is judged on that, never on
    the replica's clock (`ts_s`), so clock skew between machines cannot hide a dead replica.
    `infer_busy_frac`/`train_busy_frac` are the fractions of the last interval the engine spent on
    inference iterations and on training micro-steps, when the replica reports them (the core learns a
    replica's training speed from the latter; the serving load it derives from tokens/s and step costs).
    """

    replica_id: str
    received_s: float
    ts_s: float = 0.0
    interval_s: float = 1.0
    queue_len: int = 0
    running: int = 0
    max_batch: int = 1
    kv_used_frac: float = 0.0
    arrivals_per_s: float = 0.0
    tokens_per_s: float = 0.0
    prefill_tokens_per_s: float = 0.0
    finished: int = 0
    good: int = 0
    good_alone: int | None = None  # of `finished`, good had the replica not trained (None: not measured)
    slo_attainment: float | None = None
    ttft_ms_p99: float | None = None
    tpot_ms_p99: float | None = None
    decode_step_ms: float | None = None
    prefill_ms_per_token: float | None = None
    train_step_ms: float | None = None
    infer_busy_frac: float | None = None
    train_busy_frac: float | None = None
    ft_share: float = 0.0
    ft_tokens_per_s: float = 0.0
    ft_loss: float | None = None
    adapters: tuple[ResidentAdapterView, ...] = ()
    training: tuple[TrainingProgress, ...] = ()
    round_role: str = "idle"
    round_id: int | None = None
    local_samples: int = 0
    domains: tuple[str, ...] = ()


# Round states as the aggregator reports them (`RoundOutcome.state`), plus `open_failed` from the driver.
# Kept open (str) so a state added to the wire schema later does not break the core.
FINAL_ROUND_STATES = ("published", "held_back", "aborted", "open_failed")
# A round in these states has closed its collection: its participants train no more for it.
CLOSED_ROUND_STATES = ("aggregating", "evaluating")


@dataclass(frozen=True)
class RoundEvent:
    """What happened to a round: the aggregator's `RoundOutcome` events, plus `open_failed` when the
    driver could not open a planned round (no aggregator, or it refused)."""

    adapter: str
    state: str
    round_id: int | None = None
    base_version: int | None = None
    new_version: int | None = None
    accepted: tuple[str, ...] = ()
    eval_loss_before: float | None = None
    eval_loss_after: float | None = None
    reason: str = ""


@dataclass(frozen=True)
class AdapterVersionView:
    """The current version of an adapter (from the store) and its held-out loss per domain."""

    adapter: str
    version: int
    losses: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class TickInputs:
    """Everything new since the previous tick. Telemetry snapshots are each handed in once."""

    telemetry: tuple[ReplicaObservation, ...] = ()
    round_events: tuple[RoundEvent, ...] = ()
    adapter_versions: tuple[AdapterVersionView, ...] = ()


# --- outputs ---------------------------------------------------------------------------------------

# Short, stable reason codes (Prometheus label values and `collm status`); `reason` carries the detail.
ReasonCode = Literal[
    "slack",  # share granted (plan or recovering toward it)
    "recovering",  # share rising back toward the plan after a cut
    "burst",  # cluster demand above inference capacity: shares cut at once
    "slo_risk",  # this replica's SLOs are at risk: its share is cut to 0
    "stale",  # no telemetry: routed around, dropped from plans
    "idle",  # not training in any open round
    "serve_only",  # separate: a serving replica
    "train_only",  # separate: a training replica
    "fixed_ratio",  # fixed share 1/(K+1)
    "leftover",  # training fills what inference leaves (replica-local)
]


@dataclass(frozen=True)
class ShareDecision:
    replica_id: str
    share: float
    reason_code: ReasonCode
    reason: str
    # The part of the share the replica trains beyond its requests' slack (`cosched`): the SLO budget the
    # attainment target leaves unspent (collm only; 0: training only in the slack).
    spend: float = 0.0


@dataclass(frozen=True)
class RoutingDecision:
    """Weights per replica (sum 1 over live replicas), and per adapter where affinity matters."""

    weights: Mapping[str, float]
    adapter_weights: Mapping[str, Mapping[str, float]]
    ttl_s: float
    reason: str
    # Whether the gateway should receive these weights (collm: `publish_weights`; they are computed, shown
    # in decisions and status, either way).
    publish: bool = True


@dataclass(frozen=True)
class FastDecision:
    shares: tuple[ShareDecision, ...]
    # None: this policy publishes no weights and the gateway routes least-loaded on its own.
    routing: RoutingDecision | None
    share_ttl_s: float
    reason: str


@dataclass(frozen=True)
class ParticipantBudget:
    replica_id: str
    token_budget: int
    share: float
    expected_gain: float
    reason: str


@dataclass(frozen=True)
class RoundPlanDecision:
    adapter: str
    base_version: int
    participants: tuple[ParticipantBudget, ...]
    quorum: int
    opened_s: float
    deadline_s: float
    learning_rate: float
    expected_gain: float
    reason: str


@dataclass(frozen=True)
class SkippedAdapter:
    adapter: str
    reason: str


@dataclass(frozen=True)
class SlowDecision:
    plans: tuple[RoundPlanDecision, ...]
    skipped: tuple[SkippedAdapter, ...]
    forecast_demand: float
    forecast_arrivals_per_s: float
    virtual_queue: float
    reason: str


@dataclass(frozen=True)
class Diagnostics:
    """For observability only: nothing acts on these."""

    live: tuple[str, ...]
    stale: tuple[str, ...]
    arrivals_per_s: float
    demand: float
    attainment: float | None
    virtual_queue: float
    # The headroom h in [0, 1] (state.ClusterState.headroom): how little a share counts against capacity.
    headroom: float = 0.0
    # The spend (state.ClusterState.spend): the part of a share trained beyond the requests' slack.
    spend: float = 0.0
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class AdapterCreation:
    """Ask `replica_id` (a live holder of the adapter's data) to create `adapter@v1` in the store."""

    adapter: str
    replica_id: str


@dataclass(frozen=True)
class Decisions:
    """What one tick decided. `fast`/`slow` are None when that loop was not due at this tick."""

    now_s: float
    policy: str
    fast: FastDecision | None
    slow: SlowDecision | None
    next_tick_s: float
    diagnostics: Diagnostics
    creates: tuple[AdapterCreation, ...] = ()
