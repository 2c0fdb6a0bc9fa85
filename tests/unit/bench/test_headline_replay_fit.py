"""The calibration replay's pure parts: where its slice starts, the fitted cost factor, and what it scales."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from collm_bench.headline.cli import build_parser, config_from_args
from collm_bench.headline.config import HeadlineConfig
from collm_bench.headline.replay_fit import (
    FACTOR_BOUNDS,
    REPLAY_SERIES,
    fit_cost_factor,
    ms_per_token,
    replay_start_s,
    with_inference_factor,
)
from collm_bench.traces import TraceRequest
from collm_common.calibration import Calibration
from collm_sim.plugins import REFERENCES

pytestmark = pytest.mark.unit

CALIBRATION = Path(__file__).resolve().parents[3] / "bench" / "calibration" / "smollm2.json"


def test_the_replay_starts_offset_requests_after_the_slice_and_needs_a_long_enough_trace() -> None:
    reqs = [TraceRequest(0.5 * i, 100, 10) for i in range(30)]
    assert replay_start_s(reqs, 0.0, offset=10) == 5.0
    assert replay_start_s(reqs, 2.2, offset=10) == 7.5  # counted from the first request at or after 2.2
    assert replay_start_s(reqs, 0.0, offset=29) == 14.5
    assert replay_start_s(reqs, 0.0, offset=30) is None
    assert replay_start_s(reqs, 10.0, offset=20) is None


def attainment_curve(threshold: float, width: float = 0.4) -> Callable[[float], float]:
    """A simulated attainment falling from 1 to 0 as the cost factor passes `threshold`, in steps of
    1/40 as a replay of 40 requests would (pure test double)."""

    def at(f: float) -> float:
        x = min(1.0, max(0.0, 0.5 - (f - threshold) / width))
        return round(40 * x) / 40

    return at


def test_the_factor_meets_the_live_attainment_from_either_side() -> None:
    # The simulator attains more than the live replay: its costs must grow.
    at = attainment_curve(1.3)
    factor, trail = fit_cost_factor(0.3, at)
    assert trail[0] == (1.0, at(1.0)) and factor > 1.0
    assert at(factor) == pytest.approx(0.3, abs=0.03) and len(trail) <= 10
    # It attains less: they must shrink.
    at = attainment_curve(0.8)
    factor, _ = fit_cost_factor(0.8, at)
    assert factor < 1.0 and at(factor) == pytest.approx(0.8, abs=0.03)
    # Already within the tolerance: the probe's costs stand.
    assert fit_cost_factor(at(1.0) + 0.01, at) == (1.0, [(1.0, at(1.0))])


def test_a_plateau_keeps_the_least_correction_and_the_bounds_hold() -> None:
    # Live and simulated replays both serve everything over a range of factors: 1 fits, nothing moves.
    assert fit_cost_factor(1.0, lambda f: 1.0) == (1.0, [(1.0, 1.0)])
    # Live attains nothing, the simulation everything up to the upper bound: the bound, and no further.
    factor, trail = fit_cost_factor(0.0, lambda f: 1.0)
    assert factor == 1.0 and all(FACTOR_BOUNDS[0] <= f <= FACTOR_BOUNDS[1] for f, _ in trail)
    assert max(f for f, _ in trail) == FACTOR_BOUNDS[1]
    # A simulation that only approaches the live attainment: the bound, its nearest point.
    factor, trail = fit_cost_factor(0.0, lambda f: 1.0 - 0.1 * f)
    assert factor == FACTOR_BOUNDS[1]
    with pytest.raises(ValueError, match="attainment"):
        fit_cost_factor(1.5, lambda f: 1.0)


def test_the_factor_scales_prefill_and_decode_only() -> None:
    cal = Calibration.load(CALIBRATION)
    scaled = with_inference_factor(cal, 1.25).cost
    c = cal.cost
    assert scaled.prefill_ms(128) == pytest.approx(1.25 * c.prefill_ms(128))
    assert scaled.decode_ms(16, 4000) == pytest.approx(1.25 * c.decode_ms(16, 4000))
    assert scaled.prefill_chunk_ms(64, 300) == pytest.approx(1.25 * c.prefill_chunk_ms(64, 300))
    assert scaled.train_ms(64) == c.train_ms(64) and scaled.eval_ms(512, 512) == c.eval_ms(512, 512)
    assert scaled.lora_overhead_frac_per_adapter == c.lora_overhead_frac_per_adapter


def test_the_replay_is_on_by_default_and_serves_only() -> None:
    assert REPLAY_SERIES in REFERENCES and REFERENCES[REPLAY_SERIES][1] == "off"
    assert HeadlineConfig().calibration_replay
    assert not config_from_args(build_parser().parse_args(["--no-calibration-replay"])).calibration_replay


def test_time_per_token_pools_the_replicas() -> None:
    assert ms_per_token([(80.0, 16000), (82.0, 14000)]) == pytest.approx(1e3 * 162.0 / 30000)
    assert ms_per_token([(1.0, 0)]) is None and ms_per_token([]) is None
