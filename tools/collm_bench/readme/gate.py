"""The promotion gate's noise (collm_bench.gate.noise, result bench/results/gate/noise.json): the split
analysis of the per-example losses and its tables (pure; deterministic for a seed)."""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from typing import Any

# The gate's rules compared: (z, minimum gain in nats/token).
# (z, minimum gain): lower at all, the default, a stricter minimum.
RULES = [(0.0, 0.0), (2.0, 0.001), (2.0, 0.005)]


def paired(cand: list[float], cur: list[float], tokens: list[int], idx: list[int]) -> tuple[float, float]:
    d = [cand[i] - cur[i] for i in idx]
    t = [tokens[i] for i in idx]
    tot = sum(t)
    diff = sum(d) / tot
    n = len(d)
    se = math.sqrt(n / (n - 1) * sum((di - diff * ti) ** 2 for di, ti in zip(d, t, strict=True))) / tot
    return diff, se


def analyse(
    cand: list[float], cur: list[float], tokens: list[int], k: int, draws: int, seed: int = 0
) -> dict[str, dict[str, float]]:
    """Per rule: the share of random splits whose gate sample (k examples) publishes, and the share of
    those publications whose other examples show no gain (paired change >= 0)."""
    rng = random.Random(seed)
    n = len(tokens)
    published = dict.fromkeys(RULES, 0)
    false = dict.fromkeys(RULES, 0)
    for _ in range(draws):
        order = list(range(n))
        rng.shuffle(order)
        gate, rest = order[:k], order[k:]
        diff, se = paired(cand, cur, tokens, gate)
        rest_diff = paired(cand, cur, tokens, rest)[0] if len(rest) >= 2 else diff
        for z, g in RULES:
            if diff + z * se <= -g:
                published[(z, g)] += 1
                false[(z, g)] += rest_diff >= 0
    return {
        f"z={z:g},min_gain={g:g}": {
            "publish": published[(z, g)] / draws,
            "false": false[(z, g)] / published[(z, g)] if published[(z, g)] else 0.0,
        }
        for z, g in RULES
    }


COMPARISONS = {"A over B": ("a", "b"), "B over A": ("b", "a"), "A over base": ("a", "base")}


def table(result: Mapping[str, Any]) -> str:
    k, draws = result["gate_examples"], result["draws"]
    lines = [
        f"Candidates trained {result['tokens']} tokens each at lr {result['lr']:g}; gate sample {k} held-out "
        f"examples, the rest out of sample; {draws} random splits.",
        "",
        "| domain | numeric floor (nats/token) | base loss | A - base (all) | A - B (all) |",
        "|---|---:|---:|---:|---:|",
    ]
    analyses = {}
    for d, r in result["domains"].items():
        a0, ab = r["a_vs_base_full"], r["a_vs_b_full"]
        lines.append(
            f"| {d} | {r['numeric_floor_nats_per_token']:.1e} | {r['base_loss']:.3f} | "
            f"{a0['diff_nats']:+.4f} +- {a0['se_nats']:.4f} | {ab['diff_nats']:+.4f} +- {ab['se_nats']:.4f} |"
        )
        ex = r["examples"]
        analyses[d] = {
            name: analyse(ex[c], ex[u], ex["tokens"], k, draws) for name, (c, u) in COMPARISONS.items()
        }
    lines += [
        "",
        "Share of splits whose gate sample publishes / of those, the share no better on the other examples:",
        "",
        "| domain | comparison | change (all examples) | "
        + " | ".join(f"z={z:g}, min {g:g}" for z, g in RULES)
        + " |",
        "|---|---|---:|" + "---:|" * len(RULES),
    ]
    for d, by in analyses.items():
        ex = result["domains"][d]["examples"]
        for name, (c, u) in COMPARISONS.items():
            diff, se = paired(ex[c], ex[u], ex["tokens"], list(range(len(ex["tokens"]))))
            cells = []
            for z, g in RULES:
                r = by[name][f"z={z:g},min_gain={g:g}"]
                cells.append(f"{100 * r['publish']:.0f}% / {100 * r['false']:.0f}%")
            lines.append(f"| {d} | {name} | {diff:+.4f} +- {se:.4f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
