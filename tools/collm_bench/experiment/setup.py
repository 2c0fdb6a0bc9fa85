"""What every policy's run shares: the trace slice, the request plan, the SLOs and the replicas' data.

The real Azure traces are required: a missing file stops the benchmark with one clear line (exit 2)
unless `synthetic_fallback` is set, in which case the slice is synthetic gamma arrivals and every
label says so. The plan of a (trace, rate) is built once, before any stack starts, and replayed
unchanged against every policy (same arrivals, lengths, domains, prompts and SLOs for the same seed).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from collm_common.calibration import Calibration
from collm_common.stats import percentile
from collm_workload.prompts import PromptBuilder, read_domain_dir
from collm_workload.tokens import CharEstimateCounter, HFTokenizerCounter, TokenCounter
from collm_workload.traces import (
    LengthPolicy,
    TraceRequest,
    fit_lengths,
    load_trace,
    resolve_trace,
    trace_label,
)
from collm_workload.workload import ArrivalSpec, ModelMap, PlannedRequest, Slo, plan_requests, request_shapes

from .config import ExperimentConfig
from .rates import calibrated_capacity_rps


class SetupError(Exception):
    """Something the benchmark needs is missing: reported as one line, exit status 2."""


@dataclass(frozen=True)
class TraceSource:
    """One trace to replay: the real file, or the synthetic stand-in for a missing one."""

    name: str
    path: Path | None  # None: synthetic gamma arrivals
    requests: tuple[TraceRequest, ...] = ()

    @property
    def synthetic(self) -> bool:
        return self.path is None

    def label(self, cfg: ExperimentConfig) -> str:
        if self.path is None:
            return f"SYNTHETIC gamma(k={cfg.synthetic_burstiness:g}) (trace {self.name} absent)"
        return trace_label(self.path)


def resolve_sources(cfg: ExperimentConfig) -> list[TraceSource]:
    out = []
    for name in cfg.traces:
        try:
            path = resolve_trace(name, cfg.traces_dir)
        except (FileNotFoundError, ValueError) as exc:
            path = None
            why = str(exc)
        else:
            if not path.is_file():
                path, why = None, f"{path} does not exist"
        if path is None:
            if not cfg.synthetic_fallback:
                raise SetupError(
                    f"trace {name!r} not found ({why}): experiments replay the Azure LLM inference "
                    f"traces from {cfg.traces_dir} (shared/data/traces); pass "
                    "--synthetic-fallback to replay synthetic gamma arrivals instead (labelled as such)"
                )
            out.append(TraceSource(name, None))
        else:
            out.append(TraceSource(name, path, tuple(load_trace(path))))
    return out


def lengths(cfg: ExperimentConfig) -> LengthPolicy:
    return LengthPolicy(
        input_scale=cfg.input_scale,
        output_scale=cfg.output_scale,
        max_input_tokens=cfg.max_input_tokens,
        max_output_tokens=cfg.max_output_tokens,
        max_context_tokens=cfg.max_context_tokens,
    )


def arrival_spec(cfg: ExperimentConfig, source: TraceSource, rate_rps: float) -> ArrivalSpec:
    return ArrivalSpec(
        kind="gamma" if source.synthetic else "trace",
        duration_s=cfg.duration_s,
        rate_rps=rate_rps,
        burstiness=cfg.synthetic_burstiness,
        trace_start_s=cfg.trace_start_s,
        seed=cfg.seed,
    )


def shapes(cfg: ExperimentConfig, source: TraceSource, rate_rps: float) -> list[TraceRequest]:
    """Arrival times and fitted token lengths of the slice at `rate_rps` (what the simulator replays)."""
    return request_shapes(
        arrival_spec(cfg, source, rate_rps),
        list(source.requests) or None,
        lengths(cfg),
        cfg.synthetic_input_tokens,
        cfg.synthetic_output_tokens,
    )


def capacity_rps(cfg: ExperimentConfig, cal: Calibration, source: TraceSource, max_batch: int) -> float:
    """The cluster's capacity estimate (req/s) for the mean lengths of the slice at 200 requests per
    window (at least 1 req/s; `rates.calibrated_capacity_rps`): where the frontier's loads and rate
    searches are placed."""
    probe = shapes(cfg, source, max(1.0, 200 / cfg.duration_s))
    return calibrated_capacity_rps(
        cal,
        max_batch,
        sum(s.input_tokens for s in probe) / len(probe),
        sum(s.output_tokens for s in probe) / len(probe),
        cfg.replicas,
    )


def slo_for(cfg: ExperimentConfig, source: TraceSource, cal: Calibration | None, max_batch: int) -> Slo:
    """Explicit SLOs, else from the unloaded engine (the calibration): TTFT = scale x the prefill time of
    the slice's p99 prompt, TPOT = scale x a full-batch decode step (the simulator sweep's rule)."""
    ttft, tpot = cfg.slo_ttft_ms, cfg.slo_tpot_ms
    if ttft is None or tpot is None:
        if cal is None:
            raise SetupError(
                "SLOs: give --slo-ttft-ms and --slo-tpot-ms, or a calibration file to derive them from"
            )
        # The p99 of the fitted prompt lengths of the (up to) 1000 trace requests from the slice's start:
        # one SLO for every rate, whatever the slice length.
        tail = [r for r in source.requests if r.arrival_s >= cfg.trace_start_s][:1000]
        fitted = fit_lengths(tail, lengths(cfg)) if tail else shapes(cfg, source, 1.0)
        p99_in = int(percentile([s.input_tokens for s in fitted], 99))
        ttft = ttft if ttft is not None else cfg.slo_ttft_scale * cal.cost.prefill_ms(p99_in)
        tpot = tpot if tpot is not None else cfg.slo_tpot_scale * cal.cost.decode_ms(max_batch)
    return Slo(round(float(ttft), 1), round(float(tpot), 1))


def token_counter(model: str) -> TokenCounter:
    """The model's own tokenizer to size prompts (chat template measured), else a chars-per-token estimate."""
    if model == "tiny":
        return CharEstimateCounter()
    return HFTokenizerCounter.load(model)


