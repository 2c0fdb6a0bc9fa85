"""Every size and setting of one experiment's runs, live or simulated, in one frozen dataclass (pure).

The defaults are the default stack on a 2-core CPU machine: 2 SmolLM2 replicas with math and medical
data, a 60-s slice of the Azure conv trace, the services' round cadences. `tiny_preset` gives the sizes
of a quick check of the whole pipeline with the tiny test model.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from collm_coordinator.core.config import POLICIES
from collm_sim.plugins import REFERENCES

_REPO = Path(__file__).resolve().parents[3]
DEFAULT_DATA_DIR = _REPO.parent / "shared" / "data"
DEFAULT_CALIBRATION = _REPO / "bench" / "calibration" / "smollm2.json"
BASELINES = ("separate", "fixed_ratio", "leftover")
CO_LOCATED = ("fixed_ratio", "leftover")
# What an experiment may run: the coordinator's policies and the reference runs beside them
# (`serving_only`: collm with fine-tuning off, the practical ceiling of what a co-located policy serves).
SERIES = (*POLICIES, *REFERENCES)


@dataclass(frozen=True)
class ExperimentConfig:
    # --- what runs -------------------------------------------------------------------------------------
    model: str = "smollm2"
    replicas: int = 2
    # Domains of the replicas' local data: replica i holds domains[i % len(domains)] (as the simulator
    # assigns them); requests are drawn evenly over them and name the domain's adapter.
    domains: tuple[str, ...] = ("math", "medical")
    traces: tuple[str, ...] = ("conv",)
    traces_dir: Path = DEFAULT_DATA_DIR / "traces"
    # Raw public datasets (shared/data/domains): converted into each replica's local data, and the
    # text of the prompts. `data_dirs` gives ready collm_common.data directories per domain instead.
    domains_dir: Path = DEFAULT_DATA_DIR / "domains"
    data_dirs: Mapping[str, Path] = field(default_factory=dict)
    # Without the trace files: refuse (exit 2), or replay synthetic gamma arrivals (clearly labelled).
    synthetic_fallback: bool = False
    synthetic_burstiness: float = 0.25
    synthetic_input_tokens: int = 256
    synthetic_output_tokens: int = 64
    # --- the replayed slice ----------------------------------------------------------------------------
    trace_start_s: float = 0.0
    duration_s: float = 60.0  # arrivals per run (the slice: N = rate x duration_s trace requests)
    drain_s: float = 30.0  # after the last arrival, running requests get this long, then count as timeouts
    seed: int = 0
    input_scale: float = 0.25
    output_scale: float = 0.25
    max_input_tokens: int | None = None
    max_output_tokens: int | None = 256
    max_context_tokens: int | None = 2048
    # --- SLOs: explicit, or from the calibration (x the unloaded p99-prompt TTFT, x a full-batch step) --
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    slo_ttft_scale: float = 3.0
    slo_tpot_scale: float = 3.0
    calibration: Path | None = DEFAULT_CALIBRATION
    # --- the stack -------------------------------------------------------------------------------------
    torch_threads: int = 1
    slow_interval_s: float = 60.0  # one round plan per adapter this often (and, async, when one closes)
    round_deadline_s: float = 55.0
    rounds: str = "async"  # the coordinator's round mode (COLLM_COORDINATOR_ROUNDS): async or sync
    coordinator_warmup_s: float = 10.0
    # Held-out examples (and tokens per domain) of every evaluation: a job's own before/after/periodic
    # scoring, the aggregator's gate and the base-loss measurement.
    eval_max_examples: int = 8
    eval_max_tokens: int = 1024
    train_examples: int = 300  # local data per replica (converted from the public sets)
    eval_examples: int = 24
    request_timeout_s: float = 120.0
    ready_timeout_s: float = 600.0
    timeline_bin_s: float = 10.0

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError("replicas must be >= 1")
        if not self.domains:
            raise ValueError("at least one domain")
        if not self.traces:
            raise ValueError("at least one trace")
        if not self.duration_s > 0 or self.drain_s < 0:
            raise ValueError("duration_s must be > 0 and drain_s >= 0")
        if not self.round_deadline_s <= self.slow_interval_s:
            raise ValueError("round_deadline_s must be <= slow_interval_s")

    def replica_ids(self) -> list[str]:
        return [f"r{i}" for i in range(self.replicas)]

    def replica_domain(self, replica_id: str) -> str:
        return self.domains[int(replica_id[1:]) % len(self.domains)]

    def replicas_of(self, domain: str) -> list[str]:
        return [r for r in self.replica_ids() if self.replica_domain(r) == domain]

    @property
    def mix(self) -> dict[str, float]:
        return dict.fromkeys(sorted(self.domains), 1.0)


def tiny_preset(cfg: ExperimentConfig) -> ExperimentConfig:
    """A quick check with the tiny test model: short prompts and outputs, short runs, explicit SLOs
    (there is no calibration of the tiny model, so neither a rate search nor the simulator runs)."""
    return replace(
        cfg,
        model="tiny",
        duration_s=20.0,
        drain_s=15.0,
        input_scale=0.05,
        output_scale=0.1,
        max_input_tokens=48,
        max_output_tokens=8,
        max_context_tokens=512,
        slo_ttft_ms=cfg.slo_ttft_ms or 2000.0,
        slo_tpot_ms=cfg.slo_tpot_ms or 500.0,
        calibration=None,
        slow_interval_s=10.0,
        round_deadline_s=8.0,
        coordinator_warmup_s=2.0,
        eval_max_examples=8,
        eval_max_tokens=512,
        train_examples=60,
        eval_examples=8,
        ready_timeout_s=180.0,
        timeline_bin_s=5.0,
    )
