"""Priors of the core from a calibration file (measured by the engine benchmark, never typed in).

* training speed: tokens/s of a replica that only trains, with micro-steps of `micro_tokens`;
* inference step costs: decode step by batch size and prefill per token, to estimate a replica's serving
  load when its telemetry does not report busy fractions;
* quality: for every domain curve, the gain coefficient k of the core's log model (quality.py).
"""

from __future__ import annotations

from collm_common.calibration import Calibration
from collm_coordinator.core.config import CostPrior
from collm_coordinator.core.quality import fit_log_gain


def cost_prior(cal: Calibration, micro_tokens: int) -> CostPrior:
    cost = cal.cost
    train_ms = cost.train_ms(micro_tokens)
    return CostPrior(
        train_tokens_per_s=1000.0 * micro_tokens / train_ms if train_ms > 0 else None,
        prefill_ms_per_token=cost.prefill_ms_per_token,
        decode_step_ms=cost.decode_ms,
    )


def quality_prior(cal: Calibration, token_scale: float) -> dict[str, float]:
    return {q.domain: fit_log_gain(q.points, q.base_loss, token_scale) for q in cal.quality}
