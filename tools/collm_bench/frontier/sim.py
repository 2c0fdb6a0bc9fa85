"""The simulated frontier: every policy x knob of the grid in the simulator, on the experiment's setup.

Each point is `collm_bench.experiment.predict.simulate_run` (the coordinator, gateway routing and replica
co-schedulers' own code) with the experiment's setup at `replicas` and a `window_s` slice of the trace,
at one offered rate for every point: `--rate`; else, with `--alone-attainment A`, the rate at which the
simulator says serving alone attains A (`alone_rate`); else `load` x the cluster's capacity estimate from
the calibration (`experiment.setup.capacity_rps`). SLOs, lengths, domains and cadences are the
experiment's (`ExperimentConfig`). Points run in `jobs` processes at once.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from collm_bench.experiment import setup
from collm_bench.experiment.config import ExperimentConfig
from collm_common.calibration import Calibration
from collm_workload.workload import Slo

from .curves import with_default_curves
from .points import SERVING_ALONE, Knob, Point, quality_curve, rate_for_attainment
from .progress import Kept, Progress, kept_from, probe_key

SCHEMA = "collm-frontier/1"


def max_batch() -> int:
    """The batch the capacity estimate and the SLO rule assume: the one the calibrations' decode tables
    were measured at and the simulated replica runs (`collm_sim.config.EngineSpec.max_batch`)."""
    from collm_sim.config import EngineSpec

    return EngineSpec().max_batch


def point_of(knob: Knob, summary: dict[str, Any], finetune_tokens: float) -> Point:
    """A point from a run's collm-bench summary (live or simulated) and its fine-tuning tokens."""
    return Point(
        policy=knob.policy,
        knob=knob.label,
        slo_attainment=summary["attainment"],
        goodput_rps=summary["goodput_rps"],
        finetune_tokens=finetune_tokens,
        quality_gain_nats=(summary.get("quality") or {}).get("mean_quality_gain"),
        n_requests=summary["counts"]["submitted"],
        core=dict(knob.core),
    )


def run_point(
    cfg: ExperimentConfig, cal: Calibration, rate_rps: float, slo: Slo, knob: Knob
) -> dict[str, Any]:
    """One simulated point: the point and the run's other figures (one process; picklable in and out)."""
    import torch

    torch.set_num_threads(1)
    from collm_bench.experiment.predict import simulate_run

    (source,) = setup.resolve_sources(cfg)
    t0 = time.monotonic()
    run = simulate_run(cfg, cal, source, rate_rps, slo, knob.policy, cfg.train_examples, core=knob.core)
    q = run["summary"].get("quality") or {}
    return {
        "point": point_of(knob, run["summary"], run["sim"]["ft_tokens_to_cut"]).as_dict(),
        "quality_gain_end_nats": q.get("final_quality_gain"),
        "rounds": run["sim"]["rounds"],
        "quality_curve": quality_curve(run["sim"]["quality_timeline"], cfg.domains),
        # Replica-seconds holding a round's training job, of all replica-seconds.
        "job_time_frac": round(run["sim"]["job_time_frac"], 4),
        # Of the replica-time with a training share in force, the part holding a job (fast-tick samples).
        "job_time_of_share_frac": (
            None if (f := run["sim"]["job_time_of_share_frac"]) is None else round(f, 4)
        ),
        "wall_s": round(time.monotonic() - t0, 1),
    }


def alone_rate(
    cfg: ExperimentConfig,
    cal: Calibration,
    slo: Slo,
    cap: float,
    target: float,
    window_of: Callable[[float], float],
    say: Callable[[str], None],
    known: Mapping[str, float] | None = None,
    on_probe: Callable[[float, float], None] | None = None,
) -> tuple[float, str]:
    """The offered rate at which the simulator says serving alone attains `target` on this setup
    (`points.rate_for_attainment` over fractions of the capacity estimate `cap`, each tried on a window
    of `window_of(rate)` seconds), and how it was had. A trace whose bursts or long prompts the capacity
    estimate (mean lengths) does not see gets a rate its SLOs can be met at. `known`: attainments an
    earlier run of the same plan measured, by `progress.probe_key` (not simulated again); `on_probe`
    sees every (fraction, attainment) tried."""
    knob = Knob(SERVING_ALONE, "fine-tuning off")
    known = known or {}

    def attains(frac: float) -> float:
        rate = frac * cap
        kept = known.get(probe_key(frac))
        if kept is None:
            run = run_point(dataclasses.replace(cfg, duration_s=window_of(rate)), cal, rate, slo, knob)
            a = float(run["point"]["slo_attainment"] or 0.0)
        else:
            a = kept
        how = " (kept)" if kept is not None else ""
        say(
            f"  serving alone at {frac:.4f} x the capacity estimate ({rate:.4f} req/s): attainment {a:.3f}"
            + how
        )
        if on_probe is not None:
            on_probe(frac, a)
        return a

    frac, tried = rate_for_attainment(attains, target)
    how = (
        f"serving alone attains >= {target:g} in the simulator at {frac:.4f} x the capacity estimate "
        f"{cap:.3f} req/s ({len(tried)} simulated runs)"
    )
    return frac * cap, how


def simulate_grid(
    cfg: ExperimentConfig,
    cal: Calibration,
    rate_rps: float,
    slo: Slo,
    knobs: Sequence[Knob],
    jobs: int,
    on_done: Callable[[dict[str, Any]], None],
) -> list[dict[str, Any]]:
    """Every knob's point, in `jobs` processes (1: in this one); `on_done` sees each as it finishes."""
    out: list[dict[str, Any]] = []
    if jobs <= 1:
        for k in knobs:
            out.append(run_point(cfg, cal, rate_rps, slo, k))
            on_done(out[-1])
        return out
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(run_point, cfg, cal, rate_rps, slo, k) for k in knobs]
        for f in futures:
            out.append(f.result())
            on_done(out[-1])
    return out


