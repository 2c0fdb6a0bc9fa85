"""What one simulation runs: cluster size, policy, workload, engine and gateway sizes, seed.

Engine and gateway sizes default to the services' own setting defaults (read from `ReplicaSettings`
and `GatewaySettings`), so the simulated replica batches, queues and trains like a real one unless a
run says otherwise; the batch bound is the one the calibrations were measured at (`EngineSpec.max_batch`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields

from collm_aggregator.settings import AggregatorSettings
from collm_gateway.settings import GatewaySettings
from collm_replica.settings import ReplicaSettings
from collm_sim.workload import WorkloadSpec

POLICIES = ("collm", "separate", "fixed_ratio", "leftover")


_R = {name: f.default for name, f in ReplicaSettings.model_fields.items()}
_G = {name: f.default for name, f in GatewaySettings.model_fields.items()}


@dataclass(frozen=True)
class EngineSpec:
    """One replica's engine (ReplicaSettings defaults)."""

    # The batch bound the calibrations' decode tables were measured at (`CostModel.max_batch`, 16: larger
    # batches are extrapolated from them); a replica's own bound (`ReplicaSettings.max_batch`) is larger.
    max_batch: int = 16
    max_batch_tokens: int = _R["max_batch_tokens"]
    prefill_chunk_tokens: int = _R["prefill_chunk_tokens"]
    kv_budget_tokens: int = _R["kv_budget_tokens"]
    kv_block_tokens: int = _R["kv_block_tokens"]
    kv_admission: str = _R["kv_admission"]
    max_queue: int = _R["max_queue"]
    train_micro_tokens: int = _R["train_micro_tokens"]
    train_batch_tokens: int = _R["train_batch_tokens"]
    fixed_every_iterations: int = _R["fixed_ratio_k"]
    ft_share_default: float = _R["ft_share_default"]
    round_deadline_margin_s: float = _R["round_deadline_margin_s"]
    ft_guard_frac: float = _R["ft_guard_frac"]
    ft_spend_stretch_frac: float = _R["ft_spend_stretch_frac"]
    default_ttft_slo_ms: float = _R["default_ttft_slo_ms"]
    default_tpot_slo_ms: float = _R["default_tpot_slo_ms"]
    # Training runs in pieces of about one decoder layer (forward, then backward) plus the LM head: for
    # SmolLM2-135M's 30 layers, 61 pieces per micro-step. A stretch of training ends at a piece boundary:
    # when the next piece would overrun the co-scheduler's budget, or after the piece in progress when a
    # request arrives (the engine's `_news`).
    train_pieces_per_micro_step: int = 61
    slo_window_s: float = _R["slo_window_s"]
    ft_slo_reserve_frac: float = _R["ft_slo_reserve_frac"]
    telemetry_interval_s: float = _R["telemetry_interval_s"]
    ft_slack_frac: float = _R["ft_slack_frac"]
    # Held-out evaluations (the aggregator's gate; a round job evaluates nothing itself): tokens each
    # scores (the replica's cap per evaluation; None: evaluations are not modelled), in batches of
    # `eval_batch_tokens` (the job's evaluation chunk), each batch in `eval_pieces_per_batch` pieces (one
    # per decoder layer and the LM head: 31 for SmolLM2-135M). Costs: the calibration's
    # `eval_fixed_ms` and `eval_ms_per_token` (a calibration without them models none).
    eval_tokens: int | None = _R["eval_max_tokens"]
    eval_batch_tokens: int = 512
    eval_pieces_per_batch: int = 31
    # The batches of one evaluation when known (the live replicas pack whole examples, so their batches
    # hold fewer tokens than `eval_batch_tokens`);
    # None: `eval_tokens` / `eval_batch_tokens`, rounded up.
    eval_batches: int | None = None
    # The simulated replica reports the busy fractions of each interval (the coordinator's best signal).
    report_busy_fractions: bool = True


@dataclass(frozen=True)
class GatewaySpec:
    """Routing and retries (GatewaySettings defaults)."""

    telemetry_stale_s: float = _G["telemetry_stale_s"]
    telemetry_stale_intervals: float = _G["telemetry_stale_intervals"]
    weights_hold_frac: float = _G["weights_hold_frac"]
    adapter_miss_penalty: float = _G["adapter_miss_penalty"]
    max_retries: int = _G["max_retries"]


