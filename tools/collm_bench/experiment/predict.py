"""The simulator, given the live run's setup: same replicas and domains, slice, rate, lengths, SLOs, seed,
coordinator cadences and calibration, so its goodput can be set beside the live one.

What is made equal, and how:

* workload: `collm_sim.workload.WorkloadSpec` from the same trace, start, rate, duration, length policy
  and seed, so the simulated requests have the live plan's arrival times, token lengths and domains
  (`tests/unit/bench/test_experiment.py` checks this);
* replicas: replica i holds domain i mod len(domains), as live; engine and gateway sizes are the
  services' setting defaults on both sides;
* evaluations: the live stack's cap on the held-out tokens of every evaluation (`eval_max_tokens`)
  is the simulated evaluation's size (the datasets' held-out examples exceed it);
* policy: the coordinator core with the live coordinator's cadences (`slow_interval_s`,
  `round_deadline_s`, `warmup_s`), the policy's replica co-scheduler, and for `separate` the shared
  gateway's draw on the coordinator's weights (what the live stack does: one gateway for both sides);
* the end of the run: the live load generator stops waiting `drain_s` after the last arrival and
  counts what is still running as timed out; the simulated records get the same cut (`drain_cut`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from collm_common.calibration import Calibration
from collm_workload.goodput import summarize
from collm_workload.records import RequestRecord
from collm_workload.workload import Slo

from .config import ExperimentConfig
from .setup import TraceSource


def drain_cut(records: Sequence[RequestRecord], cut_s: float) -> list[RequestRecord]:
    """Records as a load generator that stops at `cut_s` sees them: completions after it become
    timeouts ending at the cut (pure)."""
    out = []
    for r in records:
        if r.status == "ok" and r.end_s is not None and r.end_s > cut_s:
            r = dataclasses.replace(
                r, status="timeout", end_s=cut_s, error="run ended before it completed (drain cut)"
            )
        out.append(r)
    return out


def workload_spec(
    cfg: ExperimentConfig, source: TraceSource, rate_rps: float, slo: Slo
) -> Any:  # collm_sim.workload.WorkloadSpec
    from collm_sim.workload import WorkloadSpec

    return WorkloadSpec(
        arrivals="gamma" if source.synthetic else "trace",
        trace=None if source.synthetic else str(source.path),
        traces_dir=None,
        rate_rps=rate_rps,
        duration_s=cfg.duration_s,
        burstiness=cfg.synthetic_burstiness,
        trace_start_s=cfg.trace_start_s,
        input_scale=cfg.input_scale,
        output_scale=cfg.output_scale,
        max_input_tokens=cfg.max_input_tokens,
        max_output_tokens=cfg.max_output_tokens,
        max_context_tokens=cfg.max_context_tokens,
        input_tokens=cfg.synthetic_input_tokens,
        output_tokens=cfg.synthetic_output_tokens,
        ttft_slo_ms=slo.ttft_ms,
        tpot_slo_ms=slo.tpot_ms,
        mix=cfg.mix,
        seed=cfg.seed,
    )


def sim_config(
    cfg: ExperimentConfig,
    source: TraceSource,
    rate_rps: float,
    slo: Slo,
    policy: str,
    samples_per_replica: int,
    core: Mapping[str, float] | None = None,
) -> Any:  # collm_sim.config.SimConfig
    """The simulator's configuration of the live run's setup; `core`: the coordinator's knobs set
    otherwise than by default (CoreConfig names; `fixed_ratio_k` also sets the replicas' fixed
    co-scheduler, as COLLM_FIXED_RATIO_K sets every service live)."""
    from collm_sim.config import EngineSpec, SimConfig
    from collm_sim.plugins import series_setup

    coordinator_policy, coscheduler = series_setup(policy)
    engine = EngineSpec(eval_tokens=cfg.eval_max_tokens)
    knobs = dict(core or {})
    if "fixed_ratio_k" in knobs:
        engine = dataclasses.replace(engine, fixed_every_iterations=int(knobs["fixed_ratio_k"]))
    return SimConfig(
        replicas=cfg.replicas,
        policy=coordinator_policy,
        coscheduler=coscheduler,
        workload=workload_spec(cfg, source, rate_rps, slo),
        core={
            "slow_interval_s": cfg.slow_interval_s,
            "round_deadline_s": cfg.round_deadline_s,
            "rounds": cfg.rounds,
            "warmup_s": cfg.coordinator_warmup_s,  # the coordinator's first slow tick
            **knobs,
        },
        samples_per_replica=samples_per_replica,
        domains=tuple(sorted(cfg.domains)),
        request_timeout_s=cfg.request_timeout_s,
        # The live replicas and aggregator score at most this many held-out tokens per evaluation.
        engine=engine,
        separate_routing="weights",
        seed=cfg.seed,
    )


def simulate_run(
    cfg: ExperimentConfig,
    cal: Calibration,
    source: TraceSource,
    rate_rps: float,
    slo: Slo,
    policy: str,
    samples_per_replica: int,
    core: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """One simulated run: the summary (same code as the live one, after the drain cut), the simulator's
    own figures (fine-tuning tokens, rounds, quality model) and its request records after the cut (each
    with the replica that served it), to set beside the live ones request by request. `core`: the
    coordinator's knobs (`sim_config`)."""
    from collm_sim.cluster import Simulation

    simulation = Simulation(sim_config(cfg, source, rate_rps, slo, policy, samples_per_replica, core), cal)
    res = simulation.run()
    last_arrival = max((r.scheduled_s for r in res.records), default=0.0)
    records = drain_cut(res.records, last_arrival + cfg.drain_s)
    summary = summarize(records, quality=simulation.quality_table(), timeline_bin_s=cfg.timeline_bin_s)
    keep = (
        "ft_tokens",
        "ft_tokens_published",
        "rounds",
        "quality_gain_by_domain",
        "quality_gain_mix",
        "trained_tokens_by_domain",
        "job_time_frac",
        "job_time_of_share_frac",
        "quality_timeline",
        "job_s",
        "tokens_past_measured_by_domain",
        "mean_total_share",
        "busy_s_by_replica",
        "evaluations_modelled",
        "wall_s",
    )
    cut_s = last_arrival + cfg.drain_s
    return {
        "policy": policy,
        "rate_rps": rate_rps,
        "summary": summary,
        "records": records,
        "sim": {k: res.sim[k] for k in keep}
        | {
            # What the live replicas' counters can show, (inference s, tokens) each and the fine-tuning
            # tokens: the load generator stops at the cut (`ft_tokens` counts the whole simulated run).
            "inference_by_replica_to_cut": {
                rid: rep.inference_until(cut_s) for rid, rep in simulation.replicas.items()
            },
            "ft_tokens_to_cut": sum(rep.ft_tokens_until(cut_s) for rep in simulation.replicas.values()),
            "cut_s": cut_s,
        },
    }