def usable_jobs(asked: int | None) -> int:
    """Processes to run points in: as asked, else one per core, at most two on a small machine."""
    if asked is not None:
        if asked < 1:
            raise ValueError("--jobs must be >= 1")
        return asked
    return max(1, min(2, os.cpu_count() or 1))


def plan_config(cfg: ExperimentConfig, slo: Slo, defaulted: Sequence[str], jobs: int) -> dict[str, Any]:
    """The result file's configuration entries known before the rate is (`progress.SIM_PLAN` among
    them)."""
    return {
        "replicas": cfg.replicas,
        "window_s": cfg.duration_s,
        "drain_s": cfg.drain_s,
        "rounds": cfg.rounds,
        "round_deadline_s": cfg.round_deadline_s,
        "slo": dataclasses.asdict(slo),
        "domains": list(cfg.domains),
        "default_quality_curves": list(defaulted),
        "input_scale": cfg.input_scale,
        "output_scale": cfg.output_scale,
        "seed": cfg.seed,
        "calibration": str(cfg.calibration),
        "jobs": jobs,
    }


def _kept(
    prior: Mapping[str, Any] | None,
    trace: str,
    config: Mapping[str, Any],
    knobs: Sequence[Knob],
    say: Callable[[str], None],
) -> Kept:
    """What `prior` lends this run (`progress.kept_from`; nothing without one), said."""
    if prior is None:
        return Kept()
    kept = kept_from(prior, trace, config, knobs)
    say(f"kept {len(kept.probes)} rate-search runs and {len(kept.runs)} of {len(knobs)} points")
    return kept


def sim_frontier(
    cfg: ExperimentConfig,
    knobs: Sequence[Knob],
    load: float,
    rate_rps: float | None,
    jobs: int,
    say: Callable[[str], None],
    alone: float | None = None,
    partial: Path | None = None,
    prior: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The whole simulated frontier (the result file's content, less goals and frontiers). The rate:
    `rate_rps`, else the one where serving alone attains `alone` (`alone_rate`), else `load` x the
    capacity estimate. The work done is kept in `partial` as it is done (`progress.Progress`); `prior`
    (such a file, or an earlier result file of the same plan) lends its probes and points
    (`progress.kept_from`)."""
    if cfg.calibration is None or not Path(cfg.calibration).is_file():
        raise setup.SetupError(f"the simulated frontier needs a calibration (got {cfg.calibration})")
    cal, defaulted = with_default_curves(Calibration.load(cfg.calibration), cfg.domains)
    (source,) = setup.resolve_sources(cfg)
    slo = setup.slo_for(cfg, source, cal, max_batch())
    cap = setup.capacity_rps(cfg, cal, source, max_batch())
    trace = {"name": source.name, "label": source.label(cfg), "path": str(source.path)}
    config = plan_config(cfg, slo, defaulted, jobs)
    kept = _kept(prior, source.name, config, knobs, say)
    progress = Progress(partial, trace, config)
    rate, how = (
        (rate_rps, "given") if rate_rps is not None else (load * cap, f"{load:g} x the capacity estimate")
    )
    if rate_rps is None and alone is not None:
        rate, how = alone_rate(
            cfg, cal, slo, cap, alone, lambda _r: cfg.duration_s, say, kept.probes, progress.probe
        )
    config |= {
        "rate_rps": rate,
        "rate_from": how,
        "load_of_capacity": rate / cap,
        "capacity_estimate_rps": cap,
    }
    n = round(rate * cfg.duration_s)
    kept_runs = kept.runs_at(rate)
    if kept.runs and not kept_runs:
        say(f"the kept points ran at {kept.rate_rps} req/s, this run at {rate}: none kept")
    todo = [k for k in knobs if (k.policy, k.label) not in kept_runs]
    say(
        f"{source.label(cfg)}, {cfg.replicas} replicas, {cfg.duration_s:g} s windows: {rate:.3f} req/s "
        f"({how}; {n} requests; capacity estimate {cap:.3f} req/s), SLO TTFT {slo.ttft_ms:.0f} ms / TPOT "
        f"{slo.tpot_ms:.0f} ms; {len(todo)} points in {jobs} process(es)"
    )
    if defaulted:
        say(f"no calibrated quality curve for {', '.join(defaulted)}: the default curve (frontier.curves)")
    t0 = time.monotonic()
    for r in kept_runs.values():
        progress.point(r)

    def done(r: dict[str, Any]) -> None:
        p = r["point"]
        say(
            f"  {p['policy']:<12} {p['knob']:<22} attainment {p['slo_attainment'] or 0:.3f}  goodput "
            f"{p['goodput_rps'] or 0:.3f} req/s  ft tokens {p['finetune_tokens'] or 0:.0f}  quality gain "
            f"{p['quality_gain_nats'] or 0:.4f}  ({r['wall_s']:.0f} s)"
        )
        progress.point(r)

    ran = {
        (r["point"]["policy"], r["point"]["knob"]): r
        for r in simulate_grid(cfg, cal, rate, slo, todo, jobs, done)
    }
    runs = [kept_runs.get((k.policy, k.label)) or ran[(k.policy, k.label)] for k in knobs]
    return {
        "schema": SCHEMA,
        "mode": "sim",
        "trace": trace,
        "config": config,
        "points": [r["point"] for r in runs],
        "runs": [{k: v for k, v in r.items() if k != "point"} for r in runs],
        "wall_s": round(time.monotonic() - t0, 1),
    }