def prompt_builder(cfg: ExperimentConfig, counter: TokenCounter) -> PromptBuilder:
    corpora = {}
    for d in cfg.domains:
        src = cfg.data_dirs.get(d, cfg.domains_dir / d)
        if not Path(src).is_dir():
            raise SetupError(
                f"domain {d!r}: {src} does not exist (the public datasets live in shared/data/domains; "
                "--data DOMAIN=DIR gives a prepared dataset directory)"
            )
        corpora[d] = read_domain_dir(src, d)
    return PromptBuilder(corpora, counter, chat=True)


def build_plan(
    cfg: ExperimentConfig, source: TraceSource, rate_rps: float, builder: PromptBuilder, slo: Slo
) -> list[PlannedRequest]:
    models = ModelMap({}, "{domain}", None)  # every request names its domain's adapter
    return plan_requests(shapes(cfg, source, rate_rps), cfg.mix, builder, models, slo, None, cfg.seed)


def prepare_data(cfg: ExperimentConfig, dest: Path) -> dict[str, Path]:
    """One local dataset per domain under `dest` (converted once from the public sets, or the given
    directories), shared read-only by every run; `replica_data` copies it per replica and run."""
    from collm_data.__main__ import convert_one
    from collm_data.converters import CONVERTERS, SourceMissing

    out: dict[str, Path] = {}
    for d in cfg.domains:
        if d in cfg.data_dirs:
            out[d] = Path(cfg.data_dirs[d])
            continue
        if d not in CONVERTERS:
            raise SetupError(f"no converter for domain {d!r} (have {', '.join(sorted(CONVERTERS))})")
        target = dest / d
        if not (target / "manifest.json").is_file():
            try:
                convert_one(d, cfg.domains_dir, target, cfg.train_examples, cfg.eval_examples)
            except (SourceMissing, FileNotFoundError) as exc:
                raise SetupError(
                    f"domain {d!r}: cannot build the replicas' local data from {cfg.domains_dir}: {exc}"
                ) from None
        out[d] = target
    return out


def replica_data(cfg: ExperimentConfig, datasets: dict[str, Path], run_dir: Path) -> dict[str, Path]:
    """A private copy of its domain's dataset for every replica of one run (a replica may write its
    `samples/` there; no run sees another's)."""
    out = {}
    for rid in cfg.replica_ids():
        target = run_dir / "data" / rid
        shutil.copytree(datasets[cfg.replica_domain(rid)], target, dirs_exist_ok=True)
        out[rid] = target
    return out
