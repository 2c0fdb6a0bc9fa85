"""Markdown tables of a simulator sweep (`bench/results/sim/sweep.json`) and speed run, for bench/README.md.

.venv/bin/python bench/sim/report.py [--sweep bench/results/sim/sweep.json] [--speed ...speed.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
POLICIES = ("collm", "separate", "fixed_ratio", "leftover")
REFERENCE = "serving_only"  # collm's coordinator with fine-tuning off (sweeps since it was added)


def f(x: Any, nd: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def sweep_tables(doc: dict[str, Any]) -> str:
    out = [
        f"Calibration: `{doc['calibration']}` ({doc.get('calibration_command', '')}); seed {doc['seed']}.",
        "",
    ]
    out.append(
        "| trace / replicas | SLO TTFT / TPOT ms | sustained rate at >= 90% (req/s): collm / separate / "
        f"fixed_ratio / leftover ({REFERENCE}) | best baseline | crossing rate (req/s) | goodput at crossing "
        f"(req/s): collm / separate / fixed_ratio / leftover ({REFERENCE}) | quality gain per hour at "
        "crossing (nats/h): collm / separate / fixed_ratio / leftover |"
    )
    out.append("|---|---|---|---|---|---|---|")
    for key, c in doc["configs"].items():
        a = c["analysis"]
        ref = a["sustained_rate_rps"].get(REFERENCE, {}).get("rate")
        sus = " / ".join(f(a["sustained_rate_rps"][p]["rate"]) for p in POLICIES) + f" ({f(ref)})"
        at = a.get("at_crossing") or {}
        gp = " / ".join(f(at.get(p, {}).get("goodput_rps"), 3) for p in POLICIES) if at else "-"
        if at:
            gp += f" ({f(at.get(REFERENCE, {}).get('goodput_rps'), 3)})"
        q = " / ".join(f(at.get(p, {}).get("quality_gain_per_hour"), 3) for p in POLICIES) if at else "-"
        slo = f"{c['slo']['ttft_ms']:.0f} / {c['slo']['tpot_ms']:.0f}"
        out.append(
            f"| {key} | {slo} | {sus} | {a['best_baseline']} | {f(a.get('crossing_rate_rps'))} | {gp} | {q} |"
        )
    out.append("")
    out.append(f"| trace / replicas | goal | reached | met | {REFERENCE} (same baseline) |")
    out.append("|---|---|---|---|---|")
    for key, c in doc["configs"].items():
        for name, g in c["analysis"]["goals"].items():
            out.append(
                f"| {key} | {name} >= {g['goal']} | {f(g['reached'])} | {'yes' if g['met'] else 'no'} "
                f"| {f(g.get(REFERENCE))} |"
            )
    return "\n".join(out)


def grid_table(doc: dict[str, Any], key: str) -> str:
    c = doc["configs"][key]
    series = [*POLICIES, *([REFERENCE] if any(r["policy"] == REFERENCE for r in c["grid"]) else [])]
    out = [
        f"{key}: goodput (req/s) / attainment / quality gain per hour (nats/h) / fine-tuning tokens, by rate",
        "",
        "| rate (req/s) | " + " | ".join(series) + " |",
        "|---|" + "---|" * len(series),
    ]
    rates = sorted({r["rate_rps"] for r in c["grid"]})
    by = {(r["policy"], r["rate_rps"]): r for r in c["grid"]}
    for rate in rates:
        cells = []
        for p in series:
            r = by.get((p, rate))
            cells.append(
                "-"
                if r is None
                else f"{f(r['goodput_rps'], 3)} / {f(r['attainment'], 3)} / "
                f"{f(r['quality_gain_per_hour'], 2)} / {r['ft_tokens']}"
            )
        out.append(f"| {rate:.3f} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def speed_table(doc: dict[str, Any]) -> str:
    out = [
        "| replicas | rate (req/s) | simulated s | wall s | simulated s per wall s | iterations |",
        "|---|---|---|---|---|---|",
    ]
    for r in doc["runs"]:
        out.append(
            f"| {r['replicas']} | {r['rate_rps']:.2f} | {r['sim_time_s']:.0f} | {r['wall_s']:.1f} | "
            f"{r['sim_seconds_per_wall_second']:.1f} | {r['iterations']} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", type=Path, default=REPO / "bench" / "results" / "sim" / "sweep.json")
    ap.add_argument("--speed", type=Path, default=REPO / "bench" / "results" / "sim" / "speed.json")
    ap.add_argument("--grids", action="store_true", help="also the per-rate tables")
    args = ap.parse_args(argv)
    parts = []
    if args.sweep.is_file():
        doc = json.loads(args.sweep.read_text())
        parts.append(sweep_tables(doc))
        if args.grids:
            parts += [grid_table(doc, k) for k in doc["configs"]]
    if args.speed.is_file():
        parts.append(speed_table(json.loads(args.speed.read_text())))
    sys.stdout.write("\n\n".join(parts) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
