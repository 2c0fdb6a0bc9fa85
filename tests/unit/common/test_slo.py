"""The one SLO rule: a completed request is good when its TTFT and (from its second token) TPOT are
within their SLOs; an unset SLO holds."""

from __future__ import annotations

import pytest

from collm_common.slo import meets_slo, missed_slos

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
