"""The dashboard's pure core: folding NATS messages into a bounded state, views, and who sees what."""

from __future__ import annotations

import json
import math

import pytest

from collm_common.clock import VirtualClock
from collm_common.wire.control import (
    CoordinatorDecisions,
    CoordinatorStatus,
    PlannedParticipant,
    PlannedRound,
    ReplicaDecision,
)
from collm_common.wire.rounds import RejectedUpdate, RoundOutcome
from collm_common.wire.telemetry import ReplicaTelemetry, ResidentAdapter
from collm_gateway.dashboard.state import (
    EVERYTHING,
    AdapterInfo,
    DashboardLimits,
    DashboardState,
    VersionInfo,
    Viewer,
    sse_message,
)

pytestmark = pytest.mark.unit

ACME = Viewer(tenant="acme")
GLOBEX = Viewer(tenant="globex")


def telemetry(rid: str = "r0", **kw) -> ReplicaTelemetry:
    values = {"replica_id": rid, "ts_unix_s": 1.0, "interval_s": 0.5, "model": "tiny", "max_batch": 8}
    values.update(kw)
    return ReplicaTelemetry(**values)


def outcome(
    round_id: int, state: str = "published", adapter: str = "ops", ts: float = 10.0, **kw
) -> RoundOutcome:
    return RoundOutcome(round_id=round_id, adapter=adapter, state=state, base_version=1, ts_unix_s=ts, **kw)


def adapter(name: str, owner: str | None = None, versions: int = 2) -> AdapterInfo:
    vs = tuple(
        VersionInfo(version=n, created_unix_s=100.0 * n, source="round", quality={"ops": 2.0 - 0.1 * n})
        for n in range(1, versions + 1)
    )
    return AdapterInfo(name, owner, versions or None, vs)


def test_telemetry_becomes_a_replica_view_with_a_bounded_history() -> None:
    clock = VirtualClock(start_s=1000.0)
    st = DashboardState(clock, DashboardLimits(history_points=3))
    for i in range(5):
        clock.advance(0.5)
        (u,) = st.on_telemetry(telemetry(running=4, queue_len=i, tokens_per_s=10.0 * i, slo_attainment=0.9))
        assert u.topic == "replica" and u.scope.cluster
        assert u.payload["point"] == {
            "t": 1000.0 + 0.5 * (i + 1),
            "tokens_per_s": 10.0 * i,
            "ft_tokens_per_s": 0.0,
            "queue_len": i,
            "running": 4,
            "slo_attainment": 0.9,
            "ttft_ms_p99": None,
            "tpot_ms_p99": None,
            "ft_share": 0.0,
        }
    (view,) = st.snapshot(EVERYTHING)["replicas"]
    assert view["id"] == "r0" and view["load"] == 0.5 and view["queue_len"] == 4
    assert [p["queue_len"] for p in view["history"]] == [2, 3, 4]  # the newest 3


def test_a_replica_turns_stale_then_is_forgotten() -> None:
    clock = VirtualClock()
    st = DashboardState(
        clock, DashboardLimits(stale_after_s=3.0, stale_after_intervals=3.0, forget_replica_after_s=60)
    )
    st.on_telemetry(telemetry("r0", interval_s=2.0))
    clock.advance(5.0)  # stale only after max(3 s, 3 intervals = 6 s)
    assert st.snapshot(EVERYTHING)["replicas"][0]["fresh"] is True
    clock.advance(2.0)
    (view,) = st.snapshot(EVERYTHING)["replicas"]
    assert view["fresh"] is False and view["age_s"] == 7.0
    assert st.expire() == []
    clock.advance(60.0)
    (gone,) = st.expire()
    assert gone.topic == "replica_removed" and gone.payload == {"id": "r0"}
    assert st.snapshot(EVERYTHING)["replicas"] == []


def test_replicas_are_bounded() -> None:
    st = DashboardState(VirtualClock(), DashboardLimits(replicas=2))
    assert st.on_telemetry(telemetry("a")) and st.on_telemetry(telemetry("b"))
    assert st.on_telemetry(telemetry("c")) == []
    assert [r["id"] for r in st.snapshot(EVERYTHING)["replicas"]] == ["a", "b"]


def test_views_are_json_without_nan() -> None:
    st = DashboardState(VirtualClock())
    st.on_telemetry(
        telemetry(
            ft_loss=math.nan,
            tokens_per_s=math.inf,
            adapters=[ResidentAdapter(name="ops", version_id="ops@v2", version=2)],
        )
    )
    st.on_round(outcome(1, eval_loss_before=math.nan, domain_losses_after={"ops": math.inf}))
    snap = st.snapshot(EVERYTHING)
    text = sse_message("snapshot", snap)  # json.dumps(allow_nan=False) would raise on a NaN
    assert text.startswith("event: snapshot\ndata: {") and text.endswith("}\n\n") and text.count("\n") == 3
    data = json.loads(text.split("data: ", 1)[1])
    rep = data["replicas"][0]
    assert (
        rep["ft_loss"] is None
        and rep["tokens_per_s"] is None
        and rep["adapters"][0]["version_id"] == "ops@v2"
    )
    assert data["rounds"][0]["eval_loss_before"] is None and data["rounds"][0]["domain_losses_after"] == {
        "ops": None
    }


