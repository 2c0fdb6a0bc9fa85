"""A simulation's results: every request's record and the run's summary, as the live benchmark writes
them, beside the simulator's own figures (fine-tuning tokens, rounds, quality, shares, busy time)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from collm_sim.batch import Req
from collm_sim.config import SimConfig
from collm_sim.plugins import COSCHEDULER_FOR_POLICY
from collm_sim.workload import Workload
from collm_workload.goodput import summarize
from collm_workload.records import RequestRecord

if TYPE_CHECKING:
    from collm_sim.cluster import Simulation


@dataclass
class SimResult:
    config: SimConfig
    summary: dict[str, Any]
    sim: dict[str, Any]
    records: list[RequestRecord]

    def as_dict(self) -> dict[str, Any]:
        return {"summary": self.summary, "sim": self.sim}


def request_records(requests: list[Req], workload: Workload) -> list[RequestRecord]:
    """The benchmark's record of every request of the run, as the live load generator writes them."""
    out = []
    slo_ttft, slo_tpot = workload.ttft_slo_ms, workload.tpot_slo_ms
    for r in requests:
        ok = r.status == "ok"
        ttft = (r.t_first - r.arrival_s) * 1e3 if ok and r.t_first is not None else None
        e2e = (r.t_end - r.arrival_s) * 1e3 if ok and r.t_end is not None else None
        status = r.status if r.status in ("ok", "rejected", "timeout") else "error"
        out.append(
            RequestRecord(
                request_id=f"r{r.idx:06d}",
                index=r.idx,
                domain=r.domain,
                model=r.domain,
                status=status,  # type: ignore[arg-type]
                scheduled_s=r.arrival_s,
                sent_s=r.arrival_s,
                first_token_s=r.t_first,
                end_s=r.t_end,
                ttft_ms=ttft,
                e2e_ms=e2e,
                prompt_tokens=r.prompt_len if ok else None,
                completion_tokens=r.generated if ok else None,
                usage_reported=ok,
                target_input_tokens=r.prompt_len,
                max_tokens=r.out_len,
                adapter_version=r.version,
                replica=r.replica,
                served_model=r.domain,
                slo_ttft_ms=slo_ttft,
                slo_tpot_ms=slo_tpot,
            )
        )
    return out


def sim_result(sim: Simulation, wall_s: float) -> SimResult:
    """The run's result: its request records, their summary (the live benchmark's), and the simulator's
    own figures (`SimResult.sim`)."""
    records = sim.records()
    agg, control, replicas = sim.aggregator, sim.control, sim.replicas
    summary = summarize(records, quality=agg.quality_table(), timeline_bin_s=None)
    wl = sim.workload
    counts = np.bincount(wl.domain, minlength=len(sim.domains)) if len(wl) else np.zeros(len(sim.domains))
    weights = counts / counts.sum() if counts.sum() else np.full(len(sim.domains), 1 / len(sim.domains))
    gains = agg.gains()
    gain_mix = float(sum(w * gains[d] for w, d in zip(weights, sim.domains, strict=True)))
    hours = wl.duration_s / 3600.0
    figures = {
        "policy": sim.cfg.policy,
        "replicas": sim.cfg.replicas,
        "coscheduler": sim.cfg.coscheduler or COSCHEDULER_FOR_POLICY[sim.cfg.policy],
        "workload": wl.description,
        "requests": len(wl),
        "offered_rate_rps": len(wl) / wl.duration_s if wl.duration_s else None,
        "sim_time_s": sim.now,
        "wall_s": wall_s,
        "speedup": sim.now / wall_s if wall_s > 0 else None,
        "events": sim.events,
        "iterations": sum(r.iterations_total for r in replicas.values()),
        "ft_tokens": sum(r.ft_tokens_total for r in replicas.values()),
        "ft_tokens_published": agg.published_tokens,
        "ft_tokens_per_s": sum(r.ft_tokens_total for r in replicas.values()) / max(wl.duration_s, 1e-9),
        "rounds": dict(agg.rounds_stats),
        "quality_gain_by_domain": gains,
        "quality_extrapolate": sim.cfg.quality_extrapolate,
        "trained_tokens_by_domain": dict(agg.trained_tokens),
        "tokens_past_measured_by_domain": {
            d: max(0.0, t - sim.quality.measured_tokens(d)) for d, t in agg.trained_tokens.items()
        },
        "quality_gain_mix": gain_mix,
        "quality_gain_per_hour": gain_mix / hours if hours > 0 else None,
        "quality_timeline": [[t, g] for t, g in agg.quality_timeline],
        "mean_total_share": float(np.mean(control.share_samples)) if control.share_samples else 0.0,
        "mean_virtual_queue": float(np.mean(control.z_samples)) if control.z_samples else 0.0,
        "evaluations_modelled": agg.evals_modelled,
        # Replica-seconds holding an active round job (by how each job ended), and their share of
        # all replica-seconds.
        "job_s": {
            why: round(sum(rep.bg.job_s[why] for rep in replicas.values()), 3)
            for why in ("budget", "stop", "replaced")
        },
        "job_time_frac": (
            sum(sum(rep.bg.job_s.values()) for rep in replicas.values()) / (len(replicas) * sim.now)
            if replicas and sim.now > 0
            else 0.0
        ),
        # Of the fast ticks at which a replica has a training share in force, the share at which it
        # holds a round job (None: no share ever).
        "job_time_of_share_frac": (
            control.share_job_ticks / control.share_ticks if control.share_ticks else None
        ),
        "busy_s_by_replica": {
            rid: {k: round(ms / 1e3, 3) for k, ms in rep.busy_ms.items()} for rid, rep in replicas.items()
        },
    }
    return SimResult(sim.cfg, summary, figures, records)