@dataclass(frozen=True)
class SimConfig:
    replicas: int = 8
    policy: str = "collm"
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    engine: EngineSpec = field(default_factory=EngineSpec)
    # Overrides of `engine`'s fields for one replica (by id, "r0", ...), e.g. {"r0": {"eval_batches": 3}}:
    # what differs between replicas with their data (a domain's held-out examples pack into more batches).
    engine_by_replica: Mapping[str, Mapping[str, object]] = field(default_factory=dict)
    gateway: GatewaySpec = field(default_factory=GatewaySpec)
    # Overrides of the coordinator's CoreConfig knobs (by name), e.g. {"util_cap": 0.8}.
    core: Mapping[str, object] = field(default_factory=dict)
    # None: the co-scheduler of the policy (plugins.COSCHEDULER_FOR_POLICY).
    coscheduler: str | None = None
    # Local training samples each replica holds (its domain is domains[i % len(domains)]).
    samples_per_replica: int = 500
    # Domains (= adapters) of the cluster; None: every domain the calibration has a quality curve for.
    domains: tuple[str, ...] | None = None
    # A waiting request older than this is dropped (the gateway's deadline; counted as a timeout).
    request_timeout_s: float = 60.0
    # Aggregation and publication after a round closes and its evaluators scored the candidate (the
    # evaluations themselves are work on the evaluators when the calibration has their cost).
    publish_delay_s: float = 2.0
    # How long the aggregator waits for an evaluator's report (AggregatorSettings.eval_timeout_s).
    eval_timeout_s: float = 60.0
    # Replicas that score each round's versions at most (the aggregator's setting; None: all).
    eval_max_replicas: int | None = AggregatorSettings.model_fields["eval_max_replicas"].default
    # The aggregator's publish lead (`collm_aggregator.lead`): participants send this long before the
    # round's deadline so that aggregation, the candidate's evaluation and the publication fit in the
    # round; None: measured from the simulated rounds as the aggregator measures it (`publish_lead_
    # initial_s` before any published), at most `publish_lead_max_frac` of the round; 0: none.
    publish_lead_s: float | None = AggregatorSettings.model_fields["publish_lead_s"].default
    publish_lead_initial_s: float = AggregatorSettings.model_fields["publish_lead_initial_s"].default
    publish_lead_max_frac: float = AggregatorSettings.model_fields["publish_lead_max_frac"].default
    # separate: "serving_cluster" (least-loaded over the serving replicas, as its own gateway would) or
    # "weights" (the shared gateway's weighted draw on the coordinator's weights).
    separate_routing: str = "serving_cluster"
    # "gateway": the gateway's rule as shipped; "mask": published weights only exclude replicas (weight 0)
    # and the rest are ranked least-loaded (a what-if, not the shipped gateway).
    router: str = "gateway"
    # Quality past the calibration's last measured point: "log" (fitted curve, up to max_factor x the
    # measured tokens) or "hold" (no gain beyond what was measured); see quality.py.
    quality_extrapolate: str = "log"
    quality_max_factor: float = 100.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}: choose one of {', '.join(POLICIES)}")
        if self.replicas < 1:
            raise ValueError("replicas must be >= 1")
        known = {f.name for f in fields(EngineSpec)}
        for rid, over in self.engine_by_replica.items():
            if unknown := sorted(set(over) - known):
                raise ValueError(f"engine_by_replica[{rid!r}]: no engine setting {', '.join(unknown)}")
        if self.samples_per_replica < 0:
            raise ValueError("samples_per_replica must be >= 0")
        if self.router not in ("gateway", "mask"):
            raise ValueError("router must be 'gateway' or 'mask'")
        if self.separate_routing not in ("serving_cluster", "weights"):
            raise ValueError("separate_routing must be 'serving_cluster' or 'weights'")
        if self.quality_extrapolate not in ("log", "hold") or not self.quality_max_factor >= 1:
            raise ValueError("quality_extrapolate must be 'log' or 'hold' and quality_max_factor >= 1")
        if not self.request_timeout_s > 0 or self.publish_delay_s < 0 or not self.eval_timeout_s > 0:
            raise ValueError("request_timeout_s and eval_timeout_s must be > 0 and publish_delay_s >= 0")
        if (self.publish_lead_s is not None and self.publish_lead_s < 0) or self.publish_lead_initial_s < 0:
            raise ValueError("publish_lead_s and publish_lead_initial_s must be >= 0")
        if not 0 <= self.publish_lead_max_frac <= 1:
            raise ValueError("publish_lead_max_frac must be in [0, 1]")
