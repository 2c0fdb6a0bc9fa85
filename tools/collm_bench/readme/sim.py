"""Tables and plots of the simulator's benchmarks (bench/sim/*.py, results in bench/results/sim/)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

POLICIES = ("collm", "separate", "fixed_ratio", "leftover")
REFERENCE = "serving_only"  # collm's coordinator with fine-tuning off: no baseline, the practical ceiling
TARGET_ATTAINMENT = 0.9


def f(x: Any, nd: int = 2) -> str:
    """A figure for a table cell: `-` when absent, floats to `nd` decimals."""
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def sweep_table(doc: Mapping[str, Any]) -> str:
    """Per trace and cluster size: SLOs, sustained rates, the crossing and the policies there; then the
    goals, one column each (the ratio reached, met or not, and serving_only's against the same baseline)."""
    out = [
        "| trace / replicas | SLO TTFT / TPOT ms | sustained rate at >= 90% (req/s): collm / separate / "
        f"fixed_ratio / leftover ({REFERENCE}) | best baseline | crossing rate (req/s) | goodput at crossing "
        f"(req/s): collm / separate / fixed_ratio / leftover ({REFERENCE}) | quality gain per hour at "
        "crossing (nats/h): collm / separate / fixed_ratio / leftover |",
        "|---|---|---|---|---|---|---|",
    ]
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
    # The goals: one column each, a row per trace and size; a cell is the ratio reached, whether it meets
    # the goal, and in parentheses serving_only's ratio against the same baseline where there is one.
    goals = list(next(iter(doc["configs"].values()))["analysis"]["goals"].items()) if doc["configs"] else []
    out += [
        "",
        "| trace / replicas | " + " | ".join(f"{name} >= {g['goal']}" for name, g in goals) + " |",
        "|---|" + "---|" * len(goals),
    ]
    for key, c in doc["configs"].items():
        cells = []
        for name, _ in goals:
            g = c["analysis"]["goals"][name]
            ref = f" ({f(g[REFERENCE])})" if g.get(REFERENCE) is not None else ""
            cells.append(f"{f(g['reached'])} {'yes' if g['met'] else 'no'}{ref}")
        out.append(f"| {key} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def plot_sweep_config(
    label: str, rows: list[Mapping[str, Any]], analysis: Mapping[str, Any], path: Path
) -> None:
    """Goodput, attainment and quality gain per hour against the rate, one line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    series = [*POLICIES, *sorted({str(r["policy"]) for r in rows} - set(POLICIES))]
    for p in series:
        pts = sorted(((r["rate_rps"], r) for r in rows if r["policy"] == p), key=lambda xr: xr[0])
        if not pts:
            continue
        xs = [x for x, _ in pts]
        reference = p not in POLICIES
        style = {"color": "grey", "linestyle": "--", "marker": "."} if reference else {"marker": "o"}
        axes[0].plot(xs, [r["goodput_rps"] or 0 for _, r in pts], label=p, **style)
        axes[1].plot(xs, [r["attainment"] or 0 for _, r in pts], label=p, **style)
        if not reference:  # a reference trains nothing: no quality gain
            axes[2].plot(xs, [r["quality_gain_per_hour"] or 0 for _, r in pts], label=p, **style)
    axes[1].axhline(TARGET_ATTAINMENT, color="grey", linestyle="--", linewidth=1)
    if analysis.get("crossing_rate_rps"):
        for ax in axes:
            ax.axvline(analysis["crossing_rate_rps"], color="grey", linestyle=":", linewidth=1)
    axes[0].set_ylabel("goodput (req/s)")
    axes[1].set_ylabel("SLO attainment")
    axes[2].set_ylabel("quality gain per hour (nats/h)")
    for ax in axes:
        ax.set_xlabel("arrival rate (req/s)")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(f"simulated {label}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def sweep_plots(doc: Mapping[str, Any]) -> dict[str, Callable[[Path], None]]:
    """One plot per configuration, named by its trace and size (`_conv_8`)."""
    out: dict[str, Callable[[Path], None]] = {}
    for c in doc["configs"].values():
        label = f"{c['trace']}, {c['replicas']} replicas"

        def draw(path: Path, c: Mapping[str, Any] = c, label: str = label) -> None:
            plot_sweep_config(label, c["grid"], c["analysis"], path)

        out[f"_{c['trace']}_{c['replicas']}"] = draw
    return out


def speed_table(doc: Mapping[str, Any]) -> str:
    """Simulated seconds per wall second at each cluster size (the whole run: routing, ticks, rounds)."""
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


def routing_table(doc: Mapping[str, Any]) -> str:
    """collm with its routing weights not published (least-loaded routing) and published, by rate."""
    by = {(r["rate_rps"], r["publish_weights"]): r for r in doc["runs"]}
    out = [
        "| rate (req/s) | goodput / attainment / ft tokens, weights not published | ... published |",
        "|---|---|---|",
    ]
    for rate in sorted({r["rate_rps"] for r in doc["runs"]}):
        cells = [
            "-"
            if (r := by.get((rate, pub))) is None
            else f"{r['goodput_rps']:.3f} / {r['attainment']:.3f} / {r['ft_tokens']}"
            for pub in (False, True)
        ]
        out.append(f"| {rate:.3f} | {cells[0]} | {cells[1]} |")
    return "\n".join(out)
