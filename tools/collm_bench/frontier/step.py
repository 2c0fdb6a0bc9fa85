"""collm's control under a step in load, simulated: does attainment settle at the target, and at what cost?

    python -m collm_bench frontier --sim --step-load 0.3,0.7,0.3 --step-s 600     # 8 replicas, conv

The offered rate steps through fractions of the capacity estimate (`experiment.setup.capacity_rps`), each
held `step_s` seconds (each phase replays the trace from the same start at its rate); every knob runs the
whole sequence in the simulator (the coordinator's, routing's and replicas' own code). Per minute of
arrivals: attainment of the requests that arrived in it, and the coordinator's headroom, spend and total
share (means over its fast ticks); per knob the fine-tuning tokens. The knobs: collm at its default target,
at 0.9, and at 0.9 with no spend (training only in the requests' slack). Pure functions of the result
file draw its table and figure (`table`, `plot`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from collm_bench.experiment import setup
from collm_bench.experiment.config import ExperimentConfig
from collm_common.calibration import Calibration
from collm_workload.workload import Slo

from .curves import with_default_curves

SCHEMA = "collm-step-load/1"
BIN_S = 60.0


@dataclasses.dataclass(frozen=True)
class StepKnob:
    label: str
    core: Mapping[str, float]
    policy: str = "collm"


def default_knobs(default_target: float) -> list[StepKnob]:
    return [
        StepKnob(f"target {default_target:g} (default)", {}),
        StepKnob("target 0.9", {"attainment_target": 0.9}),
        StepKnob("target 0.9, no spend", {"attainment_target": 0.9, "spend_gain": 0.0}),
    ]


def _workload(
    cfg: ExperimentConfig, source: setup.TraceSource, slo: Slo, rates: Sequence[float], step_s: float
) -> Any:
    """The phases' workloads, one after the other (each from the trace's start, at its own rate)."""
    import numpy as np

    from collm_bench.experiment.predict import workload_spec
    from collm_sim.workload import Workload, build_workload

    parts = []
    for rate in rates:
        spec = workload_spec(dataclasses.replace(cfg, duration_s=step_s), source, rate, slo)
        parts.append(build_workload(spec, tuple(cfg.domains)))
    first = parts[0]
    return Workload(
        np.concatenate([p.arrival_s + i * step_s for i, p in enumerate(parts)]),
        np.concatenate([p.input_tokens for p in parts]),
        np.concatenate([p.output_tokens for p in parts]),
        np.concatenate([p.domain for p in parts]),
        first.domains,
        first.ttft_slo_ms,
        first.tpot_slo_ms,
        step_s * len(rates),
        f"step load {', '.join(f'{r:.3f}' for r in rates)} req/s, {step_s:g} s each",
    )


def step_series(
    arrivals: Sequence[tuple[float, bool]],
    ticks: Sequence[tuple[float, float, float, float]],
    rates_rps: Sequence[float],
    step_s: float,
) -> list[dict[str, Any]]:
    """Per minute of the step sequence: its offered rate, the attainment of the requests that arrived in it
    (`arrivals`: arrival time in seconds, met its SLO) and the means of the control's `ticks` (time,
    headroom, spend, summed share) in it (None where it has none)."""
    n_bins = int(step_s * len(rates_rps) // BIN_S)
    good, total = [0] * n_bins, [0] * n_bins
    for at_s, ok in arrivals:
        b = int(at_s // BIN_S)
        if 0 <= b < n_bins:
            total[b] += 1
            good[b] += ok
    series = []
    for b in range(n_bins):
        tk = [x for x in ticks if b * BIN_S <= x[0] < (b + 1) * BIN_S]

        def mean(i: int, tk: list[tuple[float, float, float, float]] = tk) -> float | None:
            return round(sum(x[i] for x in tk) / len(tk), 3) if tk else None

        series.append(
            {
                "t_min": b * BIN_S / 60.0,
                "load": round(rates_rps[min(len(rates_rps) - 1, int(b * BIN_S // step_s))], 4),
                "attainment": round(good[b] / total[b], 4) if total[b] else None,
                "requests": total[b],
                "headroom": mean(1),
                "spend": mean(2),
                "total_share": mean(3),
            }
        )
    return series


def window_attainment(arrivals: Sequence[tuple[float, bool]], window_s: float) -> float | None:
    """Attainment of the arrivals in the whole minutes of the window (those `step_series` bins)."""
    end_s = (window_s // BIN_S) * BIN_S
    oks = [ok for at_s, ok in arrivals if 0 <= at_s < end_s]
    return round(sum(oks) / len(oks), 4) if oks else None


def run_knob(
    cfg: ExperimentConfig, cal: Calibration, slo: Slo, rates: Sequence[float], step_s: float, knob: StepKnob
) -> dict[str, Any]:
    """One knob over the whole step sequence: its per-minute series, attainment over all of it, fine-tuning
    tokens, and the served quality gain per domain after each publication (`quality_timeline`, [s, gains])."""
    from collm_bench.experiment.predict import sim_config
    from collm_sim.cluster import Simulation
    from collm_workload.goodput import is_good

    (source,) = setup.resolve_sources(cfg)
    sim_cfg = sim_config(cfg, source, rates[0], slo, knob.policy, cfg.train_examples, knob.core)
    sim = Simulation(sim_cfg, cal, workload=_workload(cfg, source, slo, rates, step_s))
    ticks: list[tuple[float, float, float, float]] = []
    on_tick = sim.core.on_tick

    def watched(now_s: float, inputs: Any) -> Any:
        d = on_tick(now_s, inputs)
        if d.fast is not None:
            ticks.append(
                (now_s, d.diagnostics.headroom, d.diagnostics.spend, sum(s.share for s in d.fast.shares))
            )
        return d

    sim.core.on_tick = watched  # type: ignore[method-assign]
    res = sim.run()
    arrivals = [(r.scheduled_s, is_good(r)) for r in res.records]
    return {
        "knob": knob.label,
        "policy": knob.policy,
        "core": dict(knob.core),
        "ft_tokens": res.sim["ft_tokens"],
        "attainment": window_attainment(arrivals, len(rates) * step_s),
        "series": step_series(arrivals, ticks, rates, step_s),
        "quality_timeline": res.sim["quality_timeline"],
    }


def sim_setup(cfg: ExperimentConfig, what: str) -> tuple[float, Calibration, setup.TraceSource, Slo, float]:
    """What a simulated run of `cfg` needs: the coordinator's default attainment target, the calibration
    (default quality curves for domains it lacks), the trace, the SLO and the capacity estimate (req/s)."""
    if cfg.calibration is None or not Path(cfg.calibration).is_file():
        raise setup.SetupError(f"{what} needs a calibration (got {cfg.calibration})")
    from collm_coordinator.core import CoreConfig

    from .sim import max_batch

    cal, _ = with_default_curves(Calibration.load(cfg.calibration), cfg.domains)
    (source,) = setup.resolve_sources(cfg)
    slo = setup.slo_for(cfg, source, cal, max_batch())
    return CoreConfig().attainment_target, cal, source, slo, setup.capacity_rps(cfg, cal, source, max_batch())


def step_load(
    cfg: ExperimentConfig,
    fractions: Sequence[float],
    step_s: float,
    say: Callable[[str], None],
) -> dict[str, Any]:
    """The result file's content: every knob of `default_knobs` under the step sequence."""
    default_target, cal, source, slo, cap_rps = sim_setup(cfg, "the step-load run")
    rates = [f * cap_rps for f in fractions]
    steps = " -> ".join(f"{f:g}" for f in fractions)
    say(
        f"{source.label(cfg)}, {cfg.replicas} replicas: load {steps} of the "
        f"capacity estimate {cap_rps:.3f} req/s, {step_s:g} s each; SLO TTFT {slo.ttft_ms:.0f} ms / TPOT "
        f"{slo.tpot_ms:.0f} ms"
    )
    runs = []
    for knob in default_knobs(default_target):
        run = run_knob(cfg, cal, slo, rates, step_s, knob)
        say(f"  collm {knob.label:<24} ft tokens {run['ft_tokens']}")
        runs.append({k: v for k, v in run.items() if k not in ("policy", "attainment", "quality_timeline")})
    return {
        "schema": SCHEMA,
        "trace": {"name": source.name, "label": source.label(cfg)},
        "config": {
            "replicas": cfg.replicas,
            "load_fractions": list(fractions),
            "step_s": step_s,
            "capacity_estimate_rps": cap_rps,
            "rates_rps": rates,
            "slo": dataclasses.asdict(slo),
            "default_target": default_target,
            "seed": cfg.seed,
        },
        "runs": runs,
    }


