"""The headline comparison repeated: `python -m collm_bench headline-repeat --repeats N [headline args]`.

One live run per policy and rate is one draw on a shared machine: on this 2-core machine the same policy
at the same rate served 48 to 94 of 98 requests within SLO in runs an hour apart. This runs the same
headline invocation N times, each in its own output directory, with the order of the policies rotated from
one repetition to the next (so no policy always runs first or last), and summarises every figure as its
median and range over the repetitions. Ratios are paired: collm's figure over a baseline's from the same
repetition (the same probe, slice and stacks started minutes apart), then summarised. Give the rates
(`--rates light=..,heavy=..`) so that every repetition replays the same slices; otherwise each
repetition's rate search may pick others.

Writes `OUT/repeat-<timestamp>/summary.json` and `summary.md` beside the repetitions' own results.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from .config import BASELINES, REFERENCES, SERIES, HeadlineConfig

FIGURES = ("goodput_rps", "attainment", "quality_gain_end", "ft_tokens")


def rotated(policies: Sequence[str], k: int) -> list[str]:
    """The policies' order in repetition `k` (0-based): shifted left by k."""
    n = len(policies)
    return [policies[(i + k) % n] for i in range(n)] if n else []


def _spread(xs: Sequence[float]) -> dict[str, float | int | None]:
    vals = [x for x in xs if x is not None]
    if not vals:
        return {"n": 0, "median": None, "min": None, "max": None}
    return {"n": len(vals), "median": statistics.median(vals), "min": min(vals), "max": max(vals)}


def _paired(mine: float | None, theirs: float | None) -> float | None:
    """One repetition's ratio; None when either figure is missing or the denominator is 0."""
    return mine / theirs if mine is not None and theirs else None


def summarize_repeats(results: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Per trace and rate: each policy's live figures and collm's paired ratios to each baseline, as
    median / min / max over the repetitions (pure; `results` are the repetitions' results.json)."""
    blocks: dict[str, dict[str, Any]] = {}
    for res in results:
        for tr in res.get("traces", []):
            for lab, block in tr.get("rates", {}).items():
                key = f"{tr.get('label', tr.get('trace'))}, {lab} {block.get('rate_rps', 0):.3f} req/s"
                b = blocks.setdefault(key, {"values": {}, "ratios": {}})
                live = {p: e["live"] for p, e in block.get("runs", {}).items() if e.get("live")}
                for p, lv in live.items():
                    for f in FIGURES:
                        b["values"].setdefault(p, {}).setdefault(f, []).append(lv.get(f))
                c = live.get("collm")
                for p, lv in live.items():
                    if p == "collm" or c is None:
                        continue
                    for f in ("goodput_rps", "quality_gain_end"):
                        b["ratios"].setdefault(f"{f} collm/{p}", []).append(_paired(c.get(f), lv.get(f)))
                # A reference run's goodput over each baseline's: the ceiling of collm's ratio to it.
                for ref in (r for r in REFERENCES if r in live):
                    for p in (x for x in BASELINES if x in live):
                        pair = _paired(live[ref].get("goodput_rps"), live[p].get("goodput_rps"))
                        b["ratios"].setdefault(f"goodput_rps {ref}/{p}", []).append(pair)
    out: dict[str, Any] = {"repeats": len(results), "blocks": {}}
    for key, b in blocks.items():
        out["blocks"][key] = {
            "policies": {p: {f: _spread(v) for f, v in figs.items()} for p, figs in b["values"].items()},
            "ratios": {name: {**_spread(v), "values": v} for name, v in b["ratios"].items()},
        }
    return out


def _fmt(s: Mapping[str, Any], digits: int = 3) -> str:
    if not s.get("n"):
        return "-"
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def markdown_repeats(summary: Mapping[str, Any]) -> str:
    """One table per trace and rate (median (min-max) over the repetitions), then the paired ratios."""
    lines: list[str] = []
    for key, b in summary["blocks"].items():
        lines += [
            f"**{key}**, {summary['repeats']} repetitions: median (min-max)",
            "",
            "| policy | goodput (req/s) | SLO attainment | quality gain end (nats) | ft tokens |",
            "|---|---|---|---|---|",
        ]
        for p, figs in sorted(b["policies"].items(), key=lambda kv: SERIES.index(kv[0])):
            lines.append(
                f"| {p} | {_fmt(figs['goodput_rps'])} | {_fmt(figs['attainment'])} | "
                f"{_fmt(figs['quality_gain_end'], 4)} | {_fmt(figs['ft_tokens'], 0)} |"
            )
        lines.append("")
        for name, r in b["ratios"].items():
            each = ", ".join("-" if v is None else f"{v:.2f}" for v in r["values"])
            lines.append(f"* {name}: {_fmt(r, 2)}; each repetition: {each}")
        lines.append("")
    return "\n".join(lines)


def _newest_results(root: Path) -> Path | None:
    found = sorted(root.glob("*/results.json"), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def main(argv: Sequence[str] | None = None, out: TextIO | None = None, err: TextIO | None = None) -> int:
    from .cli import build_parser, config_from_args
    from .cli import main as headline_main

    out = out or sys.stdout
    err = err or sys.stderr
    p = argparse.ArgumentParser(
        prog="python -m collm_bench headline-repeat",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--repeats", type=int, default=3, help="repetitions (default 3)")
    ours, rest = p.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    if ours.repeats < 1:
        err.write("collm-bench headline-repeat: --repeats must be >= 1\n")
        return 2
    try:
        cfg: HeadlineConfig = config_from_args(build_parser().parse_args(rest))
    except (SystemExit, ValueError) as exc:
        err.write(f"collm-bench headline-repeat: {exc}\n")
        return 2
    root = Path(cfg.out_dir) / f"repeat-{time.strftime('%Y%m%d-%H%M%S')}"
    base = list(rest)
    results: list[dict[str, Any]] = []
    paths: list[str] = []
    rc = 0
    for k in range(ours.repeats):
        order = rotated(list(cfg.policies), k)
        rep_dir = root / f"rep{k + 1}"
        argv_k = [*base, "--policies", ",".join(order), "--out-dir", str(rep_dir)]
        out.write(f"[headline-repeat] repetition {k + 1} of {ours.repeats}: policies {','.join(order)}\n")
        out.flush()
        rc = max(rc, headline_main(argv_k, out, err))
        found = _newest_results(rep_dir)
        if found is None:
            err.write(f"collm-bench headline-repeat: repetition {k + 1} wrote no results.json\n")
            return rc or 1
        results.append(json.loads(found.read_text(encoding="utf-8")))
        paths.append(str(found))
    summary = summarize_repeats(results) | {"results": paths, "argv": base}
    (root / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n", encoding="utf-8")
    md = markdown_repeats(summary)
    (root / "summary.md").write_text(md + "\n", encoding="utf-8")
    out.write("\n" + md + "\n")
    out.write(f"[headline-repeat] {root / 'summary.json'}\n")
    return rc
