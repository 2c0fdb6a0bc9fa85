"""The frontier's Markdown tables (pure, from result files) and its figure (PNG)."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .points import GOALS, QUALITY_AXES, TRAINING_AXES, Point, by_policy, frontier

COLORS = {
    "collm": "tab:red",
    "separate": "tab:blue",
    "fixed_ratio": "tab:green",
    "leftover": "tab:orange",
    "serving_only": "grey",  # the reference run: fine-tuning off
}

GOAL_TEXT = {
    "finetune_tokens_vs_best_baseline": "fine-tuning tokens vs the best baseline, attainment >= 0.9 x alone",
    "time_to_quality_vs_best_baseline": "time-to-quality, the best baseline's minutes over collm's, "
    "attainment >= 0.9 x alone",
    "goodput_vs_separate": "goodput vs separate at equal quality gain",
    "goodput_vs_best_colocated": "goodput vs the best co-located baseline at equal quality gain",
}


VERDICT = {True: "yes", False: "no", None: "undecided"}
GOAL_SHORT = {
    "finetune_tokens_vs_best_baseline": "fine-tuning tokens",
    "time_to_quality_vs_best_baseline": "time-to-quality",
    "goodput_vs_separate": "goodput vs separate",
    "goodput_vs_best_colocated": "goodput vs co-located",
}


def _n(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def points_of(results: Mapping[str, Any]) -> list[Point]:
    return [Point.from_dict(p) for p in results["points"]]


def _on_fronts(points: list[Point]) -> dict[tuple[str, str], str]:
    marks: dict[tuple[str, str], str] = {}
    for pts in by_policy(points).values():
        for axes, mark in ((QUALITY_AXES, "Q"), (TRAINING_AXES, "T")):
            for p in frontier(pts, axes):
                marks[p.policy, p.knob] = marks.get((p.policy, p.knob), "") + mark
    return marks


def markdown(results: Mapping[str, Any]) -> str:
    """One row per point (Q / T: on its policy's quality-goodput / attainment-tokens frontier), then
    the goals."""
    cfg = results["config"]
    points = points_of(results)
    marks = _on_fronts(points)
    head = (
        f"{results['mode']}, {results['trace']['label']}, {cfg['replicas']} replicas, "
        f"{cfg['window_s']:g} s windows at {cfg['rate_rps']:.3f} req/s"
    )
    lines = [
        head,
        "",
        "| policy | knob | attainment | goodput (req/s) | fine-tuning tokens | quality gain (nats) "
        "| requests | frontier |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in points:
        lines.append(
            f"| {p.policy} | {p.knob} | {_n(p.slo_attainment, '.3f')} | {_n(p.goodput_rps, '.3f')} "
            f"| {_n(p.finetune_tokens, ',.0f')} | {_n(p.quality_gain_nats, '.4f')} | {p.n_requests} "
            f"| {marks.get((p.policy, p.knob), '')} |"
        )
    lines += ["", "| goal | target | reached | ratio | against | why undecided |", "|" + "---|" * 6]
    for name, g in results["goals"].items():
        reached = VERDICT[g["reached"]]
        against = g.get("best_baseline") or g.get("against") or "-"
        lines.append(
            f"| {GOAL_TEXT.get(name, name)} | {GOALS.get(name, g['goal']):g}x | {reached} "
            f"| {_n(g['ratio'], '.2f')} | {against} | {g['reason'] or ''} |"
        )
    if agree := results.get("agreement"):
        lines += ["", agreement_line(agree)]
    return "\n".join(lines)


def _median_error(agree: Mapping[str, Any]) -> str:
    median = agree["median_error"]
    return _n(None if median is None else 100 * median, ".0f") + "%"


def agreement_line(agree: Mapping[str, Any]) -> str:
    """The simulator-vs-live check of a live file in one line."""
    n = sum(1 for r in agree["points"] if r["error"] is not None)
    verdict = {True: "within", False: "outside", None: "no verdict:"}[agree["within_bound"]]
    return (
        f"Simulator vs live: median goodput error {_median_error(agree)} over {n} points, {verdict} "
        f"the {agree['bound']:.0%} bound."
    )


def _cell(goal: Mapping[str, Any]) -> str:
    against = goal.get("best_baseline") or goal.get("against")
    return f"{_n(goal['ratio'], '.2f')} {VERDICT[goal['reached']]}" + (f" ({against})" if against else "")


def goals_table(docs: Sequence[Mapping[str, Any]]) -> str:
    """One row per result file: each goal's ratio, whether it is reached, and against which baseline
    (the results page's compact form; `markdown` has every point)."""
    names = list(GOALS)
    lines = [
        "| run | " + " | ".join(f"{GOAL_SHORT[n]} (>= {GOALS[n]:g}x)" for n in names) + " |",
        "|---|" + "---:|" * len(names),
    ]
    for doc in docs:
        cfg = doc["config"]
        trace = f"{doc['mode']} {doc['trace']['name']}"
        run = f"{trace}, {cfg['replicas']} replicas, {cfg['rate_rps']:.2f} req/s"
        if (alone := re.search(r"serving alone attains >= ([0-9.]+)", cfg.get("rate_from", ""))) is not None:
            run += f" (alone {alone.group(1)})"
        # Files without the round mode were run with synchronous 25-s rounds; the default (async 55-s
        # rounds) goes unsaid.
        rounds = (cfg.get("rounds", "sync"), float(cfg.get("round_deadline_s", 25.0)))
        if rounds != ("async", 55.0):
            run += f", {rounds[0]} {rounds[1]:g}-s rounds"
        if agree := doc.get("agreement"):
            run += f"; sim error {_median_error(agree)}"
        lines.append(f"| {run} | " + " | ".join(_cell(doc["goals"][n]) for n in names) + " |")
    return "\n".join(lines)


def plot(results: Mapping[str, Any], path: Path) -> Path:
    """Two panels: quality gain against goodput, attainment against fine-tuning tokens; every point,
    each policy's frontier as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, (x, y) in zip(axes, (QUALITY_AXES, TRAINING_AXES), strict=True):
        for policy, pts in by_policy(points_of(results)).items():
            color = COLORS.get(policy)
            ax.scatter([p.get(x) for p in pts], [p.get(y) for p in pts], color=color, s=18, alpha=0.6)
            front = frontier(pts, (x, y))
            ax.plot(
                [p.get(x) for p in front], [p.get(y) for p in front], color=color, marker="o", label=policy
            )
        ax.set_xlabel(x.replace("_", " "))
        ax.set_ylabel(y.replace("_", " "))
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    cfg = results["config"]
    fig.suptitle(f"{results['trace']['label']}, {cfg['replicas']} replicas ({results['mode']})", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
