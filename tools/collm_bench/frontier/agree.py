"""The simulator against a live frontier: every live point simulated with its policy and knobs on the
same trace slice, rate, window, drain, SLO and replicas (`experiment.predict.simulate_run`, the
services' own decisions), and per point the goodput's relative error |sim - live| / live. The check is
the median of those errors within `BOUND` (25%); agreement is a check, not a goal to refine.

`python -m collm_bench frontier --agree bench/results/frontier/live-conv-2r.json` adds the result as
the file's `agreement` and rewrites its table; a point whose live goodput is 0 has no relative error
and is left out of the median (listed with `error` None).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from collm_bench.experiment import setup
from collm_bench.experiment.config import ExperimentConfig
from collm_common.calibration import Calibration
from collm_workload.workload import Slo

from .curves import with_default_curves
from .points import Point

BOUND = 0.25


def relative_error(sim: float | None, live: float | None) -> float | None:
    """|sim - live| / live; None when either is missing or live is 0."""
    if sim is None or live is None or live <= 0:
        return None
    return abs(sim - live) / live


def summarize(rows: Sequence[Mapping[str, Any]], bound: float = BOUND) -> dict[str, Any]:
    """The agreement section from per-point rows (`policy`, `knob`, `live_goodput_rps`,
    `sim_goodput_rps`, `error`): the median error over the points that have one, and the check."""
    errors = [r["error"] for r in rows if r["error"] is not None]
    median = statistics.median(errors) if errors else None
    return {
        "bound": bound,
        "median_error": median,
        "within_bound": None if median is None else median <= bound,
        "points": [dict(r) for r in rows],
    }


def sim_config(live_doc: Mapping[str, Any]) -> tuple[ExperimentConfig, Slo, float]:
    """The experiment configuration, SLO and rate that the live frontier ran (simulated, not live)."""
    cfg = live_doc["config"]
    head = dataclasses.replace(
        ExperimentConfig(),
        model=cfg["model"],
        replicas=cfg["replicas"],
        duration_s=cfg["window_s"],
        drain_s=cfg["drain_s"],
        traces=(live_doc["trace"]["name"],),
        domains=tuple(cfg["domains"]),
        seed=cfg["seed"],
    )
    return head, Slo(**cfg["slo"]), float(cfg["rate_rps"])


def agreement(
    live_doc: Mapping[str, Any], say: Callable[[str], None], calibration: Path | None = None
) -> dict[str, Any]:
    """Simulate every point of `live_doc` and compare goodputs (module docstring)."""
    from collm_bench.experiment.predict import simulate_run

    cfg, slo, rate = sim_config(live_doc)
    if calibration is not None:
        cfg = dataclasses.replace(cfg, calibration=calibration)
    if cfg.calibration is None or not Path(cfg.calibration).is_file():
        raise setup.SetupError(f"the simulated points need a calibration (got {cfg.calibration})")
    cal, _ = with_default_curves(Calibration.load(cfg.calibration), cfg.domains)
    (source,) = setup.resolve_sources(cfg)
    rows = []
    for d in live_doc["points"]:
        p = Point.from_dict(d)
        run = simulate_run(cfg, cal, source, rate, slo, p.policy, cfg.train_examples, core=p.core)
        sim = run["summary"]["goodput_rps"]
        err = relative_error(sim, p.goodput_rps)
        rows.append(
            {
                "policy": p.policy,
                "knob": p.knob,
                "live_goodput_rps": p.goodput_rps,
                "sim_goodput_rps": sim,
                "error": err,
            }
        )
        shown = "-" if err is None else f"{err:.0%}"
        say(f"  {p.policy:<12} {p.knob:<22} goodput live {p.goodput_rps or 0:.3f}, sim {sim:.3f}: {shown}")
    out = summarize(rows)
    out["calibration"] = str(cfg.calibration)
    return out
