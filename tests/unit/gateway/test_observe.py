"""Per-request latencies (TPOT as in docs/architecture.md, Goodput and SLO attainment) and the SLO verdict."""

import pytest

from collm_gateway.observe import is_good, latencies

pytestmark = pytest.mark.unit


def test_latencies_follow_the_design_definitions() -> None:
    ttft, tpot, e2e = latencies(10.0, 10.2, 11.2, 11)
    assert ttft == pytest.approx(200.0)
    assert e2e == pytest.approx(1200.0)
    assert tpot == pytest.approx(100.0)  # (1200 - 200) / (11 - 1)


def test_tpot_undefined_for_one_token_and_missing_instants() -> None:
    assert latencies(0.0, 0.1, 0.1, 1)[1] is None
    assert latencies(0.0, None, 1.0, 0) == (None, None, 1000.0)
    assert latencies(0.0, None, None, 0) == (None, None, None)


@pytest.mark.parametrize(
    ("status", "ttft", "tpot", "good"),
    [
        (200, 100.0, 10.0, True),
        (200, 600.0, 10.0, False),
        (200, 100.0, 60.0, False),
        (200, 100.0, None, True),
        (200, None, None, False),
        (504, 100.0, 10.0, False),
        (499, 100.0, 10.0, False),
    ],
)
def test_good_requests(status: int, ttft, tpot, good: bool) -> None:
    assert is_good(status, ttft, tpot, 500.0, 50.0) is good


def test_no_targets_means_any_completed_request_is_good() -> None:
    assert is_good(200, 9999.0, 9999.0, None, None)


def test_a_completion_without_tokens_counts_its_end_as_its_first_token() -> None:
    """TTFT = e2e for a request that completed without a token (the benchmark client's rule), so its
    verdict is the TTFT target against its whole latency; a failed one has no TTFT."""
    from collm_gateway.observe import RequestRecord, outcome_fields

    def rec(status: int, end_s: float) -> RequestRecord:
        return RequestRecord(
            "r", "chat", "m", "m", False, arrival_s=0.0, slo_ttft_ms=500.0, end_s=end_s, status=status
        )

    quick, slow, failed = (
        outcome_fields(rec(200, 0.2)),
        outcome_fields(rec(200, 0.9)),
        outcome_fields(rec(503, 0.2)),
    )
    assert quick["ttft_ms"] == pytest.approx(200.0) and quick["good"] is True
    assert slow["ttft_ms"] == pytest.approx(900.0) and slow["good"] is False
    assert failed["ttft_ms"] is None and failed["good"] is False
