"""The calibration replay of one trace (`calibration_replay`): another slice of it replayed live with
fine-tuning off (`serving_only`), its inference steps set against what the simulator charges for them
(`replay_fit`): the factor on the simulator's inference costs for this trace, and the evaluation batches
and first round plans its simulated runs then use (`trace_run.TraceSims`)."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from collm_bench.step_costs import EvalShape

from . import setup
from .config import HeadlineConfig
from .live import LiveRunError, eval_shapes_of_run, run_live
from .predict import simulate_run
from .replay_fit import (
    OFFSET_REQUESTS,
    REPLAY_SERIES,
    measured_eval_fit,
    measured_first_slow_s,
    measured_inference_factor,
    ms_per_token,
    replay_start_s,
    with_inference_factor,
)
from .table import compact

if TYPE_CHECKING:
    from .trace_run import TraceRun


def _replay_slice(run: TraceRun) -> tuple[HeadlineConfig, str] | None:
    """The replay's configuration (another slice of the trace, or synthetic arrivals of the next seed)
    and where it is; None, noted, when the trace holds too few requests after the slice's start."""
    cfg = run.bench.cfg
    if run.source.synthetic:
        return dataclasses.replace(cfg, seed=cfg.seed + 1), f"synthetic arrivals, seed {cfg.seed + 1}"
    start = replay_start_s(run.source.requests, cfg.trace_start_s)
    if start is None:
        run.note(
            f"no calibration replay: the trace has fewer than {OFFSET_REQUESTS} requests after "
            "the slice's start"
        )
        return None
    where = f"trace from {start:.1f} s, {OFFSET_REQUESTS} requests after the slice's start"
    return dataclasses.replace(cfg, trace_start_s=start), where


def _live_record(
    replay_cfg: HeadlineConfig, rate: float, n: int, res: dict[str, Any], run_dir: Path
) -> dict[str, Any]:
    """The replay's entry in the results document: its slice, rate and live figures."""
    busy = res.get("busy_s_by_replica") or {}
    return {
        "policy": REPLAY_SERIES,
        "trace_start_s": replay_cfg.trace_start_s,
        "seed": replay_cfg.seed,
        "rate_rps": rate,
        "n_requests": n,
        "live_attainment": res["summary"].get("attainment"),
        "live_inference_s": sum(b.get("inference", 0.0) for b in busy.values()),
        "live_inference_tokens": sum((res.get("inference_tokens_by_replica") or {}).values()),
        "live": compact(res["summary"], {"busy_s_by_replica": busy, "run_dir": str(run_dir)}),
    }


def _fit_shapes(run: TraceRun, res: dict[str, Any], record: dict[str, Any]) -> dict[str, EvalShape]:
    """The replay's evaluation batches and first round plans, set on the trace's simulated runs and
    recorded; the evaluation shapes per replica."""
    cfg, sims = run.bench.cfg, run.sims
    shapes = eval_shapes_of_run(res, cfg.replica_ids())
    sims.eval_fit = measured_eval_fit(shapes, cfg.eval_max_tokens)
    record["eval_shapes"] = {rid: dataclasses.asdict(s) for rid, s in shapes.items()}
    record["eval_fit"] = dataclasses.asdict(sims.eval_fit) if sims.eval_fit else None
    sims.first_slow_s = measured_first_slow_s(res.get("coordinator_slow_ticks_s") or [])
    record["coordinator_first_slow_s"] = sims.first_slow_s
    return shapes


def _check(
    run: TraceRun, replay_cfg: HeadlineConfig, rate: float, factor: float, record: dict[str, Any]
) -> dict[float, float | None]:
    """The replay simulated at the probe's costs and at the measured ones, beside the live replay:
    recorded; the simulated attainment at each factor."""
    bench = run.bench
    assert bench.cal is not None
    sims = {
        f: simulate_run(
            replay_cfg,
            with_inference_factor(bench.cal, f),
            run.source,
            rate,
            run.slo,
            REPLAY_SERIES,
            bench.samples,
            eval_fit=run.sims.eval_fit,
            first_slow_s=run.sims.first_slow_s,
        )
        for f in (1.0, factor)
    }
    sim_attainment = {f: sims[f]["summary"]["attainment"] for f in sims}
    live_ms = ms_per_token([(record["live_inference_s"], record["live_inference_tokens"])])
    sim_ms = {f: ms_per_token(sims[f]["sim"]["inference_by_replica_to_cut"].values()) for f in sims}
    record |= {
        "factor": factor,
        # The check: the replay's attainment, simulated at the probe's costs and at the measured ones.
        "sim_attainment": {"probe": sim_attainment[1.0], "measured": sim_attainment[factor]},
        # Inference time per token served, live and simulated (probe's costs, measured ones).
        "ms_per_token": {"live": live_ms, "sim_probe": sim_ms[1.0], "sim_measured": sim_ms[factor]},
    }
    return sim_attainment


