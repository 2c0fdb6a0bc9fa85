"""The simulator-vs-live check of a live frontier: errors, the median against the bound, the config the
simulator reruns, and how the tables show it."""

from __future__ import annotations

from pathlib import Path

import pytest

from collm_bench.frontier.agree import BOUND, agreement, relative_error, sim_config, summarize
from collm_bench.frontier.points import Point, evaluate_goals
from collm_bench.frontier.render import agreement_line, goals_table, markdown

pytestmark = pytest.mark.unit

CALIBRATION = Path(__file__).resolve().parents[3] / "bench" / "calibration" / "smollm2.json"


def row(live: float | None, sim: float | None) -> dict[str, object]:
    return {
        "policy": "collm",
        "knob": "k",
        "live_goodput_rps": live,
        "sim_goodput_rps": sim,
        "error": relative_error(sim, live),
    }


def test_relative_error_is_against_live_and_undefined_without_it() -> None:
    assert relative_error(1.2, 1.0) == pytest.approx(0.2)
    assert relative_error(0.7, 1.0) == pytest.approx(0.3)
    assert relative_error(0.5, 0.0) is None
    assert relative_error(None, 1.0) is None
    assert relative_error(1.0, None) is None


def test_the_check_is_the_median_of_the_defined_errors() -> None:
    got = summarize([row(1.0, 1.1), row(1.0, 1.5), row(1.0, 1.2), row(0.0, 0.3)])
    assert got["median_error"] == pytest.approx(0.2)
    assert got["within_bound"] is True and got["bound"] == BOUND
    assert len(got["points"]) == 4
    assert summarize([row(1.0, 1.5), row(1.0, 1.4)])["within_bound"] is False
    none = summarize([row(0.0, 1.0)])
    assert none["median_error"] is None and none["within_bound"] is None


def live_doc(window_s: float = 20.0) -> dict[str, object]:
    points = [
        Point("serving_only", "fine-tuning off", 0.9, 0.5, 0, 0.0, 12),
        Point("fixed_ratio", "K=4 (share 0.20)", 0.8, 0.4, 100, 0.01, 12, {"fixed_ratio_k": 4}),
    ]
    return {
        "mode": "live",
        "trace": {"name": "conv", "label": "azure 2023 conv"},
        "config": {
            "model": "smollm2",
            "replicas": 2,
            "window_s": window_s,
            "drain_s": 10.0,
            "rate_rps": 0.6,
            "slo": {"ttft_ms": 9000.0, "tpot_ms": 450.0},
            "domains": ["math", "medical"],
            "seed": 0,
        },
        "points": [p.as_dict() for p in points],
    }


def test_the_simulator_reruns_the_live_configuration() -> None:
    cfg, slo, rate = sim_config(live_doc())
    assert (cfg.replicas, cfg.duration_s, cfg.drain_s, cfg.traces) == (2, 20.0, 10.0, ("conv",))
    assert cfg.domains == ("math", "medical") and cfg.model == "smollm2"
    assert (slo.ttft_ms, slo.tpot_ms, rate) == (9000.0, 450.0, 0.6)


def test_agreement_simulates_every_point(tmp_path: Path) -> None:
    if not (Path(__file__).resolve().parents[4] / "shared" / "data" / "traces").is_dir():
        pytest.skip("the Azure traces (../shared/data/traces) are not here")
    lines: list[str] = []
    got = agreement(live_doc(), lines.append, CALIBRATION)
    assert [r["knob"] for r in got["points"]] == ["fine-tuning off", "K=4 (share 0.20)"]
    for r in got["points"]:
        assert r["sim_goodput_rps"] >= 0
        assert r["error"] == pytest.approx(relative_error(r["sim_goodput_rps"], r["live_goodput_rps"]))
    assert len(lines) == 2


def test_tables_carry_the_check() -> None:
    agree = summarize([row(1.0, 1.1), row(1.0, 1.3), row(1.0, 1.2)])
    assert agreement_line(agree) == (
        "Simulator vs live: median goodput error 20% over 3 points, within the 25% bound."
    )
    doc = live_doc()
    doc |= {"goals": evaluate_goals([Point.from_dict(p) for p in doc["points"]]), "agreement": agree}
    assert markdown(doc).endswith(agreement_line(agree))
    assert "| live conv, 2 replicas, 0.60 req/s, sync 25-s rounds; sim error 20% | " in goals_table([doc])