def test_coordinator_decisions_and_status_fold_into_one_view() -> None:
    st = DashboardState(VirtualClock(), DashboardLimits(slow_decisions=2))
    fast = CoordinatorDecisions(
        ts_unix_s=5.0,
        policy="collm",
        loop="fast",
        replicas=[
            ReplicaDecision(
                replica_id="r0", ft_share=0.3, routing_weight=0.6, reason="slack", reason_code="slack"
            )
        ],
    )
    (u,) = st.on_decisions(fast)
    assert u.topic == "coordinator" and u.scope.cluster
    assert u.payload["coordinator"]["fast"]["replicas"][0] == {
        "replica_id": "r0", "ft_share": 0.3, "routing_weight": 0.6, "reason_code": "slack", "reason": "slack",
    }  # fmt: skip
    assert st.on_decisions(fast.model_copy(update={"ts_unix_s": 4.0})) == []  # an older fast decision
    for ts in (1.0, 2.0, 3.0):
        assert st.on_decisions(CoordinatorDecisions(ts_unix_s=ts, policy="collm", loop="slow", note=f"n{ts}"))
    assert st.on_decisions(CoordinatorDecisions(ts_unix_s=3.0, policy="collm", loop="slow")) == []  # seen
    plan = PlannedRound(
        adapter="ops",
        round_id=7,
        state="training",
        base_version=2,
        deadline_unix_s=50.0,
        participants=[PlannedParticipant(replica_id="r0", token_budget=128, share=0.4)],
    )
    (u,) = st.on_coordinator_status(
        CoordinatorStatus(ts_unix_s=6.0, policy="collm", attainment=0.97, live=["r0"], rounds=[plan])
    )
    view = u.payload["coordinator"]
    assert [d["note"] for d in view["slow"]] == ["n3.0", "n2.0"]  # newest first, bounded
    assert view["attainment"] == 0.97 and view["live"] == ["r0"] and view["policy"] == "collm"
    assert view["plans"][0]["round_id"] == 7
    assert view["plans"][0]["participants"] == [
        {"replica_id": "r0", "token_budget": 128, "share": 0.4, "reason": ""}
    ]


def test_rounds_keep_their_latest_state_and_are_bounded() -> None:
    st = DashboardState(VirtualClock(), DashboardLimits(rounds=3))
    st.on_round(outcome(1, "opened", ts=1.0, timeline={"opened": 1.0}, participants=["r0", "r1"]))
    (u,) = st.on_round(
        outcome(
            1,
            "published",
            ts=9.5,
            new_version=2,
            timeline={"opened": 1.0, "collecting": 1.5, "published": 9.5},
            accepted=["r0"],
            rejected=[RejectedUpdate(replica_id="r1", reason="norm too large", code="norm")],
        )
    )
    r = u.payload["round"]
    assert (r["state"], r["final"], r["duration_s"], r["new_version_id"]) == (
        "published",
        True,
        8.5,
        "ops@v2",
    )
    assert r["rejected"] == [{"replica_id": "r1", "code": "norm", "reason": "norm too large"}]
    assert list(r["timeline"]) == ["opened", "collecting", "published"]
    assert st.on_round(outcome(1, "collecting", ts=3.0)) == []  # a late event never rewinds a round
    for rid in (2, 3, 4):
        st.on_round(outcome(rid, "collecting", ts=float(rid)))
    assert [x["round_id"] for x in st.snapshot(EVERYTHING)["rounds"]] == [4, 3, 2]  # newest first, 3 kept
    assert st.on_round(outcome(1, "aborted", ts=20.0)) == []  # older than every round kept
    active = st.snapshot(EVERYTHING)["rounds"][0]
    assert active["final"] is False and active["duration_s"] is None


def test_round_records_fold_like_events() -> None:
    st = DashboardState(VirtualClock())
    st.on_round(outcome(2, "published", ts=5.0))
    ups = st.on_rounds([outcome(3, "aborted", ts=6.0), outcome(2, "evaluating", ts=4.0), outcome(1, ts=1.0)])
    assert [u.payload["round"]["round_id"] for u in ups] == [1, 3]
    assert [r["state"] for r in st.snapshot(EVERYTHING)["rounds"]] == ["aborted", "published", "published"]


