"""The live step's pure parts: per-minute series and the control's ticks from what the watcher saw."""

from __future__ import annotations

import pytest

from collm_bench.adaptation_step import Watch, control_ticks
from collm_bench.frontier.step import step_series


def test_each_minute_holds_the_attainment_of_its_arrivals_and_the_means_of_its_ticks() -> None:
    arrivals = [(5.0, True), (30.0, False), (61.0, True), (119.0, True), (150.0, False), (200.0, True)]
    ticks = [(10.0, 0.2, 0.1, 1.0), (50.0, 0.4, 0.3, 2.0), (130.0, 0.0, 0.0, 0.5)]
    series = step_series(arrivals, ticks, [1.0, 2.0], step_s=120.0)
    assert [r["t_min"] for r in series] == [0.0, 1.0, 2.0, 3.0]
    assert [r["load"] for r in series] == [1.0, 1.0, 2.0, 2.0]
    assert [r["requests"] for r in series] == [2, 2, 1, 1]
    assert [r["attainment"] for r in series] == [0.5, 1.0, 0.0, 1.0]
    assert series[0]["headroom"] == pytest.approx(0.3) and series[0]["spend"] == pytest.approx(0.2)
    assert series[0]["total_share"] == pytest.approx(1.5)
    assert series[1]["headroom"] is None  # no tick in that minute
    assert series[2]["total_share"] == pytest.approx(0.5)


def test_arrivals_outside_the_window_are_not_counted() -> None:
    series = step_series([(-1.0, True), (60.0, True), (120.0, False)], [], [1.0], step_s=120.0)
    assert [r["requests"] for r in series] == [0, 1]


def test_a_polls_share_is_the_sum_of_each_replicas_latest_telemetry_share() -> None:
    w = Watch(t0_unix_s=1000.0)
    w.telemetry = [(1.0, "r0", 0.2, 10.0), (2.0, "r1", 0.5, 0.0), (6.0, "r0", 0.8, 30.0)]
    w.coordinator = [(0.5, 1.0, 0.0), (3.0, 0.9, 0.1), (7.0, 0.5, 0.2)]
    assert control_ticks(w) == [(0.5, 1.0, 0.0, 0.0), (3.0, 0.9, 0.1, 0.7), (7.0, 0.5, 0.2, 1.3)]
