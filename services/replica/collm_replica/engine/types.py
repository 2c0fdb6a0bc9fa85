"""The engine's plain types: settings, requests, job events, the telemetry snapshot, refusals, version ids."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from collm_common.lora import AdapterWeights
from collm_common.wire.telemetry import ResidentAdapter, TrainingJobStatus
from collm_replica.engine.scheduler import BatchConfig
from collm_replica.errors import NotResident as NotResident  # re-exported: the engine raises it
from collm_replica.errors import ReplicaError
from collm_replica.sampling import SamplingConfig
from collm_replica.training import JobConfig

BASE = "base"
_VERSION_RE = re.compile(r"^(?P<name>[A-Za-z0-9_-]+)@v(?P<n>\d+)(?:\+(?P<local>[A-Za-z0-9_.-]+))?$")

EventSink = Callable[[Any], None]


def parse_version_id(version_id: str) -> tuple[str, int, str | None]:
    """`medical@v3+r0.2` -> ("medical", 3, "r0.2")."""
    m = _VERSION_RE.match(version_id)
    if not m:
        raise ValueError(f"malformed adapter version id {version_id!r}")
    return m.group("name"), int(m.group("n")), m.group("local")


def eval_dtype(setting: str, device: torch.device, model_dtype: torch.dtype) -> torch.dtype | None:
    """The dtype of evaluation's matrix products when it differs from the model's (None: the model's)."""
    if setting == "bfloat16":
        return None if model_dtype == torch.bfloat16 else torch.bfloat16
    if setting != "auto" or device.type != "cpu" or model_dtype != torch.float32:
        return None
    amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return torch.bfloat16 if amx is not None and amx() else None


# The replica's one error type (collm_replica.errors); `EngineRefusal` is its name in the engine.
EngineRefusal = ReplicaError


@dataclass(frozen=True)
class EngineConfig:
    replica_id: str = "r0"
    max_queue: int = 64
    # Refuse (429) a request whose predicted queue wait exceeds this many times its TTFT SLO (None: off).
    admit_wait_slo_factor: float | None = None
    batch: BatchConfig = field(default_factory=BatchConfig)
    # Share the KV blocks of common prefixes between sequences and keep released ones cached
    # (`engine.prefix_cache`); off: every sequence computes all of its tokens.
    prefix_caching: bool = True
    max_resident_adapters: int = 8
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    lora_max_rank: int = 16
    default_ttft_slo_ms: float = 2000.0
    default_tpot_slo_ms: float = 250.0
    ft_share_default: float = 0.3
    coscheduler: str = "slo"
    fixed_every_iterations: int = 5
    job: JobConfig = field(default_factory=JobConfig)
    slo_window_s: float = 30.0
    round_deadline_margin_s: float = 3.0
    eval_fraction: float = 0.1
    train_guard_frac: float = 0.4  # background work between iterations: at most this share of the TTFT SLO
    train_slack_frac: float = 0.5  # share of the requests' slack that background work may use
    train_spend_stretch_frac: float = 0.1  # a stretch of training beyond the slack: this share of TTFT SLO
    # Background work plans against each request's SLOs less this fraction (a reserve for what the step
    # model cannot see: steps slower than predicted, prompts arriving after the decision).
    train_slo_reserve_frac: float = 0.1
    eval_max_tokens: int | None = 1024  # held-out tokens per domain an evaluation request scores at most
    eval_cache_entries: int = 64  # evaluation results kept (by weights digest and eval set)
    # Precision of the base model's products in evaluation passes: "auto" (bfloat16 on a CPU with AMX,
    # else the model's dtype), "bfloat16", or "float32"/"model" (the model's own dtype).
    eval_matmul_dtype: str = "auto"
    # Inference steps of at most this many tokens multiply with fp16 copies of the weights (0: off;
    # `Executor.enable_small_step_copies`); only where the products are in the model's fp32 on a CPU.
    small_step_f16_rows: int = 0
    refresh_slot_wait_s: float = 60.0  # a local job whose refreshes find no slot this long fails

    @classmethod
    def from_settings(cls, s: Any) -> EngineConfig:
        return cls(
            replica_id=s.replica_id,
            max_queue=s.max_queue,
            admit_wait_slo_factor=s.admit_wait_slo_factor,
            batch=BatchConfig(
                s.max_batch,
                s.max_batch_tokens,
                s.prefill_chunk_tokens,
                s.kv_budget_tokens,
                block_size=s.kv_block_tokens,
                kv_admission=s.kv_admission,
            ),
            prefix_caching=s.prefix_caching,
            max_resident_adapters=s.max_resident_adapters,
            lora_targets=tuple(s.lora_target_modules.split(",")),
            lora_max_rank=s.lora_max_rank,
            default_ttft_slo_ms=s.default_ttft_slo_ms,
            default_tpot_slo_ms=s.default_tpot_slo_ms,
            ft_share_default=s.ft_share_default,
            coscheduler=s.coscheduler,
            fixed_every_iterations=s.fixed_ratio_k,
            job=JobConfig(
                micro_tokens=s.train_micro_tokens,
                batch_tokens=s.train_batch_tokens,
                max_seq_len=s.train_max_seq_len,
                publish_every_steps=s.publish_every_steps,
                eval_max_examples=s.eval_max_examples,
            ),
            slo_window_s=s.slo_window_s,
            round_deadline_margin_s=s.round_deadline_margin_s,
            eval_fraction=s.eval_fraction,
            train_guard_frac=s.ft_guard_frac,
            train_slack_frac=s.ft_slack_frac,
            train_spend_stretch_frac=s.ft_spend_stretch_frac,
            train_slo_reserve_frac=s.ft_slo_reserve_frac,
            eval_max_tokens=s.eval_max_tokens,
            eval_matmul_dtype=s.eval_matmul_dtype,
            small_step_f16_rows=s.small_step_f16_rows,
        )


@dataclass
class EngineRequest:
    request_id: str
    prompt_ids: list[int]
    adapter: str | None = None  # None: the base model
    version_id: str | None = None  # exact version (pinned); None: the adapter's current version
    max_tokens: int = 16
    n: int = 1  # choices, decoded from one prefill of the prompt
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None  # None: none; k: the chosen token's and the k most likely per position
    grammar: str | None = None  # llguidance Lark text every choice's output follows
    grammar_param: str = "response_format"  # the request field the grammar came from (for errors)
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    ttft_slo_ms: float | None = None
    tpot_slo_ms: float | None = None
    deadline_unix_s: float | None = None
    span: Any = None  # an OpenTelemetry span started by the service (context captured at admission)
    # The replica's own work (task-metric generations): served like any request, but left out of the
    # latency window, the arrival statistics and the token counters that the SLO telemetry, the
    # co-scheduler and the coordinator's load model read (it is not serving demand).
    internal: bool = False

    def sampling_config(self, index: int = 0) -> SamplingConfig:
        """Choice `index`'s sampling (a seeded request's choice i draws with seed + i)."""
        return SamplingConfig(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=self.logit_bias,
            seed=None if self.seed is None else self.seed + index,
        )


@dataclass
class JobEvent:
    """Told to the service (from the engine thread) when a job refreshes, finishes or fails."""

    kind: str  # "refresh", "round_update", "done", "failed"
    adapter: str
    status: TrainingJobStatus
    version_id: str | None = None
    weights: AdapterWeights | None = None
    num_samples: int = 0
    num_tokens: int = 0
    round_id: int | None = None
    base_version: int | None = None
    train_loss: float | None = None
    eval_loss_before: float | None = None
    eval_loss_after: float | None = None


@dataclass
class EngineSnapshot:
    """Plain numbers for telemetry and metrics (read from any thread)."""

    queue_len: int
    running: int
    max_batch: int
    kv_used_frac: float
    generated_tokens_total: int
    prefill_tokens_total: int
    arrivals_total: int
    ft_tokens_total: int
    infer_ms_total: float
    train_ms_total: float
    ft_share: float
    ft_share_source: str
    ft_spend: float
    ft_loss: float | None
    training_paused: bool
    latency: dict[str, float | int | None]
    decode_step_ms: float | None
    prefill_ms_per_token: float | None
    train_step_ms: float | None
    jobs: list[TrainingJobStatus]
    adapters: list[ResidentAdapter]
    local_samples: int
    domains: list[str]
    train_limits: dict[str, int] = field(default_factory=dict)
    # The prefix cache (`engine.prefix_cache`): known tokens of the admitted sequences, and of those the
    # tokens taken from the cache instead of computed.
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0
