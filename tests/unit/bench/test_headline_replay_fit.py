"""The calibration replay's pure parts: where its slice starts, the measured cost factor, what it scales."""

from __future__ import annotations

from pathlib import Path

import pytest

from collm_bench.headline.cli import build_parser, config_from_args
from collm_bench.headline.config import HeadlineConfig
from collm_bench.headline.replay_fit import (
    FACTOR_BOUNDS,
    REPLAY_SERIES,
    EvalFit,
    measured_eval_fit,
    measured_inference_factor,
    ms_per_token,
    replay_start_s,
    with_inference_factor,
)
from collm_bench.step_costs import EvalShape
from collm_common.calibration import Calibration
from collm_sim.plugins import REFERENCES
from collm_workload.traces import TraceRequest

pytestmark = pytest.mark.unit

CALIBRATION = Path(__file__).resolve().parents[3] / "bench" / "calibration" / "smollm2.json"


def test_the_replay_starts_offset_requests_after_the_slice_and_needs_a_long_enough_trace() -> None:
    reqs = [TraceRequest(0.5 * i, 100, 10) for i in range(30)]
    assert replay_start_s(reqs, 0.0, offset=10) == 5.0
    assert replay_start_s(reqs, 2.2, offset=10) == 7.5  # counted from the first request at or after 2.2
    assert replay_start_s(reqs, 0.0, offset=29) == 14.5
    assert replay_start_s(reqs, 0.0, offset=30) is None
    assert replay_start_s(reqs, 10.0, offset=20) is None


def test_the_factor_is_the_replay_steps_measured_over_predicted_time_pooled_over_replicas() -> None:
    def kinds(measured: float, predicted: float) -> dict[str, dict[str, float | None]]:
        return {
            "decode": {"measured_ms": 1.0, "predicted_ms": 100.0},  # the pooled inference kind counts alone
            "inference": {"measured_ms": measured, "predicted_ms": predicted},
            "eval": {"measured_ms": 5.0, "predicted_ms": None},
        }

    assert measured_inference_factor({"r0": kinds(600.0, 500.0), "r1": kinds(540.0, 450.0)}) == pytest.approx(
        1140.0 / 950.0
    )
    # Held within the bounds; nothing logged: no factor.
    assert measured_inference_factor({"r0": kinds(5000.0, 100.0)}) == FACTOR_BOUNDS[1]
    assert measured_inference_factor({"r0": kinds(10.0, 100.0)}) == FACTOR_BOUNDS[0]
    assert measured_inference_factor({}) is None
    assert measured_inference_factor({"r0": {"eval": {"measured_ms": 5.0, "predicted_ms": None}}}) is None


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


def test_the_evaluations_take_the_replays_batches_and_pieces() -> None:
    # Live, r0 3 batches of whole examples (1013 tokens) and r1 4 (1020), 32 pieces each: pooled 290
    # tokens a batch, so an evaluation of 1024 tokens is 4 batches (3.53 rounded) of 32 pieces; per
    # replica 3 (338 tokens a batch) and 4 (255). A replica that completed no batch has no entry.
    shapes = {"r0": EvalShape(3, 96, 1013), "r1": EvalShape(4, 128, 1020), "r2": EvalShape(0, 5, 0)}
    assert measured_eval_fit(shapes, 1024) == EvalFit(4, 32, {"r0": 3, "r1": 4})
    # Nothing measured, or evaluations not modelled: no fit.
    assert measured_eval_fit({"r0": EvalShape(0, 0, 0)}, 1024) is None
    assert measured_eval_fit({}, 1024) is None
    assert measured_eval_fit(shapes, None) is None


def test_the_simulated_engine_gets_the_fit() -> None:
    from collm_bench.headline.predict import sim_config
    from collm_bench.headline.setup import TraceSource
    from collm_workload.workload import Slo

    cfg = HeadlineConfig()
    source = TraceSource("synthetic", None)
    plain = sim_config(cfg, source, 1.0, Slo(1000.0, 100.0), "collm", 10)
    assert plain.engine.eval_batches is None and plain.engine.eval_tokens == cfg.eval_max_tokens
    assert not plain.engine_by_replica
    fitted = sim_config(cfg, source, 1.0, Slo(1000.0, 100.0), "collm", 10, EvalFit(4, 32, {"r0": 3}))
    assert (fitted.engine.eval_batches, fitted.engine.eval_pieces_per_batch) == (4, 32)
    assert fitted.engine.eval_tokens == cfg.eval_max_tokens
    assert fitted.engine_by_replica == {"r0": {"eval_batches": 3}}


def test_the_first_round_plans_come_when_the_replays_did() -> None:
    """The live coordinator starts with the stack, before the replay: its first slow tick (the first
    round plans) came this long into the replay, and the simulated one is set there."""
    from collm_bench.headline.predict import sim_config
    from collm_bench.headline.replay_fit import measured_first_slow_s
    from collm_bench.headline.setup import TraceSource
    from collm_workload.workload import Slo

    assert measured_first_slow_s([-1.5, 4.8, 34.8]) == 4.8
    assert measured_first_slow_s([]) is None and measured_first_slow_s([-3.0]) is None
    cfg = HeadlineConfig()
    source = TraceSource("synthetic", None)
    plain = sim_config(cfg, source, 1.0, Slo(1000.0, 100.0), "collm", 10)
    assert plain.core["warmup_s"] == cfg.coordinator_warmup_s
    phased = sim_config(cfg, source, 1.0, Slo(1000.0, 100.0), "collm", 10, None, 4.8)
    assert phased.core["warmup_s"] == 4.8 and phased.core["slow_interval_s"] == cfg.slow_interval_s
