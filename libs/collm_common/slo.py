"""Whether a request met its latency SLOs: the one rule the engine, the gateway, the simulator and the
benchmarks all apply (pure).

A completed request meets its SLOs when it has a first token, its TTFT is at most its TTFT SLO and its
TPOT (defined from its second token on) at most its TPOT SLO; an SLO that is not set (None) holds, and
so does the TPOT SLO of an answer of one token. `missed_slos` says which were missed (the benchmarks'
reasons); `meets_slo` whether none was. Whether the request completed at all (its status) is the
caller's part: a request that failed, was refused or timed out is never good.
"""

from __future__ import annotations


def missed_slos(
    ttft_ms: float | None, tpot_ms: float | None, ttft_slo_ms: float | None, tpot_slo_ms: float | None
) -> tuple[str, ...]:
    """The SLOs a completed request missed, in order: "no_ttft" (no first token), "ttft", "tpot"."""
    if ttft_ms is None:
        return ("no_ttft",)
    missed = []
    if ttft_slo_ms is not None and ttft_ms > ttft_slo_ms:
        missed.append("ttft")
    if tpot_slo_ms is not None and tpot_ms is not None and tpot_ms > tpot_slo_ms:
        missed.append("tpot")
    return tuple(missed)


def meets_slo(
    ttft_ms: float | None, tpot_ms: float | None, ttft_slo_ms: float | None, tpot_slo_ms: float | None
) -> bool:
    return not missed_slos(ttft_ms, tpot_ms, ttft_slo_ms, tpot_slo_ms)


def meets_slo_alone(
    ttft_ms: float,
    tpot_ms: float | None,
    decode_tokens: int,
    train_to_first_ms: float,
    train_after_first_ms: float,
    ttft_slo_ms: float | None,
    tpot_slo_ms: float | None,
) -> bool:
    """Whether the request would have met its SLOs had its replica not trained while it was in flight:
    its TTFT less the training that ran before its first token, its TPOT less the training after it
    spread over its `decode_tokens` later tokens. An estimate of what serving alone attains (the
    coordinator's attainable level): it does not take out the queueing that training before the request's
    arrival left behind."""
    ttft_alone = max(0.0, ttft_ms - train_to_first_ms)
    tpot_alone = None
    if tpot_ms is not None and decode_tokens > 0:
        tpot_alone = max(0.0, tpot_ms - train_after_first_ms / decode_tokens)
    return meets_slo(ttft_alone, tpot_alone, ttft_slo_ms, tpot_slo_ms)
