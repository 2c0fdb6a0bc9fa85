"""The result of `python -m collm_bench peer llamacpp` (bench/results/peer/llamacpp.json): its schema, the
ratios of CoLLM to llama.cpp F16, and its table (the `peer-llamacpp` kind of `collm_bench readme`).
Pure functions of the parsed JSON."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

SCHEMA = "collm-peer-llamacpp/1"
# The servers, in the order they run and show, with the label the table gives them.
LABELS = {"llamacpp-f16": "llama.cpp F16", "llamacpp-f32": "llama.cpp F32", "collm": "CoLLM"}
BASELINE = "llamacpp-f16"
# The figures the ratios compare (CoLLM's over the baseline's: above 1 is more tokens/s, or slower).
RATIO_FIGURES = ("output_tok_s", "ttft_ms_p50", "tpot_ms_p50")


def ratios(servers: Mapping[str, Mapping[str, Any]], over: str = "collm") -> dict[str, dict[str, Any]]:
    """Per concurrency both ran (its string), `over`'s figures divided by `BASELINE`'s (2 decimals; None
    where one of them is missing or the baseline's is 0). Empty unless both servers ran."""
    if over not in servers or BASELINE not in servers:
        return {}
    base = {lv["concurrency"]: lv for lv in servers[BASELINE]["levels"]}
    out: dict[str, dict[str, Any]] = {}
    for lv in servers[over]["levels"]:
        b = base.get(lv["concurrency"])
        if b is None:
            continue
        out[str(lv["concurrency"])] = {
            k: round(lv[k] / b[k], 2) if lv.get(k) is not None and b.get(k) else None for k in RATIO_FIGURES
        }
    return out


def _n(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _row(label: str, lv: Mapping[str, Any]) -> str:
    cells = [
        label,
        str(lv["concurrency"]),
        f"{lv['ok']}/{lv['requests']}",
        _n(lv["output_tok_s"], ".1f"),
        _n(lv["ttft_ms_p50"], ".0f"),
        _n(lv["ttft_ms_p99"], ".0f"),
        _n(lv["tpot_ms_p50"], ".1f"),
    ]
    return "| " + " | ".join(cells) + " |"


def _ratio_line(r: Mapping[str, Mapping[str, Any]]) -> str:
    parts = [
        f"C={c} {_n(v['output_tok_s'], '.2f')}x tok/s, {_n(v['tpot_ms_p50'], '.2f')}x TPOT"
        for c, v in r.items()
    ]
    return f"CoLLM / {LABELS[BASELINE]}: " + "; ".join(parts) + "."


def table(doc: Mapping[str, Any]) -> str:
    """Per server and concurrency: requests completed, output tokens/s, TTFT p50 and p99, TPOT p50; then
    CoLLM over llama.cpp F16 per concurrency, and the host and workload the figures come from."""
    lines = [
        "| server | streams | done | output tok/s | TTFT p50 (ms) | TTFT p99 (ms) | TPOT p50 (ms) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, run in doc["servers"].items():  # in the order they ran
        lines += [_row(LABELS.get(name, name), lv) for lv in run["levels"]]
    lines.append("")
    if doc.get("ratios"):
        lines += [_ratio_line(doc["ratios"]), ""]
    w, ll, host = doc["workload"], doc["llamacpp"], doc["host"]
    lines.append(
        f"{host['cpu']} ({host['cpus']} CPUs). {w['prompt_tokens']}-token prompts, "
        f"{w['output_tokens']} tokens out (ignore_eos, greedy, streamed, /v1/completions), C streams at "
        f"a time. llama-server {ll['version']}: -t {ll['threads']} -np {ll['parallel']} -c {ll['context']} "
        f"--cont-batching; CoLLM: {doc['collm']['command']}."
    )
    return "\n".join(lines)
