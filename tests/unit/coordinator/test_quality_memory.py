"""The gain estimate follows what an adapter's rounds gain now."""

from __future__ import annotations

import pytest

from collm_coordinator.core.quality import AdapterQuality

pytestmark = pytest.mark.unit
TAU = 20_000.0


def run(q: AdapterQuality, drops: list[float], tokens: float = 1000.0) -> None:
    for d in drops:
        q.observe_round(TAU, tokens, d > 0, 2.0, 2.0 - d)


def test_an_adapter_whose_gains_ran_out_falls_below_one_that_still_gains() -> None:
    saturated = AdapterQuality(prior_gain=0.1, prior_weight=2.0, memory=0.5)
    steady = AdapterQuality(prior_gain=0.1, prior_weight=2.0, memory=0.5)
    run(saturated, [0.8, 0.7, 0.3])
    run(steady, [0.05, 0.05, 0.05])
    assert saturated.gain_coefficient > steady.gain_coefficient  # early on, the fast learner leads
    run(saturated, [0.0, -0.01, 0.0, 0.0])
    run(steady, [0.05, 0.05, 0.05, 0.05])
    assert saturated.gain_coefficient < steady.gain_coefficient


def test_a_memory_of_one_weighs_every_round_alike() -> None:
    forgetful = AdapterQuality(prior_gain=0.1, prior_weight=2.0, memory=0.5)
    total = AdapterQuality(prior_gain=0.1, prior_weight=2.0, memory=1.0)
    for q in (forgetful, total):
        run(q, [0.8, 0.7, 0.3, 0.0, 0.0, 0.0, 0.0])
    assert total.sum_drop == pytest.approx(1.8)
    assert forgetful.sum_drop == pytest.approx(0.8 / 64 + 0.7 / 32 + 0.3 / 16)
    assert total.gain_coefficient > forgetful.gain_coefficient
