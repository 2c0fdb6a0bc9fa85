"""The one percentile: numpy's default (linear between the closest ranks) to the last bit, None without
values, q within 0..100, the values sorted once for several q; the one ratio, unbounded or unknown at a
divisor of zero or less."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from collm_common.stats import percentile, percentiles, ratio

pytestmark = pytest.mark.unit


def test_linear_between_the_closest_ranks() -> None:
    xs = [float(10 * i) for i in range(10)]  # 0, 10, ..., 90
    assert percentile(xs, 0) == 0.0 and percentile(xs, 100) == 90.0
    assert percentile(xs, 50) == 45.0  # the median of an even count
    assert percentile(xs, 99) == pytest.approx(89.1)
    assert percentile([3.0], 99) == 3.0
    assert percentile(reversed(xs), 25) == 22.5  # any order, any iterable


def test_equals_numpy_percentile_exactly() -> None:
    rng = random.Random(0)
    for _ in range(2000):
        n = rng.randint(1, 40)
        xs = (
            [rng.randint(0, 4000) for _ in range(n)]
            if rng.random() < 0.3
            else [rng.expovariate(0.01) for _ in range(n)]
        )
        qs = [0, 1, 10, 25, 50, 75, 90, 95, 99, 99.9, 100, rng.uniform(0, 100)]
        assert percentiles(xs, qs) == [float(np.percentile(xs, q)) for q in qs]


def test_no_values_have_no_percentile() -> None:
    assert percentile([], 50) is None
    assert percentiles([], (50, 99)) == [None, None]


@pytest.mark.parametrize("q", [-1, 100.5])
def test_q_lies_in_0_to_100(q: float) -> None:
    with pytest.raises(ValueError, match="0..100"):
        percentile([1.0, 2.0], q)


def test_ratio_of_known_values() -> None:
    assert ratio(3.0, 2.0) == 1.5
    assert ratio(0.0, 2.0) == 0.0


def test_ratio_with_a_divisor_of_zero_or_less() -> None:
    """Only a positive numerator over nothing is unbounded; nothing over nothing has no ratio."""
    assert ratio(1.0, 0.0) == math.inf
    assert ratio(1.0, -2.0) == math.inf
    assert ratio(0.0, 0.0) is None
    assert ratio(-1.0, 0.0) is None


@pytest.mark.parametrize("a, b", [(None, 1.0), (1.0, None), (math.nan, 1.0), (1.0, math.nan)])
def test_ratio_of_an_unknown_is_unknown(a: float | None, b: float | None) -> None:
    assert ratio(a, b) is None