def _att(a: float | None) -> str:
    return "-" if a is None else f"{a:.3f}"


def _notes(
    run: TraceRun, record: dict[str, Any], where: str, shapes: dict[str, EvalShape], t0: float
) -> None:
    """What the replay fitted, as notes on the trace."""
    bench, cfg, tr = run.bench, run.bench.cfg, run.tr
    factor, sim_attainment = record["factor"], record["sim_attainment"]
    tr.setdefault("notes", []).append(
        f"the simulator's prefill and decode costs x{factor:.3f}: the live inference steps' time over "
        f"what the simulator charges for them, measured on a calibration replay ({where}; "
        f"{record['n_requests']} requests at {record['rate_rps']:.3f} req/s, {REPLAY_SERIES}); the replay "
        f"attained {_att(record['live_attainment'])} live, {_att(sim_attainment['probe'])} simulated at "
        f"the probe's costs and {_att(sim_attainment['measured'])} at the measured ones"
    )
    bench.say(tr["notes"][-1] + f" ({time.monotonic() - t0:.0f} s)")
    fit = run.sims.eval_fit
    if fit is not None:
        each = ", ".join(
            f"{rid} {s.batches} of {s.tokens_per_batch:.0f} tokens in {s.pieces_per_batch:.1f} pieces"
            for rid, s in sorted(shapes.items())
            if s.tokens_per_batch is not None and s.pieces_per_batch is not None
        )
        by = ", ".join(f"{rid} {n}" for rid, n in fit.batches_by_replica.items())
        run.note(
            f"the simulator's evaluations of {cfg.eval_max_tokens} tokens in batches of "
            f"{fit.pieces_per_batch} pieces, per replica {by} batches (else "
            f"{fit.batches}): the replay's evaluation batches, {each}"
        )
    if run.sims.first_slow_s is not None:
        run.note(
            f"the simulator's first round plans {run.sims.first_slow_s:.1f} s into the trace: the "
            f"replay's coordinator planned its first rounds then (it starts with the stack, before the "
            f"replay; its warmup is {cfg.coordinator_warmup_s:g} s)"
        )


def calibration_replay(run: TraceRun, rate: float | None) -> float | None:
    """Replay another slice of the trace live at `rate` with fine-tuning off (`serving_only`) and measure
    its inference steps against the simulator's costs (`replay_fit`); the factor, or None when it
    cannot be had. Sets the trace's evaluation batches and first round plans (`TraceSims`)."""
    bench, cfg = run.bench, run.bench.cfg
    assert bench.cal is not None
    if rate is None:
        return None
    replay = _replay_slice(run)
    if replay is None:
        return None
    replay_cfg, where = replay
    n = max(1, round(rate * cfg.duration_s))
    rate = n / cfg.duration_s
    bench.say(f"{run.source.label(cfg)}: calibration replay, {where}, {rate:.3f} req/s, {REPLAY_SERIES} ...")
    t0 = time.monotonic()
    run_dir = bench.root / f"{run.source.name}-calibration-replay"
    plan = setup.build_plan(replay_cfg, run.source, rate, bench.builder, run.slo)
    try:
        data = setup.replica_data(replay_cfg, bench.datasets, run_dir)
        res = run_live(replay_cfg, REPLAY_SERIES, plan, data, run_dir, bench.err, bench.base_losses)
    except (LiveRunError, OSError) as exc:
        run.tr["calibration_replay"] = {"error": str(exc)}
        bench.say(f"  calibration replay FAILED ({exc}): the probe's costs as they are")
        return None
    bench.keep_base_losses(res, run_dir)
    record = _live_record(replay_cfg, rate, n, res, run_dir)
    run.tr["calibration_replay"] = record
    bench.record_step_costs(record, res, bench.cal)
    factor = measured_inference_factor(record.get("step_costs") or {})
    if factor is None:
        bench.say("  calibration replay: no inference step logged; the probe's costs as they are")
        return None
    shapes = _fit_shapes(run, res, record)
    _check(run, replay_cfg, rate, factor, record)
    record["wall_s"] = time.monotonic() - t0
    _notes(run, record, where, shapes, t0)
    return factor
