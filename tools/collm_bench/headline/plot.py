"""The benchmark's figure: goodput and served quality gain over time, per policy (one row per trace and
rate). Bins are the summaries' timeline bins (by request end time)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .config import REFERENCES

COLORS = {
    "collm": "tab:red",
    "separate": "tab:blue",
    "fixed_ratio": "tab:green",
    "leftover": "tab:orange",
    "serving_only": "grey",  # the reference run: fine-tuning off
}


def plot(results: Mapping[str, Any], path: Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        (tr["label"], label, block)
        for tr in results["traces"]
        for label, block in tr["rates"].items()
        if any(r.get("live") for r in block.get("runs", {}).values())
    ]
    if not panels:
        return None
    fig, axes = plt.subplots(len(panels), 2, figsize=(12, 3.4 * len(panels)), squeeze=False)
    for row, (trace, label, block) in enumerate(panels):
        ax_g, ax_q = axes[row]
        for policy, run in block["runs"].items():
            lv = run.get("live")
            if not lv:
                continue
            tl = lv["timeline"]
            color = COLORS.get(policy)
            style = {"color": color, "linestyle": "--" if policy in REFERENCES else "-", "label": policy}
            ax_g.plot(tl["t_s"], tl["goodput_rps"], drawstyle="steps-post", **style)
            qs = [(t, q) for t, q in zip(tl["t_s"], tl["mean_quality_gain"], strict=False) if q is not None]
            if qs:
                ax_q.plot([t for t, _ in qs], [q for _, q in qs], marker=".", color=color, label=policy)
        title = f"{trace}, {label} ({block['rate_rps']:.3f} req/s)"
        ax_g.set_title(f"goodput, {title}", fontsize=10)
        ax_q.set_title(f"served quality gain, {title}", fontsize=10)
        ax_g.set_ylabel("good requests / s")
        ax_q.set_ylabel("base loss - served loss (nats)")
        for ax in (ax_g, ax_q):
            ax.set_xlabel("time since the first arrival (s)")
            ax.grid(alpha=0.3)
        ax_g.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
