"""Goodput, TPOT, attainment, duration and percentiles against hand-computed cases."""

from __future__ import annotations

import pytest

from collm_workload.goodput import (
    SloOverride,
    distribution,
    is_good,
    run_duration_s,
    summarize,
    tpot_ms,
    verdict,
)
from collm_workload.records import RequestRecord

pytestmark = pytest.mark.unit


def rec(
    index: int,
    status: str = "ok",
    scheduled_s: float = 0.0,
    end_s: float | None = None,
    ttft_ms: float | None = None,
    e2e_ms: float | None = None,
    tokens: int | None = None,
    slo_ttft_ms: float | None = 500.0,
    slo_tpot_ms: float | None = 50.0,
    **kw: object,
) -> RequestRecord:
    return RequestRecord(
        request_id=f"r{index}",
        index=index,
        domain=str(kw.pop("domain", "medical")),
        model="m",
        status=status,  # type: ignore[arg-type]
        scheduled_s=scheduled_s,
        sent_s=scheduled_s if status != "dropped" else None,
        end_s=end_s,
        ttft_ms=ttft_ms,
        e2e_ms=e2e_ms,
        completion_tokens=tokens,
        usage_reported=tokens is not None,
        slo_ttft_ms=slo_ttft_ms,
        slo_tpot_ms=slo_tpot_ms,
        **kw,  # type: ignore[arg-type]
    )


def test_tpot_excludes_the_first_token() -> None:
    assert tpot_ms(e2e_ms=1000.0, ttft_ms=100.0, output_tokens=10) == pytest.approx(100.0)
    assert tpot_ms(2000.0, 200.0, 37) == pytest.approx(50.0)
    # Undefined for 0 or 1 output token, or missing measurements.
    assert tpot_ms(300.0, 300.0, 1) is None
    assert tpot_ms(300.0, 300.0, 0) is None
    assert tpot_ms(None, 300.0, 5) is None
    assert tpot_ms(300.0, None, 5) is None


def test_verdicts() -> None:
    assert verdict(rec(0, ttft_ms=200, e2e_ms=2000, tokens=37)) == "good"  # TPOT exactly 50: <= SLO
    assert verdict(rec(0, ttft_ms=500.0001, e2e_ms=2000, tokens=37)) == "ttft"
    assert verdict(rec(0, ttft_ms=200, e2e_ms=2000.1, tokens=37)) == "tpot"
    assert verdict(rec(0, ttft_ms=600, e2e_ms=1600, tokens=11)) == "ttft+tpot"
    # Single-token output: TPOT undefined, only TTFT applies.
    assert verdict(rec(0, ttft_ms=300, e2e_ms=300, tokens=1)) == "good"
    assert verdict(rec(0, ttft_ms=900, e2e_ms=900, tokens=1)) == "ttft"
    # Unset SLO dimensions are not checked.
    assert is_good(rec(0, ttft_ms=9e9, e2e_ms=9e9, tokens=2, slo_ttft_ms=None, slo_tpot_ms=None))


@pytest.mark.parametrize("status", ["error", "rejected", "timeout", "dropped"])
def test_failed_rejected_timed_out_and_dropped_are_never_good(status: str) -> None:
    # Even with latencies that would meet the SLO.
    r = rec(0, status=status, ttft_ms=10, e2e_ms=20, tokens=2, end_s=0.02)
    assert verdict(r) == f"status:{status}"
    assert not is_good(r)
    assert not is_good(r, SloOverride(ttft_ms=1e9, tpot_ms=1e9))


def test_ok_without_ttft_is_not_good() -> None:
    assert verdict(rec(0, ttft_ms=None, e2e_ms=10, tokens=3)) == "no_ttft"


def test_override_replaces_record_slos_per_dimension() -> None:
    r = rec(0, ttft_ms=600, e2e_ms=600 + 20 * 40, tokens=21)  # TPOT 40
    assert verdict(r) == "ttft"
    assert verdict(r, SloOverride(ttft_ms=700)) == "good"  # TPOT SLO still the record's 50
    assert verdict(r, SloOverride(ttft_ms=700, tpot_ms=30)) == "tpot"


def hand_case() -> list[RequestRecord]:
    return [
        rec(0, scheduled_s=0.0, end_s=2.0, ttft_ms=200, e2e_ms=2000, tokens=37),  # good, TPOT 50
        rec(1, scheduled_s=1.0, end_s=2.6, ttft_ms=600, e2e_ms=1600, tokens=11),  # ttft+tpot (TPOT 100)
        rec(2, scheduled_s=2.0, end_s=2.3, ttft_ms=300, e2e_ms=300, tokens=1),  # good, single token
        rec(3, status="error", scheduled_s=3.0, end_s=3.1, error="HTTP 500: boom"),
        rec(4, status="dropped", scheduled_s=4.0, end_s=9.0, error="run ended before it was sent"),
        rec(5, status="timeout", scheduled_s=5.0, end_s=8.0, error="no complete answer within 3 s"),
        rec(6, status="rejected", scheduled_s=6.0, end_s=6.01, error="HTTP 429: busy"),
        rec(7, scheduled_s=7.0, end_s=8.1, ttft_ms=100, e2e_ms=1100, tokens=21),  # good, TPOT 50
    ]


