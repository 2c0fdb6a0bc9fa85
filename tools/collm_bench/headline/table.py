"""Figures of a run, the ratios collm / each baseline, the goals, and the one Markdown table (pure).

Definitions (docs/architecture.md, Goodput and SLO attainment, and Served quality): goodput = good
requests / run duration, a request being good when it completes without error with TTFT and TPOT
within its SLO; attainment = good / submitted. Quality gain
of a served request = base-model held-out loss - held-out loss of the version that served it, on the
request's domain (nats per token); "end" is the mean over domains of the gain of the version that
served each domain's last request, "mean" the average over every completed request.

The best baseline at a rate is the baseline with the highest live goodput there (also reported: the
baseline with the most served quality gain); the best co-located baseline the better of fixed_ratio
and leftover. Goals (issue 6): collm goodput >= 3x separate and
>= 1.3x the best co-located baseline, with served quality gain >= 0.9x the best baseline's; the
simulator's goodput within 25% of the live one for every policy.

A reference run (`serving_only`: collm with fine-tuning off), when asked for, is no baseline: it is
the practical ceiling of what a co-located policy can serve, so beside each goodput goal stands what
serving only reaches against the same baseline (`ceiling`), and collm's goodput as a fraction of it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from collm_common.stats import ratio

from .config import BASELINES, CO_LOCATED, REFERENCES

GOALS = {
    "goodput_vs_separate": 3.0,
    "goodput_vs_best_colocated": 1.3,
    "quality_end_vs_best_baseline": 0.9,
    "quality_mean_vs_best_baseline": 0.9,
    "quality_end_vs_best_quality_baseline": 0.9,
}
SIM_TOLERANCE = 0.25


def compact(summary: Mapping[str, Any], extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The figures of one run (live or simulated) that the table shows, from a collm-bench summary."""
    lat = summary["latency_ms"]
    q = summary.get("quality") or {}
    tl = summary.get("timeline") or {}
    out = {
        "submitted": summary["counts"]["submitted"],
        "good": summary["counts"]["good"],
        "by_status": summary["counts"]["by_status"],
        "duration_s": summary["duration_s"],
        "goodput_rps": summary["goodput_rps"],
        "attainment": summary["attainment"],
        "ttft_ms_p50": lat["ttft"]["p50"],
        "ttft_ms_p99": lat["ttft"]["p99"],
        "tpot_ms_p50": lat["tpot"]["p50"],
        "tpot_ms_p99": lat["tpot"]["p99"],
        "quality_gain_end": q.get("final_quality_gain"),
        "quality_gain_mean": q.get("mean_quality_gain"),
        "quality_joined": q.get("requests_joined"),
        "versions_served": q.get("versions_served"),
        "timeline": {
            "t_s": tl.get("t_s", []),
            "goodput_rps": tl.get("goodput_rps", []),
            "mean_quality_gain": tl.get("mean_quality_gain", []),
        },
    }
    if extra:
        out.update(extra)
    return out


