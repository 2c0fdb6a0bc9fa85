"""Robustness, simulated: one setting per policy, run unchanged at several loads and under a step in load.

    python -m collm_bench frontier --sim --robustness     # 8 replicas, conv: 0.3, 0.5, 0.7 and 0.3,0.7,0.3

The settings: collm at its default target; separate's split chosen on a committed frontier at half the
capacity estimate (`--robustness-from`, default `sim-conv-8r.json`: the knob training the most at
attainment >= 0.9 x serving alone's, else the one attaining the most); every fixed_ratio K of the grid,
the one chosen the same way marked; serving alone (the floor's reference). Each runs the same window of
arrivals at every constant load, and the step sequence whose phases fill the same window
(`step.run_knob`: the coordinator's, routing's and replicas' own code). Per cell: attainment over the
window, fine-tuning tokens, and the served quality gain per domain at the last publication of each
minute.

Pure functions of the result file give the verdicts (`verdicts`), the table (`table`) and the figure
(`plot`). Time-to-quality: minutes until every adapter's served loss (base loss - gain) reaches the best
baseline's final served loss in that cell (the best baseline: of those at or above the floor there, the
one whose served gains end highest, by their mean), against the minutes the baseline itself takes.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from collm_bench.experiment.config import ExperimentConfig
from collm_common.calibration import Calibration
from collm_workload.workload import Slo

from .points import (
    ATTAINMENT_FRACTION,
    SERVING_ALONE,
    Point,
    final_gains,
    fixed_ratio_knobs,
    json_text,
    mean_final_gain,
    minutes_to,
    quality_curve,
    separate_knobs,
)
from .step import StepKnob, run_knob, sim_setup

SCHEMA = "collm-robustness/1"
LOADS = (0.3, 0.5, 0.7)
STEP = (0.3, 0.7, 0.3)
TOKENS_VS_BEST_K_AT_LOW = 1.5  # collm's tokens at the lowest load against the chosen fixed K's


def chosen(points: Sequence[Point], policy: str) -> Point | None:
    """Of `policy`'s points, the one training the most at attainment >= 0.9 x serving alone's; else the
    one attaining the most (None: the policy has no point)."""
    alone = next((p for p in points if p.policy == SERVING_ALONE), None)
    mine = [p for p in points if p.policy == policy]
    if not mine:
        return None
    floor = ATTAINMENT_FRACTION * alone.get("slo_attainment") if alone is not None else -math.inf
    ok = [p for p in mine if p.get("slo_attainment") >= floor]
    if ok:
        return max(ok, key=lambda p: p.get("finetune_tokens"))
    return max(mine, key=lambda p: p.get("slo_attainment"))


def settings(frontier_doc: Mapping[str, Any], default_target: float, replicas: int) -> list[StepKnob]:
    """The table's rows: collm (default), separate's chosen split (its training fraction of `replicas`),
    every fixed K, serving alone."""
    pts = [Point.from_dict(p) for p in frontier_doc["points"]]
    sep, best_k = chosen(pts, "separate"), chosen(pts, "fixed_ratio")
    rows = [StepKnob(f"collm, target {default_target:g} (default)", {}, "collm")]
    if sep is not None:
        frac = float(sep.core["separate_train_frac"])
        (knob,) = separate_knobs(replicas, (frac,))
        rows.append(StepKnob(f"separate, {knob.label}", dict(knob.core), "separate"))
    for k in fixed_ratio_knobs():
        mark = " (chosen)" if best_k is not None and best_k.knob == k.label else ""
        rows.append(StepKnob(f"fixed_ratio, K={k.core['fixed_ratio_k']}{mark}", dict(k.core), "fixed_ratio"))
    rows.append(StepKnob("serving alone", {}, SERVING_ALONE))
    return rows


def _cell(
    cfg: ExperimentConfig, cal: Calibration, slo: Slo, rates: Sequence[float], step_s: float, knob: StepKnob
) -> dict[str, Any]:
    """One setting under one load sequence (one process; picklable in and out)."""
    import torch

    torch.set_num_threads(1)
    t0 = time.monotonic()
    run = run_knob(cfg, cal, slo, rates, step_s, knob)
    return {
        "attainment": run["attainment"],
        "ft_tokens": run["ft_tokens"],
        "lowest_minute": min((a for r in run["series"] if (a := r["attainment"]) is not None), default=None),
        "quality_timeline": quality_curve(run["quality_timeline"], cfg.domains),
        "wall_s": round(time.monotonic() - t0, 1),
    }


def robustness(
    cfg: ExperimentConfig,
    frontier_doc: Mapping[str, Any],
    chosen_from: str,
    loads: Sequence[float],
    step: Sequence[float],
    jobs: int,
    say: Callable[[str], None],
) -> dict[str, Any]:
    """The result file's content: every setting (`settings`, chosen on `frontier_doc`, read from the file
    `chosen_from`) at every constant load (windows of `cfg.duration_s`) and under `step` (phases of
    `cfg.duration_s / len(step)`)."""
    default_target, cal, source, slo, cap = sim_setup(cfg, "the robustness run")
    rows = settings(frontier_doc, default_target, cfg.replicas)
    window = cfg.duration_s
    columns: list[tuple[str, list[float], float]] = [(f"{f:g}", [f * cap], window) for f in loads]
    if step:
        columns.append((" -> ".join(f"{f:g}" for f in step), [f * cap for f in step], window / len(step)))
    say(
        f"{source.label(cfg)}, {cfg.replicas} replicas, {window:g} s per cell, capacity estimate {cap:.3f} "
        f"req/s; {len(rows)} settings x {len(columns)} loads in {jobs} process(es)"
    )
    tasks = [(r, c) for r in rows for c in columns]
    cells: dict[tuple[str, str], dict[str, Any]] = {}
    with ProcessPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = {
            pool.submit(_cell, cfg, cal, slo, rates, step_s, r): (r, name)
            for r, (name, rates, step_s) in tasks
        }
        for f, (r, name) in futures.items():
            cells[r.label, name] = c = f.result()
            say(
                f"  {r.label:<36} load {name:<16} attainment {c['attainment'] or 0:.3f}  ft tokens "
                f"{c['ft_tokens']:,.0f}  ({c['wall_s']:.0f} s)"
            )
    return {
        "schema": SCHEMA,
        "trace": {"name": source.name, "label": source.label(cfg)},
        "config": {
            "replicas": cfg.replicas,
            "window_s": window,
            "loads": [name for name, _, _ in columns],
            "rates_rps": {name: rates for name, rates, _ in columns},
            "capacity_estimate_rps": cap,
            "slo": dataclasses.asdict(slo),
            "default_target": default_target,
            "chosen_from": chosen_from,
            "domains": list(cfg.domains),
            "seed": cfg.seed,
        },
        "rows": [
            {
                "label": r.label,
                "policy": r.policy,
                "core": dict(r.core),
                "cells": {name: cells[r.label, name] for name, _, _ in columns},
            }
            for r in rows
        ],
    }


# --- readings (pure) -----------------------------------------------------------------------------------


def _final(cell: Mapping[str, Any]) -> list[float]:
    return final_gains(cell["quality_timeline"])


def verdicts(doc: Mapping[str, Any]) -> dict[str, Any]:
    """Per load: the floor (0.9 x serving alone's attainment), who holds it, the best baseline's
    time-to-quality against collm's; and the goals: collm at or above the floor at every load while
    training >= 1.5x the chosen fixed K at the lowest load, and no fixed K doing both (holding the floor
    everywhere and training as much as collm at the lowest load)."""
    rows = {r["label"]: r for r in doc["rows"]}
    loads = doc["config"]["loads"]
    alone = next(r for r in doc["rows"] if r["policy"] == SERVING_ALONE)
    collm = next(r for r in doc["rows"] if r["policy"] == "collm")
    fixed = [r for r in doc["rows"] if r["policy"] == "fixed_ratio"]
    best_k = next((r for r in fixed if "(chosen)" in r["label"]), None)
    per_load: dict[str, Any] = {}
    for name in loads:
        floor = ATTAINMENT_FRACTION * (alone["cells"][name]["attainment"] or 0.0)
        held = [lb for lb, r in rows.items() if (r["cells"][name]["attainment"] or 0.0) >= floor]
        baselines = [
            r for r in doc["rows"] if r["policy"] not in ("collm", SERVING_ALONE) and r["label"] in held
        ]
        best = max(
            baselines, key=lambda r: mean_final_gain(r["cells"][name]["quality_timeline"]), default=None
        )
        ttq: dict[str, Any] = {"baseline": None}
        if best is not None:
            target = _final(best["cells"][name])
            ttq = {
                "baseline": best["label"],
                "baseline_min": minutes_to(best["cells"][name]["quality_timeline"], target),
                "collm_min": minutes_to(collm["cells"][name]["quality_timeline"], target),
            }
        per_load[name] = {"floor": round(floor, 4), "held": held, "time_to_quality": ttq}
    low = loads[0]
    collm_holds = all(collm["label"] in per_load[n]["held"] for n in loads)
    ratio = None
    if best_k is not None and best_k["cells"][low]["ft_tokens"]:
        ratio = collm["cells"][low]["ft_tokens"] / best_k["cells"][low]["ft_tokens"]
    both = [
        r["label"]
        for r in fixed
        if all(r["label"] in per_load[n]["held"] for n in loads)
        and r["cells"][low]["ft_tokens"] >= collm["cells"][low]["ft_tokens"]
    ]
    return {
        "per_load": per_load,
        "collm_holds_floor_everywhere": collm_holds,
        "collm_tokens_vs_chosen_k_at_lowest": None if ratio is None else round(ratio, 3),
        "fixed_k_doing_both": both,
        "goal_met": collm_holds and ratio is not None and ratio >= TOKENS_VS_BEST_K_AT_LOW and not both,
    }


def _ttq(m: float | None) -> str:
    return "not reached" if m is None else f"{m:.0f} min"


def table(doc: Mapping[str, Any]) -> str:
    """Per setting and load: attainment / fine-tuning tokens (below the floor: marked *), then the floors,
    the time-to-quality per load and the goal."""
    v = verdicts(doc)
    loads = doc["config"]["loads"]
    out = [
        "| setting | " + " | ".join(f"load {n}" for n in loads) + " |",
        "|---|" + "---:|" * len(loads),
    ]
    for r in doc["rows"]:
        cells = []
        for n in loads:
            c = r["cells"][n]
            below = "" if r["label"] in v["per_load"][n]["held"] else "*"
            cells.append(f"{c['attainment'] or 0:.3f} / {c['ft_tokens'] / 1000:,.0f}k{below}")
        out.append(f"| {r['label']} | " + " | ".join(cells) + " |")
    floors = " | ".join(f"{v['per_load'][n]['floor']:.3f}" for n in loads)
    out.append(f"| floor (0.9 x alone; * below it) | {floors} |")
    ttq = []
    for n in loads:
        t = v["per_load"][n]["time_to_quality"]
        ttq.append(
            "no baseline at the floor"
            if t["baseline"] is None
            else f"{_ttq(t['collm_min'])} vs {_ttq(t['baseline_min'])} ({t['baseline'].split(' (')[0]})"
        )
    out.append("| time-to-quality, collm vs best baseline | " + " | ".join(ttq) + " |")
    ratio = v["collm_tokens_vs_chosen_k_at_lowest"]
    ratio_text = "-" if ratio is None else f"{ratio:.2f}x"
    both = ", ".join(v["fixed_k_doing_both"]) or "none"
    out += [
        "",
        f"collm holds every floor: {'yes' if v['collm_holds_floor_everywhere'] else 'no'}; its tokens at "
        f"{loads[0]} over the chosen K's: {ratio_text} (goal >= {TOKENS_VS_BEST_K_AT_LOW:g}x); a fixed K "
        f"holding every floor and training as much at {loads[0]}: {both}. "
        f"Goal {'met' if v['goal_met'] else 'not met'}.",
    ]
    return "\n".join(out)


def plot(doc: Mapping[str, Any], path: Path) -> Path:
    """Attainment (with each load's floor) above and fine-tuning tokens below, per load, one marker
    series per setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    v = verdicts(doc)
    loads = doc["config"]["loads"]
    x = list(range(len(loads)))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for r in doc["rows"]:
        style = "-o" if r["policy"] == "collm" else ("--s" if r["policy"] == "separate" else ":.")
        top.plot(x, [r["cells"][n]["attainment"] for n in loads], style, label=r["label"], lw=1)
        bottom.plot(x, [r["cells"][n]["ft_tokens"] for n in loads], style, lw=1)
    top.plot(x, [v["per_load"][n]["floor"] for n in loads], "k_", ms=30, mew=2, label="floor")
    top.set_ylabel("attainment")
    fig.legend(fontsize=6, loc="lower center", ncol=3)
    bottom.set_ylabel("fine-tuning tokens")
    bottom.set_xticks(x, [f"load {n}" for n in loads])
    fig.suptitle(
        f"one setting per policy across loads: {doc['trace']['label']}, {doc['config']['replicas']} replicas",
        fontsize=9,
    )
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write(doc: Mapping[str, Any], path: Path) -> Path:
    """The result file (lists of numbers on one line each) and its figure beside it."""
    text = json_text(doc)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n", encoding="utf-8")
    plot(doc, path.with_suffix(".png"))
    return path
