"""The one SLO rule: a completed request is good when its TTFT and (from its second token) TPOT are
within their SLOs; an unset SLO holds."""

from __future__ import annotations

import pytest

from collm_common.slo import meets_slo, meets_slo_alone, missed_slos

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("ttft", "tpot", "ttft_slo", "tpot_slo", "missed"),
    [
        (100.0, 10.0, 100.0, 10.0, ()),  # at the bound: met
        (100.1, 10.0, 100.0, 10.0, ("ttft",)),
        (50.0, 10.1, 100.0, 10.0, ("tpot",)),
        (150.0, 20.0, 100.0, 10.0, ("ttft", "tpot")),
        (50.0, None, 100.0, 10.0, ()),  # one token: no TPOT
        (None, None, 100.0, 10.0, ("no_ttft",)),
        (5e6, 5e6, None, None, ()),  # no SLO set
    ],
)
def test_missed_slos(
    ttft: float | None,
    tpot: float | None,
    ttft_slo: float | None,
    tpot_slo: float | None,
    missed: tuple[str, ...],
) -> None:
    assert missed_slos(ttft, tpot, ttft_slo, tpot_slo) == missed
    assert meets_slo(ttft, tpot, ttft_slo, tpot_slo) == (missed == ())


def test_meets_slo_alone_takes_the_training_out_of_each_latency() -> None:
    """TTFT 150 ms with 60 ms of training before the first token: 90 ms alone (SLO 100 met); TPOT 12 ms
    over 10 later tokens with 30 ms of training among them: 9 ms alone (SLO 10 met)."""
    assert meets_slo_alone(150.0, 12.0, 10, 60.0, 30.0, 100.0, 10.0)
    assert not meets_slo_alone(150.0, 12.0, 10, 40.0, 30.0, 100.0, 10.0)  # 110 ms alone: a miss
    assert not meets_slo_alone(90.0, 12.0, 10, 0.0, 10.0, 100.0, 10.0)  # 11 ms per token alone
    assert meets_slo_alone(90.0, None, 0, 0.0, 500.0, 100.0, 10.0)  # one token: no TPOT
    assert meets_slo_alone(20.0, 5.0, 4, 50.0, 80.0, 100.0, 10.0)  # never below zero