def _phase_attainment(run: Mapping[str, Any], phase: int, bins_per_phase: int) -> float | None:
    rows = run["series"][phase * bins_per_phase : (phase + 1) * bins_per_phase]
    n = sum(r["requests"] for r in rows)
    good = sum((r["attainment"] or 0.0) * r["requests"] for r in rows)
    return good / n if n else None


def table(doc: Mapping[str, Any]) -> str:
    """Per knob: attainment in each phase, headed by its load (all of it / its second half: settled), the
    lowest minute, and the fine-tuning tokens."""
    cfg = doc["config"]
    fracs = cfg["load_fractions"]
    per = int(cfg["step_s"] // BIN_S)
    head = " | ".join(f"{f:g}" for f in fracs)
    out = [
        f"| collm | {head} | lowest minute | fine-tuning tokens |",
        "|---|" + "---|" * len(fracs) + "---|---:|",
    ]
    for run in doc["runs"]:
        cells = []
        for i in range(len(fracs)):
            rows = run["series"][i * per : (i + 1) * per]
            late = {"series": rows[per // 2 :]}
            a, b = _phase_attainment(run, i, per), _phase_attainment(late, 0, per)
            cells.append(f"{'-' if a is None else f'{a:.3f}'} / {'-' if b is None else f'{b:.3f}'}")
        low = min((r["attainment"] for r in run["series"] if r["attainment"] is not None), default=None)
        out.append(
            f"| {run['knob']} | {' | '.join(cells)} | {'-' if low is None else f'{low:.2f}'} "
            f"| {run['ft_tokens']:,} |"
        )
    return "\n".join(out)


def plot(doc: Mapping[str, Any], path: Path) -> Path:
    """Attainment per minute (with the target) above, spend and total share below, one line per knob."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 5.5), sharex=True)
    for run in doc["runs"]:
        t = [r["t_min"] for r in run["series"]]
        (line,) = top.plot(t, [r["attainment"] for r in run["series"]], label=run["knob"])
        target = run["core"].get("attainment_target", doc["config"]["default_target"])
        top.axhline(target, color=line.get_color(), lw=0.6, ls=":")
        bottom.plot(
            t, [r["spend"] for r in run["series"]], color=line.get_color(), label=f"{run['knob']}: spend"
        )
        share = [
            None if r["total_share"] is None else r["total_share"] / doc["config"]["replicas"]
            for r in run["series"]
        ]
        bottom.plot(t, share, color=line.get_color(), ls="--", lw=0.8)
    step_min = doc["config"]["step_s"] / 60.0
    for ax in (top, bottom):
        for i in range(1, len(doc["config"]["load_fractions"])):
            ax.axvline(i * step_min, color="grey", lw=0.5)
    top.set_ylabel("attainment (per minute)")
    top.set_ylim(0.4, 1.01)
    top.legend(fontsize=7, loc="lower left")
    bottom.set_ylabel("spend (solid), mean share (dashed)")
    bottom.set_xlabel(
        "minute (load " + " -> ".join(f"{f:g}" for f in doc["config"]["load_fractions"]) + " of capacity)"
    )
    fig.suptitle(
        f"collm under a step load: {doc['trace']['label']}, {doc['config']['replicas']} replicas", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
