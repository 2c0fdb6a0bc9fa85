"""The one capacity formula (pure): requests/s a cluster serves at full batch efficiency, which only
places the frontier's loads and the rate searches' grids (the searches themselves run the simulator)."""

from __future__ import annotations

import math
from typing import Any


def capacity_estimate_rps(
    prefill_ms_per_token: float,
    decode_ms_full_batch: float,
    max_batch: int,
    lora_overhead_frac: float,
    mean_input_tokens: float,
    mean_output_tokens: float,
    replicas: int,
) -> float:
    """Requests/s the cluster serves at full batch efficiency for these mean lengths."""
    per_req_ms = mean_input_tokens * prefill_ms_per_token
    per_req_ms += max(0.0, mean_output_tokens - 1) * decode_ms_full_batch / max(1, max_batch)
    per_req_ms *= 1.0 + lora_overhead_frac
    if per_req_ms <= 0:
        return math.inf
    return replicas * 1000.0 / per_req_ms


def calibrated_capacity_rps(
    cal: Any, max_batch: int, mean_input_tokens: float, mean_output_tokens: float, replicas: int
) -> float:
    """`capacity_estimate_rps` at a calibration's costs (its decode step at `max_batch`)."""
    return capacity_estimate_rps(
        cal.cost.prefill_ms_per_token,
        cal.cost.decode_ms(max_batch),
        max_batch,
        cal.cost.lora_overhead_frac_per_adapter,
        mean_input_tokens,
        mean_output_tokens,
        replicas,
    )


def workload_capacity_rps(cal: Any, wl: Any, max_batch: int, replicas: int) -> float:
    """`calibrated_capacity_rps` for a simulator workload's mean lengths."""
    return calibrated_capacity_rps(
        cal, max_batch, float(wl.input_tokens.mean()), float(wl.output_tokens.mean()), replicas
    )
