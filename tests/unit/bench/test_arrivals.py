"""Seeded Poisson / gamma / constant arrivals: reproducibility and statistics."""

from __future__ import annotations

import numpy as np
import pytest

from collm_workload.arrivals import arrivals, constant_arrivals, gamma_arrivals, poisson_arrivals

pytestmark = pytest.mark.unit


def gaps(times: list[float]) -> np.ndarray:
    return np.diff(np.asarray(times))


def test_same_seed_same_schedule_other_seed_other_schedule() -> None:
    assert poisson_arrivals(5.0, 100.0, seed=7) == poisson_arrivals(5.0, 100.0, seed=7)
    assert poisson_arrivals(5.0, 100.0, seed=7) != poisson_arrivals(5.0, 100.0, seed=8)
    assert gamma_arrivals(5.0, 0.25, 100.0, seed=7) == gamma_arrivals(5.0, 0.25, 100.0, seed=7)


def test_schedule_starts_at_zero_and_stays_in_the_duration() -> None:
    for t in (
        poisson_arrivals(3.0, 20.0, 1),
        gamma_arrivals(3.0, 0.5, 20.0, 1),
        constant_arrivals(3.0, 20.0),
    ):
        assert t[0] == 0.0 and max(t) < 20.0 and t == sorted(t)


def test_poisson_statistics() -> None:
    rate, duration = 10.0, 2000.0
    t = poisson_arrivals(rate, duration, seed=0)
    g = gaps(t)
    # ~20,000 arrivals: mean gap 1/rate and CV 1 within a few percent.
    assert len(t) == pytest.approx(rate * duration, rel=0.03)
    assert g.mean() == pytest.approx(1 / rate, rel=0.03)
    assert g.std() / g.mean() == pytest.approx(1.0, abs=0.03)


@pytest.mark.parametrize("k", [0.25, 1.0, 4.0])
def test_gamma_keeps_the_rate_and_sets_cv(k: float) -> None:
    t = gamma_arrivals(10.0, k, 2000.0, seed=1)
    g = gaps(t)
    assert g.mean() == pytest.approx(0.1, rel=0.05)
    assert g.std() / g.mean() == pytest.approx(1 / np.sqrt(k), rel=0.06)


def test_constant_and_cap() -> None:
    assert constant_arrivals(2.0, 3.0) == pytest.approx([0, 0.5, 1.0, 1.5, 2.0, 2.5])
    assert len(poisson_arrivals(100.0, 100.0, seed=0, max_requests=10)) == 10
    assert len(arrivals("gamma", 100.0, 100.0, seed=0, burstiness=0.5, max_requests=7)) == 7


def test_bad_parameters() -> None:
    with pytest.raises(ValueError):
        poisson_arrivals(0.0, 10.0, 0)
    with pytest.raises(ValueError):
        gamma_arrivals(1.0, 0.0, 10.0, 0)
    with pytest.raises(ValueError):
        arrivals("uniform", 1.0, 10.0, 0)
