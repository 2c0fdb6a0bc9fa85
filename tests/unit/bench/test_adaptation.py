"""The adaptation benchmark's arithmetic: curves, served loss over time, the goal, the table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from collm_bench import adaptation

pytestmark = pytest.mark.unit

T0 = 1000.0
VERSIONS = [
    {"version": 3, "created_unix_s": T0 + 300, "source": "round"},
    {"version": 1, "created_unix_s": T0 + 20, "source": "create"},
    {"version": 2, "created_unix_s": T0 + 100, "source": "round"},
    {"version": 4, "created_unix_s": T0 + 950, "source": "round"},  # after the window
]
QUALITY = {1: {"math": 2.0}, 2: {"math": 1.9}, 3: {"math": 1.7}, 4: {"math": 1.5}}


def test_served_loss_follows_the_published_versions_and_the_goal_is_judged_at_the_end() -> None:
    pts = adaptation.version_points(VERSIONS, QUALITY, "math", T0)
    assert [p["version"] for p in pts] == [1, 2, 3, 4]
    assert adaptation.base_loss(pts) == 2.0
    assert adaptation.served_loss_at(pts, 10) is None
    assert adaptation.served_loss_at(pts, 150) == 1.9
    s = adaptation.adapter_summary(pts, 900.0)
    assert s["final_loss"] == 1.7 and s["rel_change"] == pytest.approx(-0.15)
    assert s["goal_met"] and s["goal_reached_at_s"] == 300.0 and s["versions_published"] == 2
    short = adaptation.adapter_summary(pts, 200.0)
    assert not short["goal_met"] and short["goal_reached_at_s"] is None


def test_an_adapter_without_a_recorded_base_has_no_change() -> None:
    pts = adaptation.version_points(VERSIONS[:1], {}, "math", T0)
    s = adaptation.adapter_summary(pts, 900.0)
    assert s["base_loss"] is None and s["rel_change"] is None and not s["goal_met"]


def test_rounds_are_summarised_with_their_gate_test() -> None:
    rounds = [
        {
            "round_id": 2,
            "adapter": "math",
            "state": "held_back",
            "timeline": {"opened": T0 + 60, "held_back": T0 + 110},
            "participants": ["r0", "r1"],
            "accepted": ["r0", "r1"],
            "gain_diff_nats": -0.001,
            "gain_se_nats": 0.004,
            "gain_examples": 64,
        },
        {
            "round_id": 1,
            "adapter": "math",
            "state": "published",
            "timeline": {"opened": T0 + 30, "published": T0 + 95},
            "participants": ["r0", "r1"],
            "accepted": ["r0"],
            "new_version": 2,
        },
    ]
    r = adaptation.round_summary(rounds, T0)
    assert r["by_state"] == {"held_back": 1, "published": 1}
    assert [x["round_id"] for x in r["rounds"]] == [1, 2]
    assert r["rounds"][0]["opened_s"] == 30.0 and r["rounds"][0]["duration_s"] == 65.0
    assert r["rounds"][1]["gain_se_nats"] == 0.004


def test_every_committed_result_regenerates_its_table() -> None:
    for path in sorted(
        Path(adaptation.__file__).resolve().parents[2].glob("bench/results/adaptation/*.json")
    ):
        result = json.loads(path.read_text())
        assert result["schema"] == adaptation.RESULT_SCHEMA
        text = adaptation.table(result)
        for name in result["adapters"]:
            assert f"| {name} |" in text


def test_the_table_names_the_host_a_result_recorded() -> None:
    result = {
        "adapters": {},
        "rounds": {"total": 0, "by_state": {}},
        "serving": None,
        "host": {"cpu": "AMD EPYC", "cpus": 2, "flags": ["avx2"], "matmul_dtype": "float32"},
    }
    assert adaptation.table(result).endswith("Host: AMD EPYC (2 CPUs; float32 products; CPU: avx2).")
    result["host"] |= {"small_step_f16_rows": 3, "flags": ["avx2", "f16c"]}
    want = "Host: AMD EPYC (2 CPUs; float32 products, fp16 copies for steps of <= 3 tokens; CPU: avx2, f16c)."
    assert adaptation.table(result).endswith(want)
    del result["host"]
    assert "Host:" not in adaptation.table(result)
