"""Settings and knobs are validated with errors that say what to change."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from collm_coordinator.core import CoreConfig
from collm_coordinator.settings import CoordinatorSettings

pytestmark = pytest.mark.unit


def test_fast_interval_must_be_shorter_than_slow() -> None:
    with pytest.raises(ValueError, match="fast_interval_s .* shorter than slow_interval_s"):
        CoreConfig(fast_interval_s=60.0, slow_interval_s=30.0)
    with pytest.raises(ValidationError, match="COLLM_COORDINATOR_FAST_INTERVAL_S .* must be shorter"):
        CoordinatorSettings(coordinator_fast_interval_s=10.0, coordinator_slow_interval_s=5.0)


def test_round_deadline_within_slow_interval() -> None:
    with pytest.raises(ValueError, match="round_deadline_s"):
        CoreConfig(slow_interval_s=30.0, round_deadline_s=40.0)


def test_many_bad_knobs_are_reported_together() -> None:
    with pytest.raises(ValueError) as err:
        CoreConfig(util_cap=1.5, share_step=0.0, fixed_ratio_k=0)
    text = str(err.value)
    assert "util_cap" in text and "share_step" in text and "fixed_ratio_k" in text


def test_settings_map_onto_core_knobs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLLM_COORDINATOR_POLICY", "leftover")
    monkeypatch.setenv("COLLM_COORDINATOR_FAST_INTERVAL_S", "0.5")
    monkeypatch.setenv("COLLM_COORDINATOR_ADAPTERS", '{"shared": ["*"], "med": ["med"]}')
    s = CoordinatorSettings()
    cfg = s.core_config()
    assert s.coordinator_policy == "leftover"
    assert cfg.fast_interval_s == 0.5
    assert cfg.adapters == {"shared": ("*",), "med": ("med",)}


def test_unknown_policy_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLLM_COORDINATOR_POLICY", "fastest")
    with pytest.raises(ValidationError, match="coordinator_policy"):
        CoordinatorSettings()


def test_missing_calibration_file_is_refused(tmp_path) -> None:
    with pytest.raises(ValidationError, match="not a file"):
        CoordinatorSettings(coordinator_calibration_path=tmp_path / "nope.json")