def compare(
    live: Mapping[str, Mapping[str, Any]], sim: Mapping[str, Mapping[str, Any]] | None
) -> dict[str, Any]:
    """Ratios collm / each baseline (live), the goals, and the simulator's error per policy."""
    out: dict[str, Any] = {"goodput_ratio": {}, "quality_end_ratio": {}, "quality_mean_ratio": {}}
    c = live.get("collm")
    baselines = [b for b in BASELINES if b in live]
    if c is not None:
        for b in baselines:
            out["goodput_ratio"][b] = ratio(c["goodput_rps"], live[b]["goodput_rps"])
            out["quality_end_ratio"][b] = ratio(c["quality_gain_end"], live[b]["quality_gain_end"])
            out["quality_mean_ratio"][b] = ratio(c["quality_gain_mean"], live[b]["quality_gain_mean"])
    best = max(baselines, key=lambda b: live[b]["goodput_rps"] or 0.0) if baselines else None
    co = [b for b in CO_LOCATED if b in live]
    best_co = max(co, key=lambda b: live[b]["goodput_rps"] or 0.0) if co else None
    # The stricter reading of "the best baseline's quality": the baseline with the most quality gain.
    best_q = max(baselines, key=lambda b: live[b]["quality_gain_end"] or 0.0) if baselines else None
    out["best_baseline"] = best
    out["best_colocated"] = best_co
    out["best_quality_baseline"] = best_q
    reached = {
        "goodput_vs_separate": out["goodput_ratio"].get("separate"),
        "goodput_vs_best_colocated": out["goodput_ratio"].get(best_co) if best_co else None,
        "quality_end_vs_best_baseline": out["quality_end_ratio"].get(best) if best else None,
        "quality_mean_vs_best_baseline": out["quality_mean_ratio"].get(best) if best else None,
        "quality_end_vs_best_quality_baseline": out["quality_end_ratio"].get(best_q) if best_q else None,
    }
    out["goals"] = {
        k: {"goal": g, "reached": reached[k], "met": reached[k] is not None and reached[k] >= g}
        for k, g in GOALS.items()
    }
    ceiling = next((live[r] for r in REFERENCES if r in live), None)
    if ceiling is not None:
        against = {"goodput_vs_separate": "separate", "goodput_vs_best_colocated": best_co}
        for k, b in against.items():
            if b in live:
                out["goals"][k]["ceiling"] = ratio(ceiling["goodput_rps"], live[b]["goodput_rps"])
        out["collm_vs_ceiling"] = ratio(c["goodput_rps"], ceiling["goodput_rps"]) if c else None
    if sim:
        err = {}
        for p, s in sim.items():
            lv = live.get(p)
            if lv is None or not lv["goodput_rps"]:
                err[p] = None
                continue
            err[p] = (s["goodput_rps"] - lv["goodput_rps"]) / lv["goodput_rps"]
        out["sim_error"] = err
        known = [abs(e) for e in err.values() if e is not None]
        out["sim_within_tolerance"] = bool(known) and all(e <= SIM_TOLERANCE for e in known)
        # Whether the live goodput lies within the simulator's range over the speed probe's ratios.
        out["sim_range_covers"] = {
            p: lo <= live[p]["goodput_rps"] <= hi
            for p, s in sim.items()
            if p in live and live[p]["goodput_rps"] is not None and "goodput_range" in s
            for lo, hi in [s["goodput_range"]["range_rps"]]
        }
        sc = sim.get("collm")
        out["sim_goodput_ratio"] = {
            b: ratio(sc["goodput_rps"], sim[b]["goodput_rps"]) for b in BASELINES if sc and b in sim
        }
    return out


def _n(v: float | None, spec: str = ".3f") -> str:
    if v is None:
        return "-"
    if v == float("inf"):
        return "inf"
    return f"{v:{spec}}"


def _pair(a: float | None, b: float | None, scale: float = 1.0, spec: str = ".0f") -> str:
    return f"{_n(None if a is None else a * scale, spec)} / {_n(None if b is None else b * scale, spec)}"


HEADER = (
    "| trace | rate (req/s) | policy | goodput (req/s) | sim goodput (err; range) | SLO attainment "
    "| TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | ft tokens | rounds published / ended "
    "| quality gain end / mean (nats) |"
)


def _row(trace: str, rate: str, policy: str, lv: Mapping[str, Any] | None, sm: Any, err: Any) -> str:
    sim = "-"
    if sm is not None:
        pct = None if err is None else err * 100
        span = sm.get("goodput_range", {}).get("range_rps")
        within = f"; {_n(span[0])}-{_n(span[1])}" if span else ""
        sim = (
            f"{_n(sm['goodput_rps'])} ({_n(pct, '+.0f')}%{within})"
            if lv is not None
            else _n(sm["goodput_rps"])
        )
    if lv is None:
        att = _n(sm["attainment"]) if sm else "-"
        ft = _n(sm.get("ft_tokens"), ".0f") if sm else "-"
        return f"| {trace} | {rate} | {policy} | (not run live) | {sim} | {att} (sim) | | | {ft} (sim) | | |"
    rounds = lv.get("rounds") or {}
    ended = sum(rounds.get(k, 0) for k in ("published", "held_back", "aborted"))
    cells = [
        trace,
        rate,
        policy,
        _n(lv["goodput_rps"]),
        sim,
        f"{_n(lv['attainment'])} ({lv['good']}/{lv['submitted']})",
        _pair(lv["ttft_ms_p50"], lv["ttft_ms_p99"]),
        _pair(lv["tpot_ms_p50"], lv["tpot_ms_p99"]),
        _n(lv.get("ft_tokens"), ".0f"),
        f"{rounds.get('published', 0)} / {ended}",
        f"{_n(lv['quality_gain_end'], '.4f')} / {_n(lv['quality_gain_mean'], '.4f')}",
    ]
    return "| " + " | ".join(cells) + " |"


