"""Adaptation over time: each adapter's served held-out loss against the base model's (pure).

`python -m collm_bench adaptation run` (`collm_bench.adaptation_run`) starts the stack `collm up` starts (the
demo domains on every replica), drives its gateway with a trace slice or leaves it idle, and at the end reads
from the adapter store every version of every adapter with its creation time and its quality record (the
held-out loss per domain that the promotion gate measured on the replicas' held-out examples), and from the
aggregator every round. This module turns that into the result file (`RESULT_SCHEMA`), its table and its
figure.

Curve of an adapter: (seconds since the stack was ready, loss) of each version that has a quality record,
in order: the aggregator's comparable loss, chained over the same held-out sites from v1
(`collm_aggregator.quality_ledger`), so successive points compare like with like; the base loss is that
of v1, which replicas create as a zero-B LoRA (exactly the base model) and whose loss the gate records
when v2 is published. Each point carries the version's task metric when it was probed (`task`: metric,
score, examples); the summary gives v1's and the last probed version's. The served loss at time t is
the loss of the last version published at or before t. The goal (`GOAL_REL_DROP`): the served loss at
the end of the window at least 10% below the base loss, on every domain.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from collm_bench.host import host_line

RESULT_SCHEMA = "collm-adaptation/1"
GOAL_REL_DROP = 0.10


def version_points(
    versions: Sequence[Mapping[str, Any]],
    quality: Mapping[int, Mapping[str, float]],
    domain: str,
    t0_unix_s: float,
    task: Mapping[int, Mapping[str, Mapping[str, Any]]] | None = None,
) -> list[dict[str, Any]]:
    """Each version (`{"version", "created_unix_s", "source"}`) with its loss on `domain` and, when
    probed, its task metric there, by version."""
    out = []
    for v in sorted(versions, key=lambda v: int(v["version"])):
        loss = quality.get(int(v["version"]), {}).get(domain)
        t = (task or {}).get(int(v["version"]), {}).get(domain)
        out.append(
            {
                "version": int(v["version"]),
                "t_s": round(float(v["created_unix_s"]) - t0_unix_s, 2),
                "source": str(v.get("source", "")),
                "loss": None if loss is None else round(float(loss), 5),
                "task": None if t is None else _task_point(t),
            }
        )
    return out


def _task_point(t: Mapping[str, Any]) -> dict[str, Any]:
    return {"metric": str(t["metric"]), "score": round(float(t["score"]), 4), "examples": int(t["examples"])}


def task_ends(points: Sequence[Mapping[str, Any]], window_s: float) -> dict[str, Any] | None:
    """The task metric of v1 (the base model) and of the last version probed within the window."""
    probed = [p for p in points if p.get("task") and p["t_s"] <= window_s]
    base = next((p for p in probed if p["source"] == "create"), None)
    last = probed[-1] if probed else None
    if last is None:
        return None
    return {
        "metric": last["task"]["metric"],
        "base": None if base is None else base["task"]["score"],
        "last": last["task"]["score"],
        "last_version": last["version"],
        "examples": last["task"]["examples"],
    }


def base_loss(points: Sequence[Mapping[str, Any]]) -> float | None:
    """The loss of the created v1 (the base model's behaviour), when recorded."""
    for p in points:
        if p["source"] == "create" and p["loss"] is not None:
            return float(p["loss"])
    return None


def served_loss_at(points: Sequence[Mapping[str, Any]], t_s: float) -> float | None:
    """Loss of the last version published at or before `t_s` that has a record (None: none yet)."""
    loss = None
    for p in points:
        if p["t_s"] <= t_s and p["loss"] is not None:
            loss = float(p["loss"])
    return loss


def adapter_summary(points: Sequence[Mapping[str, Any]], window_s: float) -> dict[str, Any]:
    """Base and final served loss, the relative change, and when the served loss first reached the goal."""
    base = base_loss(points)
    final = served_loss_at(points, window_s)
    reached = None
    if base is not None:
        for p in points:
            if p["loss"] is not None and p["t_s"] <= window_s and p["loss"] <= base * (1 - GOAL_REL_DROP):
                reached = p["t_s"]
                break
    rel = None if base is None or final is None or base <= 0 else final / base - 1
    return {
        "base_loss": base,
        "final_loss": final,
        "rel_change": None if rel is None else round(rel, 4),
        "goal_reached_at_s": reached,
        "goal_met": rel is not None and rel <= -GOAL_REL_DROP,
        "versions_published": sum(1 for p in points if p["source"] != "create" and p["t_s"] <= window_s),
        "task": task_ends(points, window_s),
    }


def round_summary(rounds: Sequence[Mapping[str, Any]], t0_unix_s: float) -> dict[str, Any]:
    """Counts by state, and each round compactly: adapter, state, times, participants, gate's test."""
    by_state: dict[str, int] = {}
    items = []
    for r in sorted(rounds, key=lambda r: int(r["round_id"])):
        by_state[r["state"]] = by_state.get(r["state"], 0) + 1
        tl = r.get("timeline") or {}
        opened = tl.get("opened")
        ended = max(tl.values()) if tl else None
        items.append(
            {
                "round_id": int(r["round_id"]),
                "adapter": r["adapter"],
                "state": r["state"],
                "opened_s": None if opened is None else round(opened - t0_unix_s, 1),
                "duration_s": None if opened is None or ended is None else round(ended - opened, 1),
                "participants": list(r.get("participants") or []),
                "accepted": list(r.get("accepted") or []),
                "new_version": r.get("new_version"),
                "gain_diff_nats": _r(r.get("gain_diff_nats")),
                "gain_se_nats": _r(r.get("gain_se_nats")),
                "gain_examples": int(r.get("gain_examples") or 0),
            }
        )
    return {"total": len(items), "by_state": dict(sorted(by_state.items())), "rounds": items}


def _r(x: Any, digits: int = 5) -> float | None:
    return None if x is None else round(float(x), digits)


def table(result: Mapping[str, Any]) -> str:
    """The results page's table: per adapter base, final, change, when the goal was reached, versions."""
    lines = [
        "| adapter | base loss | served loss at the end | change | -10% reached at | versions published "
        "| task metric: v1 -> last probed |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for name, a in sorted(result["adapters"].items()):
        s = a["summary"]
        change = "-" if s["rel_change"] is None else f"{100 * s['rel_change']:+.1f}%"
        reached = "-" if s["goal_reached_at_s"] is None else f"{s['goal_reached_at_s'] / 60:.1f} min"
        t = s.get("task")
        task = (
            "-"
            if not t
            else f"{t['metric']} {_f(t['base'], 2)} -> {_f(t['last'], 2)} (v{t['last_version']}, "
            f"{t['examples']} examples)"
        )
        lines.append(
            f"| {name} | {_f(s['base_loss'])} | {_f(s['final_loss'])} | {change} | {reached} | "
            f"{s['versions_published']} | {task} |"
        )
    r = result["rounds"]
    states = ", ".join(f"{k} {v}" for k, v in r["by_state"].items())
    lines.append("")
    lines.append(f"Rounds: {r['total']} ({states}).")
    serving = result.get("serving")
    if serving:
        lines.append(
            f"Serving: {serving['requests']} requests at {serving['rate_rps']:.3f} req/s "
            f"({serving['load_frac']:.2f} of the estimated capacity {serving['capacity_estimate_rps']:.3f} "
            f"req/s), SLO attainment {100 * serving['attainment']:.1f}%, goodput "
            f"{serving['goodput_rps']:.3f} req/s, TTFT p50/p99 {_f(serving['ttft_ms_p50'], 0)}/"
            f"{_f(serving['ttft_ms_p99'], 0)} ms, TPOT p50/p99 {_f(serving['tpot_ms_p50'], 0)}/"
            f"{_f(serving['tpot_ms_p99'], 0)} ms."
        )
    else:
        lines.append("Serving: none (the stack otherwise idle).")
    host = result.get("host")
    if host:
        lines.append(f"Host: {host_line(host)}.")
    return "\n".join(lines)


def _f(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def plot(result: Mapping[str, Any], path: Path) -> Path:
    """Served held-out loss relative to the base, per adapter, over the window (a step per version)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.0), dpi=110)
    window = float(result["window_s"])
    for name, a in sorted(result["adapters"].items()):
        base = a["summary"]["base_loss"]
        pts = [p for p in a["versions"] if p["loss"] is not None and p["t_s"] <= window]
        if base is None or not pts:
            continue
        xs = [max(0.0, p["t_s"]) / 60 for p in pts] + [window / 60]
        ys = [100 * (p["loss"] / base - 1) for p in pts]
        ys.append(ys[-1])
        ax.step(xs, ys, where="post", label=f"{name} (base {base:.3f})")
        ax.plot(xs[:-1], ys[:-1], "o", ms=3, color=ax.lines[-1].get_color())
    ax.axhline(-100 * GOAL_REL_DROP, color="grey", ls="--", lw=1, label="goal: -10%")
    ax.set_xlabel("minutes since the stack was ready")
    ax.set_ylabel("served held-out loss vs base (%)")
    ax.set_title(str(result.get("title", "adaptation")))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
