"""A calibration object for the simulator's unit tests: test data, not a measurement."""

from __future__ import annotations

from collm_common.calibration import Calibration, CostModel, QualityCurve


def calibration_for_tests(
    lora_overhead: float = 0.0,
    domains: tuple[str, ...] = ("med", "bank"),
    eval_cost: tuple[float, float] | None = None,
) -> Calibration:
    """`eval_cost`: (fixed ms per batch, ms per token) of evaluations; None: a file without them."""
    return Calibration(
        model="test",
        device="cpu",
        torch_threads=1,
        measured_unix_s=0.0,
        command="test data built in tests/unit/sim/calib.py (not a measurement)",
        cost=CostModel(
            prefill_fixed_ms=10.0,
            prefill_ms_per_token=1.0,
            decode_step_ms={1: 20.0, 16: 50.0},
            lora_overhead_frac_per_adapter=lora_overhead,
            train_fixed_ms=20.0,
            train_ms_per_token=1.0,
            eval_fixed_ms=eval_cost[0] if eval_cost else 0.0,
            eval_ms_per_token=eval_cost[1] if eval_cost else None,
            max_batch=16,
        ),
        quality=[
            QualityCurve(domain=d, base_loss=3.0, points=[(1_000, 2.8), (10_000, 2.5), (100_000, 2.2)])
            for d in domains
        ],
    )