def _ratios_note(where: str, cmp_: Mapping[str, Any]) -> str:
    def three(d: Mapping[str, Any]) -> str:
        return ", ".join(_n(d.get(b), ".2f") for b in BASELINES)

    def ceiling(v: Mapping[str, Any]) -> str:
        return f"; serving only {_n(v['ceiling'], '.2f')}" if "ceiling" in v else ""

    goals = "; ".join(
        f"{k} {_n(v['reached'], '.2f')} (>= {v['goal']}: {'met' if v['met'] else 'missed'}{ceiling(v)})"
        for k, v in cmp_["goals"].items()
    )
    text = (
        f"* {where}: collm / {', '.join(BASELINES)}: goodput {three(cmp_['goodput_ratio'])}; "
        f"quality gain end {three(cmp_['quality_end_ratio'])}; mean {three(cmp_['quality_mean_ratio'])} "
        f"(best baseline by goodput: {cmp_.get('best_baseline')}; by quality: "
        f"{cmp_.get('best_quality_baseline')}). Goals: {goals}"
    )
    if "collm_vs_ceiling" in cmp_:
        text += f". collm / serving only (fine-tuning off): {_n(cmp_['collm_vs_ceiling'], '.2f')}"
    if "sim_error" in cmp_:
        ok = "yes" if cmp_.get("sim_within_tolerance") else "no"
        text += f". Simulator within {SIM_TOLERANCE:.0%} of the live goodput for every policy: {ok}"
        covers = cmp_.get("sim_range_covers") or {}
        if covers:
            inside = [p for p, c in covers.items() if c]
            text += (
                f"; the live goodput within the simulated range (costs at the probe's lowest and highest "
                f"ratio): {', '.join(inside) or 'none'} of {len(covers)}"
            )
    return text


def markdown(results: Mapping[str, Any]) -> str:
    """The benchmark's one table (per trace and rate, one row per policy), then ratios, goals and how
    each rate was found."""
    lines: list[str] = [HEADER, "|" + "---|" * 11]
    notes: list[str] = []
    for tr in results["traces"]:
        for label, block in tr["rates"].items():
            runs = block.get("runs", {})
            cmp_ = block.get("compare") or {}
            rate = f"{label} {block['rate_rps']:.3f}"
            for p, run in runs.items():
                err = cmp_.get("sim_error", {}).get(p)
                lines.append(_row(tr["label"], rate, p, run.get("live"), run.get("sim"), err))
            where = f"{tr['label']}, {label} ({block['rate_rps']:.3f} req/s)"
            if cmp_.get("goodput_ratio"):
                notes.append(_ratios_note(where, cmp_))
            choice = block.get("choice")
            if choice:
                notes.append(
                    f"* {where}, found with the simulator: {choice['how']}; there the simulated best "
                    f"baseline ({choice['best_baseline']}) attains {choice['attainment']:.3f} "
                    f"(target >= {choice['target']:.2f})" + _live_confirm(runs, label, choice["target"])
                )
            elif block.get("given"):
                notes.append(f"* {where}: rate given on the command line")
        notes += [f"* {tr['label']}: {n}" for n in tr.get("notes", [])]
    return "\n".join([*lines, "", *notes])


def _live_confirm(runs: Mapping[str, Any], label: str, target: float) -> str:
    """What the live run says about the rate: the best baseline's live attainment against the target."""
    live = {p: r["live"] for p, r in runs.items() if r.get("live")}
    base = [b for b in BASELINES if b in live]
    if not base:
        return ""
    best = max(base, key=lambda b: live[b]["attainment"] or 0.0)
    a = live[best]["attainment"] or 0.0
    if label == "light":
        verdict = "confirmed" if a >= target else f"not confirmed live: {a - target:+.3f}"
    else:  # heavy: near the target
        verdict = "near it" if abs(a - target) <= 0.05 else f"off by {a - target:+.3f}"
    return f"; live, the best baseline by attainment ({best}) attains {a:.3f} ({verdict})"
