"""The per-version quality join: served loss and quality gain per request, hand-computed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from collm_bench.quality_store import adapter_names
from collm_workload.goodput import summarize
from collm_workload.quality import QualityTable, quality_summary
from collm_workload.records import RequestRecord

pytestmark = pytest.mark.unit

TABLE = {
    "base": {"medical": 2.0, "math": 1.0},
    "medical@v1": {"medical": 1.5},
    "medical@v2": {"medical": 1.2, "math": 0.95},
    "math@v1": 0.9,
}


def served(index: int, domain: str, version: str | None, end_s: float, status: str = "ok") -> RequestRecord:
    return RequestRecord(
        request_id=f"r{index}",
        index=index,
        domain=domain,
        model=domain,
        status=status,  # type: ignore[arg-type]
        scheduled_s=end_s - 0.5,
        sent_s=end_s - 0.5,
        end_s=end_s,
        ttft_ms=100.0,
        e2e_ms=500.0,
        completion_tokens=5,
        adapter_version=version,
    )


def test_lookup_rules() -> None:
    t = QualityTable.from_obj(TABLE)
    assert t.served_loss("medical@v1", "medical") == (1.5, "exact")
    assert t.served_loss("medical@v2", "math") == (0.95, "exact")
    # A replica-local refresh joins with its published parent.
    assert t.served_loss("medical@v2+r3.1", "medical") == (1.2, "parent")
    # A bare number is the version's loss on whatever domain it served.
    assert t.served_loss("math@v1", "math") == (0.9, "exact")
    assert t.served_loss("base", "medical") == (2.0, "base")
    assert t.served_loss("medical@v9", "medical") == (None, None)
    assert t.served_loss("medical@v1", "code") == (None, None)
    assert t.served_loss(None, "medical") == (None, None)


def test_quality_summary_hand_computed() -> None:
    t = QualityTable.from_obj(TABLE)
    recs = [
        served(0, "medical", "medical@v1", 1.0),  # gain 0.5
        served(1, "medical", "medical@v2+r1.1", 2.0),  # gain 0.8 (parent)
        served(2, "math", "math@v1", 3.0),  # gain 0.1
        served(3, "medical", "base", 4.0),  # gain 0
        served(4, "medical", None, 5.0),  # unknown version: not joined
        served(5, "medical", "medical@v2", 6.0, status="error"),  # not served: ignored
    ]
    q = quality_summary(recs, t)
    assert q["requests_served"] == 5 and q["requests_with_version"] == 4 and q["requests_joined"] == 4
    assert q["joined_via"] == {"exact": 2, "parent": 1, "base": 1}
    assert q["mean_quality_gain"] == pytest.approx((0.5 + 0.8 + 0.1 + 0.0) / 4)
    assert q["mean_served_loss"] == pytest.approx((1.5 + 1.2 + 0.9 + 2.0) / 4)
    med = q["by_domain"]["medical"]
    # The last joined medical request was served by the base model.
    assert med["last_version"] == "base" and med["last_quality_gain"] == pytest.approx(0.0)
    assert med["mean_quality_gain"] == pytest.approx((0.5 + 0.8 + 0.0) / 3)
    assert q["by_domain"]["math"]["last_quality_gain"] == pytest.approx(0.1)
    assert q["final_quality_gain"] == pytest.approx((0.0 + 0.1) / 2)
    assert q["versions_served"] == {
        "base": 1,
        "math@v1": 1,
        "medical@v1": 1,
        "medical@v2+r1.1": 1,
        "unknown": 1,
    }


def test_summary_carries_quality_and_timeline_gain(tmp_path: Path) -> None:
    path = tmp_path / "q.json"
    path.write_text(json.dumps(TABLE))
    t = QualityTable.load(path)
    recs = [served(0, "medical", "medical@v1", 1.0), served(1, "medical", "medical@v2", 12.0)]
    s = summarize(recs, quality=t, timeline_bin_s=10.0)
    assert s["quality"]["mean_quality_gain"] == pytest.approx((0.5 + 0.8) / 2)
    assert s["timeline"]["mean_quality_gain"] == pytest.approx([0.5, 0.8])


def test_without_base_loss_there_is_no_gain() -> None:
    t = QualityTable.from_obj({"medical@v1": {"medical": 1.5}})
    q = quality_summary([served(0, "medical", "medical@v1", 1.0)], t)
    assert q["mean_served_loss"] == pytest.approx(1.5) and q["mean_quality_gain"] is None


def test_bad_tables_are_refused() -> None:
    with pytest.raises(ValueError):
        QualityTable.from_obj({"medical@v1": "low"})
    with pytest.raises(ValueError):
        QualityTable.from_obj([1, 2])  # type: ignore[arg-type]


def test_adapter_names_from_versions() -> None:
    assert adapter_names(["medical@v3", "medical@v4+r1.2", "base", None, "math@v1"]) == ["math", "medical"]