def test_summary_hand_computed() -> None:
    s = summarize(hand_case(), timeline_bin_s=None)
    # Duration: first scheduled arrival (0) to the latest end (the dropped request's, 9.0).
    assert s["duration_s"] == pytest.approx(9.0)
    assert s["counts"]["submitted"] == 8 and s["counts"]["completed"] == 4 and s["counts"]["good"] == 3
    assert s["counts"]["by_status"] == {"ok": 4, "error": 1, "rejected": 1, "timeout": 1, "dropped": 1}
    assert s["counts"]["not_good_by_reason"] == {
        "status:dropped": 1,
        "status:error": 1,
        "status:rejected": 1,
        "status:timeout": 1,
        "ttft+tpot": 1,
    }
    assert s["goodput_rps"] == pytest.approx(3 / 9)
    assert s["attainment"] == pytest.approx(3 / 8)
    assert s["request_throughput_rps"] == pytest.approx(4 / 9)
    assert s["output_throughput_tps"] == pytest.approx((37 + 11 + 1 + 21) / 9)
    ttft = s["latency_ms"]["ttft"]  # over completed requests: 100, 200, 300, 600
    assert ttft["count"] == 4 and ttft["mean"] == pytest.approx(300)
    assert ttft["p50"] == pytest.approx(250)  # linear interpolation
    assert ttft["p90"] == pytest.approx(510)  # 300 + 0.7 * 300
    assert ttft["p99"] == pytest.approx(591)  # 300 + 0.97 * 300
    tpot = s["latency_ms"]["tpot"]  # 50, 100, 50 (the single-token request has none)
    assert tpot["count"] == 3 and tpot["p50"] == pytest.approx(50) and tpot["max"] == pytest.approx(100)
    assert s["latency_ms"]["e2e"]["mean"] == pytest.approx((2000 + 1600 + 300 + 1100) / 4)
    assert s["errors"] == {
        "error: HTTP 500: boom": 1,
        "dropped: run ended before it was sent": 1,
        "timeout: no complete answer within 3 s": 1,
        "rejected: HTTP 429: busy": 1,
    }


def test_duration_reaches_the_last_scheduled_arrival() -> None:
    # The last request fails instantly at 10.0: the run still lasted until its scheduled arrival.
    recs = [
        rec(0, scheduled_s=0.0, end_s=1.0, ttft_ms=100, e2e_ms=1000, tokens=19),  # TPOT 50: good
        rec(1, status="dropped", scheduled_s=10.0, end_s=None),
    ]
    assert run_duration_s(recs) == pytest.approx(10.0)
    s = summarize(recs, timeline_bin_s=None)
    assert s["goodput_rps"] == pytest.approx(0.1) and s["attainment"] == pytest.approx(0.5)


def test_duration_starts_at_first_scheduled_arrival() -> None:
    recs = [
        rec(0, scheduled_s=2.0, end_s=3.0, ttft_ms=100, e2e_ms=1000, tokens=2),
        rec(1, scheduled_s=4.0, end_s=6.0, ttft_ms=100, e2e_ms=2000, tokens=2),
    ]
    assert run_duration_s(recs) == pytest.approx(4.0)


def test_rescoring_with_override() -> None:
    s = summarize(hand_case(), SloOverride(ttft_ms=1000, tpot_ms=1000), timeline_bin_s=None)
    assert s["counts"]["good"] == 4 and s["goodput_rps"] == pytest.approx(4 / 9)
    s = summarize(hand_case(), SloOverride(ttft_ms=150), timeline_bin_s=None)
    assert s["counts"]["good"] == 1  # only the 100 ms TTFT request


def test_by_domain_and_timeline() -> None:
    recs = hand_case()
    recs[7].domain = "math"
    s = summarize(recs, timeline_bin_s=3.0)
    assert s["by_domain"]["math"]["good"] == 1 and s["by_domain"]["math"]["submitted"] == 1
    assert s["by_domain"]["medical"]["good"] == 2 and s["by_domain"]["medical"][
        "attainment"
    ] == pytest.approx(2 / 7)
    assert s["by_domain"]["medical"]["goodput_rps"] == pytest.approx(2 / 9)
    tl = s["timeline"]
    assert tl["t_s"] == [0.0, 3.0, 6.0]
    assert tl["completed"] == [3, 0, 1] and tl["good"] == [2, 0, 1]
    assert tl["goodput_rps"] == pytest.approx([2 / 3, 0, 1 / 3])


def test_distribution_of_nothing() -> None:
    d = distribution([])
    assert d["count"] == 0 and d["p50"] is None and d["mean"] is None


def test_empty_run() -> None:
    s = summarize([], timeline_bin_s=None)
    assert s["counts"]["submitted"] == 0 and s["goodput_rps"] is None and s["attainment"] is None


def test_duplicate_indexes_are_refused() -> None:
    with pytest.raises(ValueError, match="distinct"):
        summarize([rec(0), rec(0)])
