"""One policy at one rate of one trace (`run_policy`): the simulator's prediction (with its spread over the
speed probe's range) and the live run beside it, each run's figures said as it ends."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from collm_workload.records import write_records
from collm_workload.workload import PlannedRequest

from . import setup
from .live import LiveRunError, run_live
from .predict import cost_band
from .table import compact

if TYPE_CHECKING:
    from .trace_run import TraceRun

# What a live run's entry keeps of its results, beside its summary.
LIVE_KEEP = (
    "ft_tokens",
    "ft_limits_by_replica",
    "busy_s_by_replica",
    "forward_s_by_replica",
    "cpu_s_by_process",
    "machine_cpu_s",
    "rounds",
    "stack_ready_s",
    "wall_s",
    "phases_s",
    "coordinator_slow_ticks_s",
    "coordinator_policy",
    "coscheduler",
    "run_dir",
)


def busy_line(busy: dict[str, dict[str, float]]) -> str:
    """`r0 81 / 2 / 6, r1 ...`: seconds of inference, training and evaluation per replica."""
    kinds = ("inference", "training", "evaluation")
    rows = sorted(busy.items())
    return ", ".join(f"{r} " + " / ".join(f"{b.get(w, 0.0):.0f}" for w in kinds) for r, b in rows)


def simulated(run: TraceRun, policy: str, n_requests: int) -> dict[str, Any]:
    """The simulator's prediction of `policy` at `n_requests` (its run's summary and figures), with the
    spread of its goodput over the speed probe's range when a probe scaled the costs."""
    s = run.sims(policy, n_requests)
    extra = {
        # Up to the drain cut, as the live counters are read; the whole simulated run apart.
        "ft_tokens": s["sim"]["ft_tokens_to_cut"],
        "ft_tokens_whole_run": s["sim"]["ft_tokens"],
        "rounds": s["sim"]["rounds"],
        "quality_gain_model": s["sim"]["quality_gain_mix"],
        "busy_s_by_replica": s["sim"].get("busy_s_by_replica"),
    }
    entry = compact(s["summary"], extra)
    probe = (run.bench.results.get("calibration") or {}).get("speed_probe")
    if probe and run.bench.unscaled_cal is not None:
        # The prediction's spread: every cost at the probe's lowest and at its highest ratio to the
        # calibration instead of each kind's own factor.
        factors = cost_band(probe["ratios"].values())
        ends = [run.sims(policy, n_requests, f)["summary"]["goodput_rps"] for f in factors]
        entry["goodput_range"] = {
            "cost_factors": list(factors),
            "goodput_rps": ends,
            "range_rps": [
                min(*ends, s["summary"]["goodput_rps"]),
                max(*ends, s["summary"]["goodput_rps"]),
            ],
        }
    return entry


def _say_live(run: TraceRun, policy: str, entry: dict[str, Any], res: dict[str, Any], t0: float) -> None:
    """The live run's figures: goodput, attainment, training, rounds, then per replica where the time
    went and the processes' CPU, beside the simulated run's."""
    say, lv = run.bench.say, entry["live"]
    limits: dict[str, float] = {}
    for per in res["ft_limits_by_replica"].values():
        for k, n in per.items():
            limits[k] = limits.get(k, 0.0) + n
    say(
        f"  {policy}: goodput {lv['goodput_rps']:.3f} req/s, attainment {lv['attainment']:.3f}, "
        f"ft tokens {lv['ft_tokens']:.0f}, rounds {lv['rounds']}, quality gain end "
        f"{lv['quality_gain_end']}, serving iterations with a job by what bounded training "
        f"{ {k: int(n) for k, n in sorted(limits.items())} } ({time.monotonic() - t0:.0f}s)"
    )
    busy = res.get("busy_s_by_replica") or {}
    if busy:
        say("    busy s (inference / training / evaluation): " + busy_line(busy))
        forward = res.get("forward_s_by_replica") or {}
        if forward:
            say(
                "    of the inference, in the model's forward passes: "
                + ", ".join(f"{r} {s:.0f} s" for r, s in sorted(forward.items()))
            )
    cpu = res.get("cpu_s_by_process") or {}
    if cpu:
        machine = res.get("machine_cpu_s") or {}
        whole = ", ".join(f"{k} {v:.0f}" for k, v in machine.items())
        say(
            "    cpu s during the replay: "
            + ", ".join(f"{n} {s:.0f}" for n, s in sorted(cpu.items()))
            + (f"; the machine: {whole}" if whole else "")
        )
    sim_busy = (entry.get("sim") or {}).get("busy_s_by_replica") or {}
    if sim_busy:
        say("    simulated (whole run):                      " + busy_line(sim_busy))


def run_policy(
    run: TraceRun, lab: str, block: dict[str, Any], policy: str, plan: list[PlannedRequest]
) -> dict[str, Any]:
    """`policy` at rate `lab` (its `block` in the results document): the simulated run (`sim`), then the
    live one (`live`, or `live_error` when it failed), as the entry of `block["runs"]`."""
    bench, cfg, source = run.bench, run.bench.cfg, run.source
    entry: dict[str, Any] = {}
    if cfg.simulate and bench.cal is not None:
        entry["sim"] = simulated(run, policy, block["n_requests"])
    if not cfg.live:
        return entry
    run_dir = bench.root / f"{source.name}-{lab}-{policy}"
    bench.say(f"{source.label(cfg)}, {lab} {block['rate_rps']:.3f} req/s: {policy} ...")
    t0 = time.monotonic()
    try:
        data = setup.replica_data(cfg, bench.datasets, run_dir)
        res = run_live(cfg, policy, plan, data, run_dir, bench.err, bench.base_losses)
    except (LiveRunError, OSError) as exc:
        bench.failed += 1
        entry["live_error"] = str(exc)
        bench.say(f"  {policy} FAILED: {exc}")
        return entry
    sim_cut_s: float | None = None  # the simulated run's drain cut (its time base)
    if cfg.simulate and bench.cal is not None:
        # The prediction's requests and steps beside the live ones (`requests.jsonl`, the stack's step
        # logs), to compare one by one.
        predicted = run.sims(policy, block["n_requests"], step_logs_dir=run_dir)
        write_records(run_dir / "sim_requests.jsonl", predicted["records"])
        sim_cut_s = predicted["sim"]["cut_s"]
    bench.keep_base_losses(res, run_dir)
    extra = {k: res.get(k) for k in LIVE_KEEP} | {"quality_gain_current_end": res["final_current_gain"]}
    lv = entry["live"] = compact(res["summary"], extra)
    bench.record_step_costs(lv, res, run.prediction_cal)
    _say_live(run, policy, entry, res, t0)
    bench.record_training(lv, res, run_dir, sim_cut_s)
    return entry
