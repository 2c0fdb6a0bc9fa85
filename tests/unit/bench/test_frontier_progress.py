"""A simulated frontier keeps its work as it goes and a later run of the same plan keeps what is done
(`collm_bench.frontier.progress`, `sim.sim_frontier`). The simulated runs here are a test double of
`sim.run_point` (attainment falling with the rate), so the rate search and the grid run in milliseconds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from collm_bench.experiment.config import ExperimentConfig
from collm_bench.frontier import points as pts
from collm_bench.frontier import progress, sim

pytestmark = pytest.mark.unit


class Stopped(Exception):
    """The run was stopped (as by SIGTERM) after the simulated runs the double was allowed."""


class FakeRunPoint:
    """Stands in for `sim.run_point`: serving alone attains 1 below 2 req/s, less above; each knob its
    own figures. Counts its calls, and stops the run (`Stopped`) after `allowed` of them."""

    def __init__(self, allowed: int | None = None) -> None:
        self.calls: list[tuple[str, str, float]] = []
        self.allowed = allowed

    def __call__(
        self, cfg: ExperimentConfig, cal: Any, rate: float, slo: Any, knob: pts.Knob
    ) -> dict[str, Any]:
        if self.allowed is not None and len(self.calls) >= self.allowed:
            raise Stopped
        self.calls.append((knob.policy, knob.label, rate))
        att = 1.0 if rate < 2.0 else 2.0 / rate
        tokens = 0.0 if knob.policy == pts.SERVING_ALONE else 1000.0 * float(knob.core["fixed_ratio_k"])
        point = pts.Point(knob.policy, knob.label, att, rate * att, tokens, 0.01, 100, dict(knob.core))
        return {"point": point.as_dict(), "rounds": 3, "quality_curve": None, "wall_s": 0.0}


def config(tmp_path: Path) -> ExperimentConfig:
    return ExperimentConfig(
        replicas=2,
        duration_s=60.0,
        traces=("conv",),
        traces_dir=tmp_path,
        synthetic_fallback=True,
    )


KNOBS = [pts.Knob(pts.SERVING_ALONE, "fine-tuning off"), *pts.fixed_ratio_knobs((0.1, 0.2))]


def frontier(tmp_path: Path, fake: FakeRunPoint, monkeypatch: pytest.MonkeyPatch, prior: Any = None) -> dict:
    monkeypatch.setattr(sim, "run_point", fake)
    partial = tmp_path / "sim-conv-2r-alone0.9.partial.json"
    return sim.sim_frontier(config(tmp_path), KNOBS, 0.5, None, 1, lambda _l: None, 0.9, partial, prior)


def test_a_stopped_run_resumes_from_its_partial_file_and_ends_as_an_uninterrupted_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    whole = FakeRunPoint()
    expected = frontier(tmp_path / "whole", whole, monkeypatch)
    probes = len(whole.calls) - len(KNOBS)
    assert probes >= 3
    # Stopped in the rate search, then again in the grid: each run does only what the last one had not.
    stopped_at = [2, probes - 2 + 1]
    partial = tmp_path / "sim-conv-2r-alone0.9.partial.json"
    done = 0
    for allowed in stopped_at:
        fake = FakeRunPoint(allowed)
        prior = json.loads(partial.read_text()) if partial.exists() else None
        with pytest.raises(Stopped):
            frontier(tmp_path, fake, monkeypatch, prior)
        done += len(fake.calls)
        kept = json.loads(partial.read_text())
        assert kept["schema"] == progress.PARTIAL_SCHEMA
        assert len(kept["config"]["alone_probes"]) == min(done, probes)
        assert len(kept["runs"]) == max(0, done - probes)
    last = FakeRunPoint()
    resumed = frontier(tmp_path, last, monkeypatch, json.loads(partial.read_text()))
    assert whole.calls[done:] == last.calls
    assert resumed["points"] == expected["points"]
    assert resumed["config"]["rate_rps"] == expected["config"]["rate_rps"]
    assert resumed["config"]["alone_probes"] == expected["config"]["alone_probes"]


def test_a_result_file_lends_its_points_and_its_rate_search(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    done = frontier(tmp_path, FakeRunPoint(), monkeypatch)
    again = FakeRunPoint()
    assert frontier(tmp_path, again, monkeypatch, done)["points"] == done["points"]
    assert again.calls == []


def test_another_plan_or_trace_lends_nothing() -> None:
    config = {"replicas": 2, "window_s": 60.0, "slo": {"ttft_ms": 1.0, "tpot_ms": 2.0}, "rate_rps": 1.5}
    point = pts.Point(pts.SERVING_ALONE, "fine-tuning off", 1.0, 1.0, 0.0, None, 10).as_dict()
    prior = {"mode": "sim", "trace": {"name": "conv"}, "config": config, "points": [point], "runs": [{}]}
    kept = progress.kept_from(prior, "conv", config, KNOBS)
    assert list(kept.runs) == [(pts.SERVING_ALONE, "fine-tuning off")]
    assert kept.runs_at(1.5) == kept.runs and kept.runs_at(1.6) == {}
    with pytest.raises(ValueError, match="its replicas is 2, this run's 8"):
        progress.kept_from(prior, "conv", {**config, "replicas": 8}, KNOBS)
    with pytest.raises(ValueError, match="replayed trace 'conv', this run 'code'"):
        progress.kept_from(prior, "code", config, KNOBS)
    with pytest.raises(ValueError, match="not a simulated frontier"):
        progress.kept_from({**prior, "mode": "live"}, "conv", config, KNOBS)