def test_adapter_versions_with_quality_are_bounded_and_sent_on_change_only() -> None:
    st = DashboardState(VirtualClock(), DashboardLimits(versions_per_adapter=3))
    (u,) = st.on_adapter(adapter("ops", versions=5))
    view = u.payload["adapter"]
    assert [v["id"] for v in view["versions"]] == ["ops@v3", "ops@v4", "ops@v5"]
    assert view["current_id"] == "ops@v5" and view["versions"][-1]["current"] is True
    assert view["versions"][0]["quality"] == {"ops": 1.7}
    assert st.on_adapter(adapter("ops", versions=5)) == []
    (u,) = st.on_adapter(adapter("ops", versions=6))
    assert u.payload["adapter"]["versions"][-1]["id"] == "ops@v6"


def test_adapters_are_bounded_and_a_listing_removes_the_unlisted() -> None:
    st = DashboardState(VirtualClock(), DashboardLimits(adapters=2))
    st.on_adapters([adapter("a"), adapter("b"), adapter("c")])
    assert [a["name"] for a in st.snapshot(EVERYTHING)["adapters"]] == ["a", "b"]
    ups = st.on_adapters([adapter("b"), adapter("c")])
    assert [(u.topic, u.payload.get("name") or u.payload["adapter"]["name"]) for u in ups] == [
        ("adapter_removed", "a"),
        ("adapter", "c"),
    ]


def test_a_tenant_sees_its_own_and_shared_adapters_and_their_rounds_and_no_cluster() -> None:
    st = DashboardState(VirtualClock())
    st.on_adapters([adapter("shared"), adapter("mine", owner="acme"), adapter("theirs", owner="globex")])
    for rid, name in enumerate(("shared", "mine", "theirs"), start=1):
        st.on_round(outcome(rid, adapter=name))
    st.on_telemetry(telemetry())
    st.on_decisions(CoordinatorDecisions(ts_unix_s=1.0, policy="collm", loop="fast"))

    snap = st.snapshot(ACME)
    assert snap["access"] == {"cluster": False, "all_adapters": False, "tenant": "acme"}
    assert snap["replicas"] is None and snap["coordinator"] is None
    assert [a["name"] for a in snap["adapters"]] == ["mine", "shared"]
    assert sorted(r["adapter"] for r in snap["rounds"]) == ["mine", "shared"]
    assert [a["name"] for a in st.snapshot(EVERYTHING)["adapters"]] == ["mine", "shared", "theirs"]
    assert len(st.snapshot(EVERYTHING)["rounds"]) == 3

    (theirs,) = st.on_round(outcome(9, adapter="theirs"))
    (mine,) = st.on_round(outcome(10, adapter="mine"))
    (rep,) = st.on_telemetry(telemetry())
    assert not theirs.visible_to(ACME) and theirs.visible_to(GLOBEX) and theirs.visible_to(EVERYTHING)
    assert mine.visible_to(ACME) and not mine.visible_to(GLOBEX)
    assert not rep.visible_to(ACME) and rep.visible_to(EVERYTHING)
    assert Viewer(all_adapters=True).sees_adapter("x", owner_known=False)


def test_rounds_of_an_unknown_adapter_reach_its_tenant_once_the_owner_is_known() -> None:
    st = DashboardState(VirtualClock())
    (early,) = st.on_round(outcome(1, adapter="new"))
    assert early.visible_to(EVERYTHING) and not early.visible_to(ACME)
    assert st.snapshot(ACME)["rounds"] == []
    ups = st.on_adapter(adapter("new", owner="acme"))
    assert [u.topic for u in ups] == ["adapter", "round"]
    assert all(u.visible_to(ACME) and not u.visible_to(GLOBEX) for u in ups)
    assert [r["round_id"] for r in st.snapshot(ACME)["rounds"]] == [1]


def test_an_owner_change_removes_the_adapter_from_its_former_tenant() -> None:
    st = DashboardState(VirtualClock())
    st.on_adapter(adapter("ops", owner="acme"))
    removed, added = st.on_adapter(adapter("ops", owner="globex"))
    assert removed.topic == "adapter_removed" and removed.visible_to(ACME) and not removed.visible_to(GLOBEX)
    assert added.topic == "adapter" and added.visible_to(GLOBEX) and not added.visible_to(ACME)
    (gone,) = st.remove_adapter("ops")
    assert gone.visible_to(GLOBEX) and st.remove_adapter("ops") == []


def test_a_plan_whose_round_ended_leaves_the_coordinator_view() -> None:
    st = DashboardState(VirtualClock())
    plan = PlannedRound(adapter="ops", round_id=3, state="collecting", base_version=1, deadline_unix_s=9.0)
    st.on_coordinator_status(CoordinatorStatus(ts_unix_s=1.0, policy="collm", rounds=[plan]))
    assert [p["round_id"] for p in st.coordinator_view()["plans"]] == [3]
    assert [u.topic for u in st.on_round(outcome(3, "collecting", ts=2.0))] == ["round"]
    ups = st.on_round(outcome(3, "published", ts=3.0))
    assert [u.topic for u in ups] == ["round", "coordinator"]
    assert ups[1].payload["coordinator"]["plans"] == [] and st.coordinator_view()["plans"] == []
