"""The result of `python -m collm_bench peer llamacpp` (bench/results/peer/llamacpp.json): its schema, the
ratios of each CoLLM server to llama.cpp F16, and its table (the `peer-llamacpp` kind of `collm_bench
readme`). Pure functions of the parsed JSON; a result without `collm-train` renders as one from before
that server existed."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from collm_bench.host import flags_phrase, products_phrase

SCHEMA = "collm-peer-llamacpp/1"
# The servers, in the order they run and show, with the label the table gives them.
LABELS = {
    "llamacpp-f16": "llama.cpp F16",
    "llamacpp-f32": "llama.cpp F32",
    "collm": "CoLLM",
    "collm-train": "CoLLM + training",
}
LLAMACPP = ("llamacpp-f16", "llamacpp-f32")  # the servers that need llama.cpp's build
COLLM = ("collm", "collm-train")  # the servers each given a ratio column over the baseline
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


def _cell(lv: Mapping[str, Any] | None) -> str:
    """One server at one concurrency: tokens/s, TTFT p50 / p99 (s), TPOT p50 (ms); `*` when some request
    did not complete; the fine-tuning tokens trained during the level where the level counts them."""
    if lv is None:
        return "-"
    ttft = f"{_n(_s(lv['ttft_ms_p50']), '.2f')} / {_n(_s(lv['ttft_ms_p99']), '.2f')} s"
    star = "" if lv["ok"] == lv["requests"] else "*"
    ft = f"; {lv['ft_tokens']} FT tokens" if lv.get("ft_tokens") is not None else ""
    return f"{_n(lv['output_tok_s'], '.1f')}{star}, {ttft}, {_n(lv['tpot_ms_p50'], '.1f')} ms{ft}"


def _ratio(v: Mapping[str, Any]) -> str:
    """One ratio cell: tokens/s (bold) and TPOT over the baseline's; `-` where the baseline did not run."""
    return f"**{_n(v.get('output_tok_s'), '.2f')}x**, {_n(v.get('tpot_ms_p50'), '.2f')}x" if v else "-"


def _s(ms: float | None) -> float | None:
    return None if ms is None else ms / 1e3


def _precision(collm: Mapping[str, Any], host: Mapping[str, Any]) -> str:
    """`; <dtype> products (CPU: <flags>)`, or nothing for a result that did not record the precision."""
    dtype = collm.get("matmul_dtype")
    if dtype is None:
        return ""
    return f"; {products_phrase(dtype, collm.get('small_step_f16_rows'))} (CPU: {flags_phrase(host)})"


def table(doc: Mapping[str, Any]) -> str:
    """Per concurrency (rows) and server (columns, in the order they ran): output tokens/s, TTFT p50 / p99
    and TPOT p50 (and the fine-tuning tokens of `collm-train`); per CoLLM server that ran (CoLLM alone
    when neither did), its tokens/s and TPOT over llama.cpp F16's; then the host and workload."""
    names = list(doc["servers"])
    levels = {n: {lv["concurrency"]: lv for lv in run["levels"]} for n, run in doc["servers"].items()}
    cs = sorted({c for lv in levels.values() for c in lv})
    over = [n for n in COLLM if n in names] or ["collm"]
    r = {n: ratios(doc["servers"], over=n) for n in over}
    lines = [
        f"Per server: output tok/s, TTFT p50 / p99, TPOT p50; over {LABELS[BASELINE]} (/ F16): tok/s, TPOT.",
        "",
        "| streams | "
        + " | ".join(LABELS.get(n, n) for n in names)
        + "".join(f" | {LABELS[n]} / F16" for n in over)
        + " |",
        "|---:|" + "---|" * len(names) + "---:|" * len(over),
    ]
    for c in cs:
        cells = [_cell(levels[n].get(c)) for n in names] + [_ratio(r[n].get(str(c), {})) for n in over]
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    lines.append("")
    if any(lv["ok"] < lv["requests"] for run in levels.values() for lv in run.values()):
        lines += ["* some requests did not complete.", ""]
    w, ll, host, collm = doc["workload"], doc["llamacpp"], doc["host"], doc["collm"]
    train = f"; {LABELS['collm-train']}: {collm['train_command']}" if "collm-train" in names else ""
    lines.append(
        f"{host['cpu']} ({host['cpus']} CPUs). {w['prompt_tokens']}-token prompts, "
        f"{w['output_tokens']} tokens out (ignore_eos, greedy, streamed, /v1/completions), C streams at "
        f"a time. llama-server {ll['version']}: -t {ll['threads']} -np {ll['parallel']} -c {ll['context']} "
        f"--cont-batching; CoLLM: {collm['command']}{train}{_precision(collm, host)}."
    )
    return "\n".join(lines)
