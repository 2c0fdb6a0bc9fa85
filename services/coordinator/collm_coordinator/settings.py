"""Coordinator settings (environment variables `COLLM_COORDINATOR_*`, validated at construction).

Every knob of the core that operators set (`collm_coordinator.core.config.settings()`: declared once in
`CoreConfig` with its meaning, default and bounds) becomes a field here named `coordinator_<knob>`, so
`COLLM_COORDINATOR_FAST_INTERVAL_S=0.5` sets `CoreConfig.fast_interval_s`. The prefix keeps them apart
from the aggregator's and replica's own fields (`round_deadline_s`, ...) when one environment starts the
whole stack. The service's own settings (policy, adapters, calibration, timeouts) are declared below.
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, create_model, model_validator

from collm_common.settings import CommonSettings
from collm_coordinator.core.config import CoreConfig, CostPrior, settings

Policy = Literal["collm", "separate", "fixed_ratio", "leftover"]


def _core_knobs() -> dict[str, Any]:
    """`coordinator_<knob>`: (type, Field) of every knob of `CoreConfig` operators set."""
    hints = typing.get_type_hints(CoreConfig)
    return {
        f"coordinator_{name}": (hints[name], Field(default, description=s.description, **s.bounds))
        for name, default, s in settings()
    }


class PolicySettings(CommonSettings):
    """Which coordinator policy runs (first: what the other settings mean depends on it)."""

    coordinator_policy: Policy = Field(
        "collm",
        description="collm (two-timescale), separate (static serve/train split), fixed_ratio (share "
        "1/(K+1) everywhere, as Loquetier), leftover (training fills what inference leaves, as FlexLLM).",
    )


CoreKnobSettings: type[CommonSettings] = create_model(  # type: ignore[call-overload]
    "CoreKnobSettings",
    __base__=PolicySettings,
    __doc__="The core's knobs as settings (made from `CoreConfig`).",
    **_core_knobs(),
)


class CoordinatorSettings(CoreKnobSettings):  # type: ignore[misc,valid-type]
    """The two-timescale coordinator (`python -m collm_coordinator`)."""

    coordinator_adapters: dict[str, list[str]] = Field(
        default_factory=dict,
        description='Adapters to train and the domains that train each, JSON: {"shared": ["*"], '
        '"medical": ["medical"]}. Empty: one adapter per domain that replicas report, named after it.',
    )
    # --- shell ---------------------------------------------------------------------------------------
    coordinator_calibration_path: Path | None = Field(
        None,
        description="Calibration file (bench/calibration/<model>.json): priors for training speed, step "
        "costs and quality curves before telemetry teaches them. None: learn from telemetry only.",
    )
    coordinator_train_micro_tokens: int = Field(
        64,
        ge=1,
        description="Tokens of a replica's training micro-step (turns the calibration into tokens/s).",
    )
    coordinator_control_timeout_s: float = Field(
        0.5, gt=0, description="Timeout of one share command; a slow replica never blocks the tick."
    )
    coordinator_open_round_timeout_s: float = Field(
        5.0, gt=0, description="Timeout of one round plan sent to the aggregator."
    )
    coordinator_use_store: bool = Field(
        True, description="Read current adapter versions and quality records from the adapter store."
    )
    coordinator_store_refresh_s: float = Field(
        10.0, gt=0, description="How often versions and quality records are re-read from the store."
    )
    coordinator_micro_version: str = Field(
        "0.1.0", pattern=r"^\d+\.\d+\.\d+$", description="Semver reported by the `collm-coordinator` service."
    )

    @model_validator(mode="after")
    def _coherent(self) -> CoordinatorSettings:
        if self.coordinator_fast_interval_s >= self.coordinator_slow_interval_s:
            raise ValueError(
                f"COLLM_COORDINATOR_FAST_INTERVAL_S ({self.coordinator_fast_interval_s}) must be shorter "
                f"than COLLM_COORDINATOR_SLOW_INTERVAL_S ({self.coordinator_slow_interval_s}): the fast loop "
                "reacts to load within seconds, the slow loop plans one federated round"
            )
        if self.coordinator_calibration_path is not None and not self.coordinator_calibration_path.is_file():
            raise ValueError(
                f"COLLM_COORDINATOR_CALIBRATION_PATH {self.coordinator_calibration_path} is not a file"
            )
        try:
            self.core_config()
        except ValueError as exc:
            raise ValueError(f"COLLM_COORDINATOR_* settings: {exc}") from None
        return self

    def core_config(
        self, cost_prior: CostPrior | None = None, quality_prior: dict[str, float] | None = None
    ) -> CoreConfig:
        """The core's knobs from these settings (every `coordinator_<knob>` field)."""
        values: dict[str, object] = {}
        for f in dataclasses.fields(CoreConfig):
            key = f"coordinator_{f.name}"
            if key in type(self).model_fields:
                values[f.name] = getattr(self, key)
        values["adapters"] = {a: tuple(d) for a, d in self.coordinator_adapters.items()}
        values["fixed_ratio_k"] = self.fixed_ratio_k
        if cost_prior is not None:
            values["cost_prior"] = cost_prior
        if quality_prior is not None:
            values["quality_prior"] = quality_prior
        return CoreConfig(**values)  # type: ignore[arg-type]
