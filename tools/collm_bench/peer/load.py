"""The one load client of the peer comparisons: the same prompts and the same streamed requests for every
server, C streams at a time, and the figures of each concurrency level.

Prompts are cut from the responses of the committed demo data (data/demo/medical) with the model's own
tokenizer: windows of `prompt_tokens` tokens at distinct offsets, decoded to text, so no request shares a
prefix with another and no server's prompt cache serves one from another. Every request goes to
`/v1/completions` (the raw prompt, no chat template: both servers see the same tokens), greedy, streamed
with usage, `max_tokens` = the output length and `ignore_eos`, through `collm_bench.runner.run_plan` with
`max_concurrency` = C and every request due at once: C streams run from the start and each finished one
is replaced at once by the next until all are sent. `summarise` turns a level's records into its figures
(pure).
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from collm_bench.groups import REPO
from collm_common.stats import percentile
from collm_workload.goodput import record_tpot_ms
from collm_workload.records import RequestRecord
from collm_workload.workload import PlannedRequest

CORPUS = REPO / "data" / "demo" / "medical" / "train" / "medical.jsonl"


def corpus_text(path: Path = CORPUS) -> str:
    """The responses of a JSONL dataset, one paragraph each: the text the prompts are cut from."""
    rows = (json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip())
    return "\n\n".join(str(row["response"]) for row in rows)


def token_windows(ids: Sequence[int], n: int, length: int, seed: int) -> list[list[int]]:
    """`n` windows of `length` tokens of `ids` at distinct offsets drawn with `seed` (ValueError when `ids`
    has fewer offsets than `n`)."""
    offsets = len(ids) - length + 1
    if offsets < n:
        raise ValueError(f"{len(ids)} tokens hold no {n} distinct windows of {length}")
    return [list(ids[o : o + length]) for o in random.Random(seed).sample(range(offsets), n)]


def make_prompts(model: Path, n: int, prompt_tokens: int, seed: int) -> list[str]:
    """`n` distinct prompts of about `prompt_tokens` tokens of `model`'s tokenizer (a .gguf file)."""
    from collm_workload.tokens import HFTokenizerCounter

    tok = HFTokenizerCounter.load(model).tok
    ids = tok.encode(corpus_text(), add_special_tokens=False)
    return [str(tok.decode(w)) for w in token_windows(ids, n, prompt_tokens, seed)]


def plan(prompts: Sequence[str], model: str, output_tokens: int, tag: str) -> list[PlannedRequest]:
    """One request per prompt, all due at time 0, each for `output_tokens` tokens."""
    return [
        PlannedRequest(
            request_id=f"{tag}-{i}",
            index=i,
            scheduled_s=0.0,
            domain="peer",
            model=model,
            prompt=p,
            target_input_tokens=0,
            estimated_input_tokens=0,
            max_tokens=output_tokens,
            slo_ttft_ms=None,
            slo_tpot_ms=None,
        )
        for i, p in enumerate(prompts)
    ]


def served_model(base_url: str) -> str:
    """The first model `GET /v1/models` of the server at `base_url` lists."""
    r = httpx.get(f"{base_url}/v1/models", timeout=30.0, trust_env=False)
    r.raise_for_status()
    return str(r.json()["data"][0]["id"])


def run_level(
    base_url: str, requests: Sequence[PlannedRequest], concurrency: int, timeout_s: float
) -> tuple[list[RequestRecord], float]:
    """Send `requests` to `base_url`'s `/v1/completions`, `concurrency` streams at a time; every record and
    the seconds from the first send to the last answer."""
    from collm_bench.client import ClientOptions, endpoint_url
    from collm_bench.runner import run_plan

    opts = ClientOptions(
        url=endpoint_url(base_url, "completions"),
        endpoint="completions",
        ignore_eos=True,
        temperature=0.0,
        request_timeout_s=timeout_s,
    )
    result = asyncio.run(run_plan(requests, opts, max_concurrency=concurrency, progress_interval_s=None))
    return result.records, result.wall_s


def _round(x: float | None, digits: int = 1) -> float | None:
    return None if x is None else round(x, digits)


def summarise(records: Sequence[RequestRecord], wall_s: float, concurrency: int) -> dict[str, Any]:
    """One level's figures: requests and how many completed, output tokens per second of wall time (the
    completed requests' tokens, by the server's usage), TTFT p50/p99 and TPOT p50 of the completed ones
    (ms), their mean prompt tokens (usage), and the first error when some request failed."""
    ok = [r for r in records if r.status == "ok"]
    tokens = sum(r.completion_tokens or 0 for r in ok)
    ttft = [r.ttft_ms for r in ok if r.ttft_ms is not None]
    tpot = [t for t in (record_tpot_ms(r) for r in ok) if t is not None]
    prompt = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    failed = [r for r in records if r.status != "ok"]
    out: dict[str, Any] = {
        "concurrency": concurrency,
        "requests": len(records),
        "ok": len(ok),
        "wall_s": round(wall_s, 2),
        "output_tokens": tokens,
        "output_tok_s": round(tokens / wall_s, 2) if wall_s > 0 else None,
        "ttft_ms_p50": _round(percentile(ttft, 50)),
        "ttft_ms_p99": _round(percentile(ttft, 99)),
        "tpot_ms_p50": _round(percentile(tpot, 50), 2),
        "prompt_tokens_mean": _round(sum(prompt) / len(prompt)) if prompt else None,
    }
    if failed:
        out["first_error"] = f"{failed[0].status}: {failed[0].error}"[:200]
    return out
