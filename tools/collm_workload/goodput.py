"""Goodput, SLO attainment and latency statistics of a run (pure: records in, numbers out).

Definitions (docs/architecture.md, Goodput and SLO attainment; vLLM `bench serve`, DistServe):

* TTFT: time from sending the request to the first non-empty text chunk. A request that completes
  without any text has TTFT = its end-to-end latency.
* TPOT = (e2e - TTFT) / (output_tokens - 1), output_tokens from the server's `usage`. It is undefined
  for outputs of 0 or 1 token: for those only the TTFT SLO applies.
* ITL: gaps between consecutive non-empty text chunks (pooled over all completed requests).
* A request is **good** when its status is `ok` (completed without error) and its TTFT <= its TTFT SLO
  and its TPOT <= its TPOT SLO (a dimension whose SLO is unset is not checked). Rejected, dropped,
  failed and timed-out requests are never good.
* **Run duration** = from the first scheduled arrival to the later of the last request's end (its
  completion, failure, timeout or drop) and the last scheduled arrival. When every request completes
  this equals vLLM's benchmark duration (dispatch start to last completion); taking the last scheduled
  arrival too means a run whose tail requests fail fast is not credited with a shorter duration.
* goodput = good / duration (req/s); attainment = good / submitted, where submitted counts every
  request scheduled in the run, whatever became of it.
* Percentiles use numpy's linear interpolation (as vLLM does) over completed (`ok`) requests.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from collm_common import stats
from collm_common.slo import missed_slos
from collm_workload.quality import QualityTable, quality_summary, request_quality
from collm_workload.records import STATUSES, RequestRecord

SUMMARY_SCHEMA = "collm-bench-summary/1"
PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class SloOverride:
    """SLOs that replace each record's own (per dimension, when set), to re-score a run."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None


def tpot_ms(e2e_ms: float | None, ttft_ms: float | None, output_tokens: int | None) -> float | None:
    if e2e_ms is None or ttft_ms is None or output_tokens is None or output_tokens < 2:
        return None
    return (e2e_ms - ttft_ms) / (output_tokens - 1)


def record_tpot_ms(rec: RequestRecord) -> float | None:
    return tpot_ms(rec.e2e_ms, rec.ttft_ms, rec.completion_tokens)


def effective_slo(
    rec: RequestRecord, override: SloOverride | None = None
) -> tuple[float | None, float | None]:
    if override is None:
        return rec.slo_ttft_ms, rec.slo_tpot_ms
    return (
        override.ttft_ms if override.ttft_ms is not None else rec.slo_ttft_ms,
        override.tpot_ms if override.tpot_ms is not None else rec.slo_tpot_ms,
    )


def verdict(rec: RequestRecord, override: SloOverride | None = None) -> str:
    """ "good", or why not: "status:<status>", "no_ttft", "ttft", "tpot" or "ttft+tpot"."""
    if rec.status != "ok":
        return f"status:{rec.status}"
    slo_ttft, slo_tpot = effective_slo(rec, override)
    missed = missed_slos(rec.ttft_ms, record_tpot_ms(rec), slo_ttft, slo_tpot)
    return "+".join(missed) if missed else "good"


def is_good(rec: RequestRecord, override: SloOverride | None = None) -> bool:
    return verdict(rec, override) == "good"


def run_window_s(records: Sequence[RequestRecord]) -> tuple[float, float]:
    """(start, end) of the run in run-relative seconds; see the module docstring."""
    if not records:
        return 0.0, 0.0
    start = min(r.scheduled_s for r in records)
    ends = [r.end_s for r in records if r.end_s is not None]
    end = max([max(r.scheduled_s for r in records), *ends])
    return start, end


def run_duration_s(records: Sequence[RequestRecord]) -> float:
    start, end = run_window_s(records)
    return end - start


def distribution(values: Iterable[float], percentiles: Sequence[int] = PERCENTILES) -> dict[str, Any]:
    kept = [v for v in values if v is not None and math.isfinite(v)]
    xs = np.asarray(kept, dtype=float)
    out: dict[str, Any] = {"count": int(xs.size)}
    if xs.size == 0:
        out.update({"mean": None, "std": None, "min": None, "max": None})
        out.update({f"p{p}": None for p in percentiles})
        return out
    out.update(
        {"mean": float(xs.mean()), "std": float(xs.std()), "min": float(xs.min()), "max": float(xs.max())}
    )
    out.update({f"p{p}": v for p, v in zip(percentiles, stats.percentiles(kept, percentiles), strict=True)})
    return out


def _rate(n: float, duration_s: float) -> float | None:
    return n / duration_s if duration_s > 0 else None


def _ratio(n: float, d: float) -> float | None:
    return n / d if d > 0 else None


def _group_stats(
    recs: Sequence[RequestRecord], verdicts: dict[int, str], duration_s: float
) -> dict[str, Any]:
    ok = [r for r in recs if r.status == "ok"]
    good = sum(1 for r in recs if verdicts[r.index] == "good")
    ttft = distribution(r.ttft_ms for r in ok)
    tpot = distribution(record_tpot_ms(r) for r in ok)
    return {
        "submitted": len(recs),
        "completed": len(ok),
        "good": good,
        "attainment": _ratio(good, len(recs)),
        "goodput_rps": _rate(good, duration_s),
        "ttft_ms_p50": ttft["p50"],
        "ttft_ms_p99": ttft["p99"],
        "tpot_ms_p50": tpot["p50"],
        "tpot_ms_p99": tpot["p99"],
    }


def _served_by(
    ok: Sequence[RequestRecord], verdicts: dict[int, str], key: Callable[[RequestRecord], str | None]
) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for r in ok:
        d = out.setdefault(key(r) or "unknown", {"completed": 0, "good": 0})
        d["completed"] += 1
        d["good"] += verdicts[r.index] == "good"
    return dict(sorted(out.items()))


def timeline(
    records: Sequence[RequestRecord],
    verdicts: dict[int, str],
    bin_s: float,
    quality: QualityTable | None = None,
) -> dict[str, Any]:
    """Per time bin (by request end time): completed, good, goodput and the mean served quality gain."""
    if not bin_s > 0:
        raise ValueError("bin_s must be > 0")
    start, end = run_window_s(records)
    nbins = max(1, math.ceil((end - start) / bin_s))
    completed = [0] * nbins
    good = [0] * nbins
    gains: list[list[float]] = [[] for _ in range(nbins)]
    for r in records:
        if r.status != "ok" or r.end_s is None:
            continue
        b = min(nbins - 1, int((r.end_s - start) / bin_s))
        completed[b] += 1
        good[b] += verdicts[r.index] == "good"
        if quality is not None:
            gain = request_quality(r, quality)[1]
            if gain is not None:
                gains[b].append(gain)
    return {
        "bin_s": bin_s,
        "t_s": [start + i * bin_s for i in range(nbins)],
        "completed": completed,
        "good": good,
        "goodput_rps": [g / bin_s for g in good],
        "mean_quality_gain": [float(np.mean(g)) if g else None for g in gains],
    }


def summarize(
    records: Sequence[RequestRecord],
    slo: SloOverride | None = None,
    quality: QualityTable | None = None,
    timeline_bin_s: float | None = 10.0,
) -> dict[str, Any]:
    """The summary of a run (schema `collm-bench-summary/1`; see the package README)."""
    verdicts = {r.index: verdict(r, slo) for r in records}
    if len(verdicts) != len(records):
        raise ValueError("request records must have distinct indexes")
    start, end = run_window_s(records)
    duration = end - start
    ok = [r for r in records if r.status == "ok"]
    good = sum(1 for v in verdicts.values() if v == "good")
    by_status = Counter(r.status for r in records)
    reasons = Counter(v for v in verdicts.values() if v != "good")
    prompt_tokens = sum(r.prompt_tokens or 0 for r in ok)
    completion_tokens = sum(r.completion_tokens or 0 for r in ok)
    errors = Counter(f"{r.status}: {r.error}" for r in records if r.status != "ok" and r.error)
    slo_values = sorted({effective_slo(r, slo) for r in records}, key=str)
    target_ratio = [
        r.prompt_tokens / r.target_input_tokens
        for r in ok
        if r.usage_reported and r.prompt_tokens and r.target_input_tokens
    ]
    output_ratio = [
        r.completion_tokens / r.max_tokens for r in ok if r.completion_tokens is not None and r.max_tokens
    ]
    domains = sorted({r.domain for r in records})
    summary: dict[str, Any] = {
        "schema": SUMMARY_SCHEMA,
        "duration_s": duration,
        "window_s": [start, end],
        "counts": {
            "submitted": len(records),
            "completed": len(ok),
            "good": good,
            "by_status": {s: by_status.get(s, 0) for s in STATUSES},
            "not_good_by_reason": dict(sorted(reasons.items())),
        },
        "goodput_rps": _rate(good, duration),
        "attainment": _ratio(good, len(records)),
        "request_throughput_rps": _rate(len(ok), duration),
        "offered_rate_rps": _rate(len(records), duration),
        "output_throughput_tps": _rate(completion_tokens, duration),
        "total_token_throughput_tps": _rate(prompt_tokens + completion_tokens, duration),
        "slo": {
            "override": None if slo is None else {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms},
            "distinct_ttft_tpot_ms": [list(v) for v in slo_values],
        },
        "latency_ms": {
            "ttft": distribution(r.ttft_ms for r in ok),
            "tpot": distribution(record_tpot_ms(r) for r in ok),
            "itl": distribution(x for r in ok for x in r.itl_ms),
            "e2e": distribution(r.e2e_ms for r in ok),
            "client_wait": distribution(r.client_wait_ms for r in records if r.client_wait_ms is not None),
        },
        "tokens": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "usage_reported": sum(1 for r in ok if r.usage_reported),
            "prompt_tokens_over_target": distribution(target_ratio),
            "completion_tokens_over_max_tokens": distribution(output_ratio),
        },
        "by_domain": {
            d: _group_stats([r for r in records if r.domain == d], verdicts, duration) for d in domains
        },
        "by_version": _served_by(ok, verdicts, lambda r: r.adapter_version),
        "by_replica": _served_by(ok, verdicts, lambda r: r.replica),
        "errors": dict(errors.most_common(10)),
        "quality": quality_summary(records, quality) if quality is not None else {"available": False},
    }
    if timeline_bin_s:
        summary["timeline"] = timeline(records, verdicts, timeline_bin_s, quality)
    return summary
