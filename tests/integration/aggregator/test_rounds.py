"""Federated rounds against real NATS and Redis, with participant doubles (tests/doubles/participant.py).

The aggregator runs in-process (`Aggregator`, the object `python -m collm_aggregator` runs); the
participants are doubles speaking the real protocol. The same scenarios with real replica processes
are in test_real_replicas.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import pytest
import pytest_asyncio

from collm_aggregator.service import Aggregator
from collm_aggregator.settings import AggregatorSettings
from collm_common import subjects
from collm_common.adapter_io import export_peft_dir
from collm_common.bus import Bus, BusError
from collm_common.clock import WallClock
from collm_common.lora import encode_adapter
from collm_common.store import AdapterStore
from collm_common.wire import decode, encode
from collm_common.wire.adapters import AdapterPublished
from collm_common.wire.admin import (
    AdapterVersionInfo,
    AggregatorStatus,
    GetRound,
    ImportAdapter,
    ListRounds,
    RollbackAdapter,
    RoundDetail,
    RoundList,
    StatusRequest,
)
from collm_common.wire.rounds import ParticipantPlan, RoundOutcome, RoundPlan
from tests.doubles.participant import BASE_MODEL, ParticipantBehaviour, ParticipantDouble, tiny_adapter

pytestmark = pytest.mark.integration
ADAPTER = "med"
T = TypeVar("T")


def settings(nats_url: str, redis_url: str, prefix: str, **kw: object) -> AggregatorSettings:
    base: dict[str, object] = {
        "nats_url": nats_url,
        "redis_url": redis_url,
        "redis_prefix": prefix,
        "nats_connect_timeout_s": 5,
        "default_plan": False,
        "eval_timeout_s": 5,
        "control_timeout_s": 2,
        "consumer_name": f"agg-{prefix}",
        "eval_task_examples": 0,  # the task-metric probe asks more evaluations; one test turns it on
    }
    base.update(kw)
    return AggregatorSettings(**base)  # type: ignore[arg-type]


class Cluster:
    """An aggregator, participant doubles and a client bus on one NATS + Redis pair."""

    def __init__(self, nats_url: str, redis_url: str, prefix: str) -> None:
        self.nats_url, self.redis_url, self.prefix = nats_url, redis_url, prefix
        self.events: list[RoundOutcome] = []
        self.published: list[AdapterPublished] = []
        self.doubles: dict[str, ParticipantDouble] = {}
        self.agg: Aggregator | None = None

    async def __aenter__(self) -> Cluster:
        s = settings(self.nats_url, self.redis_url, self.prefix)
        self.client = await Bus.connect(s, "test-client")
        self.store = AdapterStore.from_url(self.redis_url, self.prefix)
        self.double_bus = await Bus.connect(s, "doubles")

        async def on_event(o: RoundOutcome, _m: object) -> None:
            self.events.append(o)

        async def on_pub(p: AdapterPublished, _m: object) -> None:
            self.published.append(p)

        await self.client.subscribe(subjects.round_events_all(), RoundOutcome, on_event)
        await self.client.subscribe(subjects.adapter_published_all(), AdapterPublished, on_pub)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop_aggregator()
        for d in self.doubles.values():
            await d.stop()
        await self.double_bus.close()
        await self.client.close()
        await self.store.close()

    async def start_aggregator(self, **kw: object) -> Aggregator:
        s = settings(self.nats_url, self.redis_url, self.prefix, **kw)
        self.agg_bus = await Bus.connect(s, "collm-aggregator")
        self.agg_store = AdapterStore.from_url(s.redis_url, s.redis_prefix, s.retention_versions)
        self.agg = Aggregator(s, self.agg_bus, self.agg_store, WallClock())
        await self.agg.start()
        await self.client.sync()  # so that its first request finds the aggregator's endpoints
        return self.agg

    async def stop_aggregator(self) -> None:
        if self.agg is not None:
            await self.agg.stop()
            await self.agg_bus.close()
            await self.agg_store.close()
            self.agg = None

    async def add(self, rid: str, **behaviour: object) -> ParticipantDouble:
        d = ParticipantDouble(self.double_bus, self.store, rid, ParticipantBehaviour(**behaviour))  # type: ignore[arg-type]
        self.doubles[rid] = await d.start()
        return d

    async def seed_v1(self, name: str = ADAPTER) -> None:
        await self.store.publish(
            name,
            encode_adapter(tiny_adapter()),
            expected_current=None,
            base_model=BASE_MODEL,
            source="create",
        )

    async def open(self, participants: list[str], quorum: int, deadline_s: float = 10.0) -> RoundOutcome:
        now = time.time()
        plan = RoundPlan(
            adapter=ADAPTER,
            base_version=await self.store.current(ADAPTER) or 1,
            participants=[ParticipantPlan(replica_id=r, token_budget=256) for r in participants],
            quorum=quorum,
            opened_unix_s=now,
            deadline_unix_s=now + deadline_s,
            policy="test",
        )
        return await self.client.request(subjects.aggregator("open_round"), plan, RoundOutcome, timeout_s=5)

    async def wait_final(self, round_id: int, timeout_s: float = 20.0) -> RoundOutcome:
        return await wait_for(
            lambda: next(
                (
                    e
                    for e in self.events
                    if e.round_id == round_id and e.state in ("published", "held_back", "aborted")
                ),
                None,
            ),
            timeout_s,
        )


async def wait_for_async(probe: Callable[[], Awaitable[T]], timeout_s: float) -> T:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = await probe()
        if v:
            return v
        await asyncio.sleep(0.05)
    raise AssertionError(f"condition not met within {timeout_s}s")


async def wait_for(probe: Callable[[], object], timeout_s: float) -> object:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = probe()
        if v:
            return v
        await asyncio.sleep(0.05)
    raise AssertionError(f"condition not met within {timeout_s}s")


@pytest_asyncio.fixture
async def cluster(nats_server, redis_server, redis_prefix) -> AsyncIterator[Cluster]:
    async with Cluster(nats_server.url, redis_server.url, redis_prefix) as c:
        yield c


async def version_digests(store: AdapterStore, name: str = ADAPTER) -> dict[int, str]:
    return {r.version: r.sha256 for r in await store.list_versions(name)}


async def test_round_publishes_despite_poisoned_updates_and_rollback_never_overwrites(
    cluster: Cluster,
) -> None:
    await cluster.seed_v1()
    await cluster.start_aggregator()
    for i in range(3):
        await cluster.add(f"r{i}", domain=f"d{i}", num_samples=100 * (i + 1))
    await cluster.add("evil-nan", mode="nan")
    await cluster.add("evil-base", mode="wrong_base")
    stranger = await cluster.add("stranger")
    opened = await cluster.open(["r0", "r1", "r2", "evil-nan", "evil-base"], quorum=3)
    assert opened.state == "opened" and opened.round_id == 1
    await stranger.inject_update(1, ADAPTER, 1)  # not a participant of round 1
    out = await cluster.wait_final(1)
    assert out.state == "published", out.reason
    assert sorted(out.accepted) == ["r0", "r1", "r2"]
    codes = {r.replica_id: r.code for r in out.rejected}
    assert codes == {
        "evil-nan": "not_finite",
        "evil-base": "wrong_base_version",
        "stranger": "not_participant",
    }
    assert out.new_version == 2 and out.eval_loss_after < out.eval_loss_before
    assert set(out.domain_losses_after) == {"d0", "d1", "d2"}  # refused senders do not evaluate
    assert list(out.timeline) == ["opened", "collecting", "aggregating", "evaluating", "published"]
    assert await cluster.store.current(ADAPTER) == 2
    rec = await cluster.store.get_version(ADAPTER, 2)
    assert (rec.source, rec.round_id, rec.parent) == ("round", 1, 1)
    # Each version's loss per site (a replica's share of a domain), and one comparable number per domain:
    # v1 anchors at its own scores, v2 = v1 + the change on the same sites.
    q1, q2 = await cluster.store.quality(ADAPTER, 1), await cluster.store.quality(ADAPTER, 2)
    assert set(q2) == {"d0", "d1", "d2"} and q2 == pytest.approx(out.domain_losses_after)
    assert q1 == pytest.approx(out.domain_losses_before) and out.new_version_quality == q2
    sites = await cluster.store.site_quality(ADAPTER, 2)
    assert sorted(sites) == [f"d{i}|r{i}|held-out-1" for i in range(3)]
    assert sites["d0|r0|held-out-1"]["loss"] == pytest.approx(out.domain_losses_after["d0"])
    # Every participant that listens swapped the new version in (digest-checked load).
    await wait_for(lambda: all(cluster.doubles[r].served.get(ADAPTER) == 2 for r in ("r0", "r1", "r2")), 5)
    # Every update was acknowledged once it was recorded: nothing pending, nothing redelivered.
    info = await cluster.client.js.consumer_info(subjects.STREAM_UPDATES, f"agg-{cluster.prefix}")
    assert (info.num_ack_pending, info.num_redelivered, info.num_pending) == (0, 0, 0)
    # Every phase was announced, in order.
    states = [e.state for e in cluster.events if e.round_id == 1]
    assert states == ["opened", "collecting", "aggregating", "evaluating", "published"]
    digests = await version_digests(cluster.store)

    # Rollback republishes v1's content as v3; nothing is overwritten.
    info = await cluster.client.request(
        subjects.aggregator("rollback"), RollbackAdapter(adapter=ADAPTER, to_version=1), AdapterVersionInfo
    )
    assert (info.version, info.source, info.parent) == (3, "rollback", 1)
    assert info.sha256 == digests[1]
    await wait_for(lambda: all(cluster.doubles[r].served.get(ADAPTER) == 3 for r in ("r0", "r1", "r2")), 5)
    assert [p.source for p in cluster.published] == ["round", "rollback"]
    after = await version_digests(cluster.store)
    assert {k: after[k] for k in digests} == digests
    with pytest.raises(BusError) as err:
        await cluster.client.request(
            subjects.aggregator("rollback"),
            RollbackAdapter(adapter=ADAPTER, to_version=99),
            AdapterVersionInfo,
        )
    assert err.value.code == 404

    # The record is there for `rounds list|show`.
    lst = await cluster.client.request(subjects.aggregator("rounds"), ListRounds(), RoundList)
    assert [o.round_id for o in lst.rounds] == [1] and lst.rounds[0].state == "published"
    detail = await cluster.client.request(subjects.aggregator("round"), GetRound(round_id=1), RoundDetail)
    # Every update that arrived is on record, refused ones included.
    assert {u.update.replica_id for u in detail.updates} == {
        "r0",
        "r1",
        "r2",
        "evil-nan",
        "evil-base",
        "stranger",
    }
    assert {e.replica_id for e in detail.evals} >= {"r0", "r1", "r2"}
    assert detail.candidate_key and detail.candidate_sha256
    with pytest.raises(BusError) as err:
        await cluster.client.request(subjects.aggregator("round"), GetRound(round_id=42), RoundDetail)
    assert err.value.code == 404


def metric(name: str, **labels: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_huge_norm_update_is_rejected(cluster: Cluster) -> None:
    rejected_before = metric("collm_aggregator_rejected_updates_total", reason="norm_too_large")
    rounds_before = metric("collm_aggregator_rounds_total", adapter=ADAPTER, state="published")
    bytes_before = metric("collm_aggregator_update_bytes_total")
    await cluster.seed_v1()
    await cluster.start_aggregator()
    for i in range(3):
        await cluster.add(f"r{i}")
    await cluster.add("evil-huge", mode="huge")
    await cluster.open(["r0", "r1", "r2", "evil-huge"], quorum=2)
    out = await cluster.wait_final(1)
    assert out.state == "published"
    assert {r.replica_id: r.code for r in out.rejected} == {"evil-huge": "norm_too_large"}
    assert metric("collm_aggregator_rejected_updates_total", reason="norm_too_large") == rejected_before + 1
    assert metric("collm_aggregator_rounds_total", adapter=ADAPTER, state="published") == rounds_before + 1
    assert metric("collm_aggregator_update_bytes_total") > bytes_before
    assert metric("collm_aggregator_aggregation_seconds_count", strategy="product_svd") >= 1


async def test_silent_participant_never_blocks_past_the_deadline(cluster: Cluster) -> None:
    await cluster.seed_v1()
    await cluster.start_aggregator()
    await cluster.add("r0")
    await cluster.add("mute", mode="silent")
    t0 = time.monotonic()
    await cluster.open(["r0", "mute"], quorum=1, deadline_s=2.0)
    out = await cluster.wait_final(1, timeout_s=10)
    assert out.state == "published" and out.accepted == ["r0"]
    assert time.monotonic() - t0 < 6.0
    # Below quorum at the deadline: aborted, not published, pointer unchanged.
    await cluster.open(["mute"], quorum=1, deadline_s=1.0)
    out2 = await cluster.wait_final(2, timeout_s=10)
    assert out2.state == "aborted" and "quorum not reached" in out2.reason
    assert await cluster.store.current(ADAPTER) == 2


async def test_the_next_round_opens_as_soon_as_the_last_one_announced_its_end(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The final event is out before the ended round has cleaned up (its blobs are deleted after it); a
    client that saw the event and opens the adapter's next round at once must not be told the last one
    is still running."""
    from collm_aggregator.runner import RoundRunner

    cleaning = asyncio.Event()
    cleaned = asyncio.Event()  # round 1's cleanup is held until the second round has opened
    drop = RoundRunner._drop_blobs

    async def slow_drop(self: RoundRunner) -> None:
        cleaning.set()
        await cleaned.wait()
        await drop(self)

    monkeypatch.setattr(RoundRunner, "_drop_blobs", slow_drop)
    try:
        await cluster.seed_v1()
        await cluster.start_aggregator()
        await cluster.add("r0")
        await cluster.open(["r0"], quorum=1, deadline_s=5.0)
        out = await cluster.wait_final(1, timeout_s=10)
        assert out.state == "published"
        await asyncio.wait_for(cleaning.wait(), 5)
        assert cluster.agg is not None and 1 in cluster.agg.runners  # still cleaning up
        second = await cluster.open(["r0"], quorum=1, deadline_s=5.0)
        assert second.round_id == 2 and second.state == "opened"
        assert 1 in cluster.agg.runners  # opened while round 1 was still cleaning up
    finally:
        cleaned.set()
    assert (await cluster.wait_final(2, timeout_s=10)).state == "published"


async def test_unreachable_or_refusing_participants_are_recorded(cluster: Cluster) -> None:
    await cluster.seed_v1()
    await cluster.start_aggregator()
    await cluster.add("r0")
    await cluster.add("nope", mode="refuse")
    await cluster.open(["r0", "nope", "ghost"], quorum=1, deadline_s=10.0)
    out = await cluster.wait_final(1, timeout_s=10)
    assert out.state == "published"
    assert {r.replica_id: r.code for r in out.rejected} == {"nope": "not_started", "ghost": "not_started"}


async def test_gate_holds_back_a_worse_candidate(cluster: Cluster) -> None:
    await cluster.seed_v1()
    await cluster.start_aggregator()
    for i in range(2):
        await cluster.add(f"r{i}", mode="harmful", steps=2)
    await cluster.open(["r0", "r1"], quorum=2)
    out = await cluster.wait_final(1)
    assert out.state == "held_back" and "needs <=" in out.reason
    assert out.new_version is None and await cluster.store.current(ADAPTER) == 1
    assert [v.version for v in await cluster.store.list_versions(ADAPTER)] == [1]
    assert cluster.published == []


async def test_current_version_is_scored_while_participants_train(cluster: Cluster) -> None:
    """The gate's current-version losses are measured during collection; after the close each replica
    scores only the candidate, and the gate pairs the two on the same eval set."""
    await cluster.seed_v1()
    await cluster.start_aggregator()
    trained = asyncio.Event()  # the participants train once the test has seen the pre-scoring
    for i in range(2):
        await cluster.add(f"r{i}", domain=f"d{i}", train_gate=trained)
    await cluster.open(["r0", "r1"], quorum=2)
    pre = await wait_for(lambda: all(d.evaluated for d in cluster.doubles.values()), 10)
    assert pre and all(not d.sent for d in cluster.doubles.values())  # scored before any update
    trained.set()
    out = await cluster.wait_final(1)
    assert out.state == "published" and out.eval_loss_before is not None and out.eval_loss_after is not None
    v1 = tiny_adapter()
    for d in cluster.doubles.values():
        first, second = d.evaluated
        # Each request says when the aggregator stops waiting for it (now + eval_timeout_s).
        assert first.deadline_unix_s is not None and second.deadline_unix_s is not None
        assert cluster.agg is not None
        assert time.time() < second.deadline_unix_s <= time.time() + cluster.agg.settings.eval_timeout_s
        assert first.candidate_version == 1 and not first.score_current
        assert second.candidate_version is None and not second.score_current
        assert second.candidate_key.endswith(":_candidate")
        assert out.domain_losses_before[d.behaviour.domain] == pytest.approx(d.loss(v1))
    assert out.eval_loss_after < out.eval_loss_before


async def test_a_changed_eval_set_is_scored_again_with_both_versions(cluster: Cluster) -> None:
    await cluster.seed_v1()
    await cluster.start_aggregator()
    trained = asyncio.Event()  # the participants train once r1's eval set has changed
    r0 = await cluster.add("r0", domain="d0", train_gate=trained)
    r1 = await cluster.add("r1", domain="d1", train_gate=trained)
    await cluster.open(["r0", "r1"], quorum=2)
    await wait_for(lambda: r0.evaluated and r1.evaluated, 10)
    r1.behaviour.eval_set = "held-out-2"  # new held-out samples arrived at r1 after the pre-scoring
    trained.set()
    out = await cluster.wait_final(1)
    assert out.state == "published" and set(out.domain_losses_before) == {"d0", "d1"}
    assert [e.score_current for e in r0.evaluated] == [False, False]
    assert [e.score_current for e in r1.evaluated] == [False, False, True]  # paired nothing: both again
    assert r1.evaluated[2].current_version == 1 and r1.evaluated[2].candidate_version is None


async def test_late_update_is_recorded_not_aggregated(cluster: Cluster) -> None:
    await cluster.seed_v1()
    await cluster.start_aggregator(quorum_grace_s=0.2)
    await cluster.add("r0")
    await cluster.add("r1")
    slow = await cluster.add("slow", mode="silent")
    await cluster.open(["r0", "r1", "slow"], quorum=2, deadline_s=10)
    out = await cluster.wait_final(1)
    assert out.state == "published" and sorted(out.accepted) == ["r0", "r1"]
    await slow.inject_update(1, ADAPTER, 1)

    async def late_recorded() -> bool:
        o = await cluster.agg.records.outcome(1)  # type: ignore[union-attr]
        return o is not None and o.late == ["slow"]

    for _ in range(100):
        if await late_recorded():
            break
        await asyncio.sleep(0.05)
    assert await late_recorded()
    assert await cluster.store.current(ADAPTER) == 2  # the late update changed nothing


async def test_missing_adapter_and_bad_plans(cluster: Cluster) -> None:
    await cluster.start_aggregator()
    await cluster.add("r0")
    out = await cluster.open(["r0"], quorum=1)
    assert out.state == "aborted" and "no current version" in out.reason
    now = time.time()
    bad = RoundPlan(
        adapter=ADAPTER,
        base_version=1,
        participants=[ParticipantPlan(replica_id="r0", token_budget=8)],
        quorum=2,
        opened_unix_s=now,
        deadline_unix_s=now + 5,
    )
    with pytest.raises(BusError) as err:
        await cluster.client.request(subjects.aggregator("open_round"), bad, RoundOutcome)
    assert err.value.code == 400
    raw = await cluster.client.nc.request(subjects.aggregator("open_round"), b"\x93garbage", timeout=2)
    assert raw.headers["Nats-Service-Error-Code"] == "400"
    st = await cluster.client.request(subjects.aggregator("status"), StatusRequest(), AggregatorStatus)
    assert st.strategy == "product_svd" and st.rounds_by_state == {"aborted": 1}


async def test_restart_resumes_the_round_from_durable_updates(cluster: Cluster) -> None:
    await cluster.seed_v1()
    await cluster.start_aggregator()
    await cluster.add("r0")
    await cluster.add("r1")
    late = await cluster.add("r2", mode="silent")
    await cluster.open(["r0", "r1", "r2"], quorum=3, deadline_s=30)

    async def recorded() -> int:
        return len(await cluster.agg.records.updates(1))  # type: ignore[union-attr]

    for _ in range(200):
        if await recorded() == 2:
            break
        await asyncio.sleep(0.05)
    assert await recorded() == 2
    await cluster.stop_aggregator()  # killed mid-round
    await late.inject_update(1, ADAPTER, 1)  # arrives while no aggregator runs: JetStream keeps it
    await cluster.start_aggregator()
    out = await cluster.wait_final(1)
    assert out.state == "published" and sorted(out.accepted) == ["r0", "r1", "r2"]
    assert await cluster.store.current(ADAPTER) == 2
    assert [v.version for v in await cluster.store.list_versions(ADAPTER)] == [1, 2]


async def test_built_in_plan_runs_rounds_for_replicas_with_data(cluster: Cluster) -> None:
    await cluster.seed_v1()
    await cluster.add("r0", domain="math")
    await cluster.add("r1", domain="code")
    await cluster.add("r2", domain="code", num_samples=0)  # no local data: not planned
    await cluster.start_aggregator(
        default_plan=True,
        default_plan_period_s=1,
        default_plan_idle_s=1,
        round_deadline_s=10,
        default_plan_adapters={ADAPTER: ["math", "code"]},
    )
    out = await cluster.wait_final(1, timeout_s=20)
    assert out.state == "published" and out.policy == "builtin"
    assert out.participants == ["r0", "r1"]


async def test_built_in_plans_wait_while_a_coordinator_decides(cluster: Cluster) -> None:
    """A coordinator that publishes decisions but plans nothing (its data holders at SLO risk) is
    present: the built-in plans do not stand in for it; once it falls silent, they do."""
    from collm_common.wire.control import CoordinatorDecisions

    await cluster.seed_v1()
    await cluster.add("r0", domain="math")
    await cluster.add("r1", domain="code")
    deciding = True

    async def decide() -> None:
        while deciding:
            msg = CoordinatorDecisions(ts_unix_s=time.time(), policy="collm", loop="fast")
            await cluster.client.publish(subjects.coordinator_decisions(), msg)
            await asyncio.sleep(0.2)

    task = asyncio.create_task(decide())
    try:
        await cluster.start_aggregator(
            default_plan=True,
            default_plan_period_s=1,
            # Decisions come every 0.2 s: only a stall of this long could pass for silence.
            default_plan_idle_s=2,
            round_deadline_s=10,
            default_plan_adapters={ADAPTER: ["math", "code"]},
        )
        await asyncio.sleep(4.0)  # past the idle time and a plan period: a built-in round would be open
        assert cluster.events == [] and cluster.agg is not None and not cluster.agg.runners
    finally:
        deciding = False
        await task
    out = await cluster.wait_final(1, timeout_s=20)
    assert out.policy == "builtin"


async def test_import_and_export_through_the_endpoint(cluster: Cluster, tmp_path: Path) -> None:
    await cluster.start_aggregator()
    src = tiny_adapter(seed=3)
    export_peft_dir(src, tmp_path / "peft")
    info = await cluster.client.request(
        subjects.aggregator("import"),
        ImportAdapter(adapter="fresh", path=str(tmp_path / "peft"), domains=["math"]),
        AdapterVersionInfo,
    )
    assert (info.version, info.source, info.base_model) == (1, "import", BASE_MODEL)
    assert await cluster.store.meta("fresh") == {"domains": "math"}
    again = await cluster.client.request(
        subjects.aggregator("import"),
        ImportAdapter(adapter="fresh", path=str(tmp_path / "peft")),
        AdapterVersionInfo,
    )
    assert again.version == 2 and again.parent == 1
    other = tiny_adapter(seed=3, r=2)
    export_peft_dir(other, tmp_path / "rank2")
    with pytest.raises(BusError) as err:
        await cluster.client.request(
            subjects.aggregator("import"),
            ImportAdapter(adapter="fresh", path=str(tmp_path / "rank2")),
            AdapterVersionInfo,
        )
    assert err.value.code == 409 and "spec" in err.value.message
    with pytest.raises(BusError) as err:
        await cluster.client.request(
            subjects.aggregator("import"),
            ImportAdapter(adapter="x", path=str(tmp_path / "nothing")),
            AdapterVersionInfo,
        )
    assert err.value.code == 404 and "does not exist" in err.value.message
    await wait_for(
        lambda: [(p.version, p.source) for p in cluster.published] == [(1, "import"), (2, "import")], 5
    )


async def test_bad_import_paths_get_error_replies(cluster: Cluster, tmp_path: Path) -> None:
    """Paths that reach the aggregator only over NATS (the gateway refuses them first) or only under
    import roots: each is an error reply with a client status and the reason, never a failure (500)."""
    from collm_common.bus import ERROR_CODE_HEADER, ERROR_HEADER

    root = tmp_path / "adapters"
    root.mkdir()
    export_peft_dir(tiny_adapter(seed=5), root / "ok")
    (root / "loop").symlink_to(root / "loop")
    await cluster.start_aggregator(import_roots=[str(root)])

    async def answers() -> bool:
        try:
            await cluster.client.request(subjects.aggregator("status"), StatusRequest(), AggregatorStatus)
            return True
        except BusError:  # "no responders" until the server has the new endpoints' subscriptions
            return False

    for _ in range(100):
        if await answers():
            break
        await asyncio.sleep(0.1)

    async def refused(path: str) -> BusError:
        # Generous timeouts: the first import loads the adapter libraries, seconds on a busy machine.
        raw = await cluster.client.nc.request(
            subjects.aggregator("import"), encode(ImportAdapter(adapter="x", path=path)), timeout=30
        )
        assert raw.headers and raw.headers[ERROR_HEADER], raw.headers  # an error reply, with the reason
        with pytest.raises(BusError) as err:
            await cluster.client.request(
                subjects.aggregator("import"),
                ImportAdapter(adapter="x", path=path),
                AdapterVersionInfo,
                timeout_s=30,
            )
        assert raw.headers[ERROR_CODE_HEADER] == str(err.value.code)
        return err.value

    err = await refused(str(root / "loop"))  # resolving it for the roots check meets the loop
    assert err.code == 404 and "does not exist" in err.message
    err = await refused(str(root / ("x" * 300)))  # a name longer than the file system allows
    assert err.code == 404 and "File name too long" in err.message
    err = await refused(str(root / "ok" / "adapter_config.json"))
    assert err.code == 422 and "is a file, not a PEFT adapter directory" in err.message
    err = await refused(str(tmp_path))
    assert err.code == 403 and "outside the import roots" in err.message
    assert await cluster.store.list_adapters() == []
    info = await cluster.client.request(
        subjects.aggregator("import"), ImportAdapter(adapter="x", path=str(root / "ok")), AdapterVersionInfo
    )
    assert info.version_id == "x@v1"


def test_outcome_schema_roundtrip() -> None:
    from collm_common.wire import encode

    o = RoundOutcome(round_id=1, adapter="a", state="evaluating", base_version=1, timeline={"opened": 1.0})
    assert decode(RoundOutcome, encode(o)) == o


@pytest.fixture
def spans():  # type: ignore[no-untyped-def]
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    provider = trace.get_tracer_provider()
    installed = not isinstance(provider, TracerProvider)
    if installed:
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield exporter
    exporter.shutdown()
    if installed:
        # Leave the process as we found it: later tests install their own global provider.
        from opentelemetry.util._once import Once

        trace._TRACER_PROVIDER_SET_ONCE = Once()  # type: ignore[attr-defined]
        trace._TRACER_PROVIDER = None  # type: ignore[attr-defined]


async def test_one_trace_per_round_with_a_span_per_phase(cluster: Cluster, spans) -> None:  # type: ignore[no-untyped-def]
    await cluster.seed_v1()
    await cluster.start_aggregator()
    await cluster.add("r0")
    await cluster.add("r1")
    await cluster.open(["r0", "r1"], quorum=2)
    out = await cluster.wait_final(1)
    assert out.state == "published" and out.trace_id
    await wait_for(lambda: any(s.name == "round" for s in spans.get_finished_spans()), 5)
    finished = spans.get_finished_spans()
    root = next(s for s in finished if s.name == "round")
    assert root.parent is None and format(root.context.trace_id, "032x") == out.trace_id
    assert root.attributes["collm.round_state"] == "published"
    in_trace = [s for s in finished if s.context.trace_id == root.context.trace_id]
    phases = {s.name for s in in_trace if s.parent is not None and s.parent.span_id == root.context.span_id}
    assert phases == {"round.collect", "round.aggregate", "round.evaluate", "round.publish"}
    # The StartTraining and EvaluateCandidate requests travel in the round's trace.
    names = {s.name for s in in_trace}
    assert any("control request" in n for n in names) and any("evaluate request" in n for n in names)


async def test_restart_while_evaluating_resumes_and_publishes_once(cluster: Cluster) -> None:
    await cluster.seed_v1()
    await cluster.start_aggregator()
    # The evaluations hold until the aggregator has been stopped (not for a time a busy machine outruns).
    gate = asyncio.Event()
    r0 = await cluster.add("r0", eval_gate=gate)
    r1 = await cluster.add("r1", eval_gate=gate)
    await cluster.open(["r0", "r1"], quorum=2)
    await wait_for(lambda: any(e.round_id == 1 and e.state == "evaluating" for e in cluster.events), 10)
    await wait_for(lambda: bool(r0.evaluated or r1.evaluated), 10)
    await cluster.stop_aggregator()  # killed while the candidate is being evaluated
    assert await cluster.store.current(ADAPTER) == 1  # nothing half-done was published
    gate.set()
    await cluster.start_aggregator()
    out = await cluster.wait_final(1)
    assert out.state == "published" and out.new_version == 2
    assert [v.version for v in await cluster.store.list_versions(ADAPTER)] == [1, 2]


async def test_staleness_policy_carries_a_late_update_into_the_next_round(cluster: Cluster) -> None:
    await cluster.seed_v1()
    await cluster.start_aggregator(late_policy="staleness", staleness_weight=0.5, quorum_grace_s=0.2)
    await cluster.add("r0")
    await cluster.add("r1")
    slow = await cluster.add("slow", mode="silent")
    await cluster.open(["r0", "r1", "slow"], quorum=2)
    first = await cluster.wait_final(1)
    assert first.state == "published" and first.new_version == 2
    await slow.inject_update(1, ADAPTER, 1)  # late for round 1, trained from v1
    agg = cluster.agg
    assert agg is not None

    async def carried() -> bool:
        return bool(await agg.records.r.hlen(agg.records._k("carry", ADAPTER)))

    for _ in range(100):
        if await carried():
            break
        await asyncio.sleep(0.05)
    assert await carried()
    await cluster.open(["r0", "r1"], quorum=2)
    second = await cluster.wait_final(2)
    assert second.state == "published", second.reason
    assert sorted(second.accepted) == ["r0", "r1", "slow@r1"], (
        second.rejected
    )  # weight x0.5: one version stale


async def test_admin_cli(cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:  # type: ignore[no-untyped-def]
    import json

    from collm_aggregator.cli import main as cli

    await cluster.seed_v1()
    await cluster.start_aggregator()
    await cluster.add("r0")
    await cluster.open(["r0"], quorum=1)
    await cluster.wait_final(1)
    monkeypatch.setenv("COLLM_NATS_URL", cluster.nats_url)
    monkeypatch.setenv("COLLM_REDIS_URL", cluster.redis_url)
    monkeypatch.setenv("COLLM_REDIS_PREFIX", cluster.prefix)

    errors: list[str] = []

    async def run(*argv: str) -> tuple[int, dict]:
        code = await asyncio.to_thread(cli, list(argv))
        captured = capsys.readouterr()
        errors.append(captured.err)
        return code, (json.loads(captured.out) if captured.out.strip() else {})

    code, doc = await run("rounds", "list")
    assert code == 0 and [r["state"] for r in doc["rounds"]] == ["published"]
    code, doc = await run("rounds", "show", "1")
    assert code == 0 and doc["updates"][0]["size_bytes"] > 0 and doc["outcome"]["new_version"] == 2
    code, doc = await run("export", ADAPTER, "2", str(tmp_path / "v2"))
    assert code == 0 and (tmp_path / "v2" / "adapter_config.json").is_file()
    code, doc = await run("import", "copy", str(tmp_path / "v2"))
    assert code == 0 and doc["version_id"] == "copy@v1"
    code, doc = await run("rollback", ADAPTER, "1")
    assert code == 0 and doc["version"] == 3 and doc["source"] == "rollback"
    code, _ = await run("rounds", "show", "99")
    assert code == 1 and "not on record" in errors[-1]


async def test_spoofed_sender_and_unknown_round_are_refused(cluster: Cluster) -> None:
    from collm_common.wire import encode

    await cluster.seed_v1()
    await cluster.start_aggregator()
    await cluster.add("r0", train_delay_s=1.0)
    await cluster.add("r1", train_delay_s=1.0)
    mallory = await cluster.add("mallory", mode="silent")
    await cluster.open(["r0", "r1"], quorum=2)
    # mallory stores a blob under its own key but claims, on r1's subject, to be r1
    real = await mallory.inject_update(1, ADAPTER, 1)
    spoof = real.model_copy(update={"replica_id": "r1"})
    await cluster.double_bus.js.publish(subjects.update(1, "mallory"), encode(spoof))
    unknown_before = metric("collm_aggregator_rejected_updates_total", reason="unknown_round")
    await cluster.double_bus.js.publish(
        subjects.update(77, "mallory"), encode(real.model_copy(update={"round_id": 77}))
    )
    out = await cluster.wait_final(1)
    assert out.state == "published" and sorted(out.accepted) == ["r0", "r1"]
    codes = sorted((r.replica_id, r.code) for r in out.rejected)
    assert codes == [("mallory", "not_participant"), ("mallory", "sender_mismatch")]
    await wait_for(
        lambda: metric("collm_aggregator_rejected_updates_total", reason="unknown_round") > unknown_before, 5
    )
    # A plan on a stale base version is recorded as aborted, with the reason.
    now = time.time()
    stale = RoundPlan(
        adapter=ADAPTER,
        base_version=1,
        participants=[ParticipantPlan(replica_id="r0", token_budget=8)],
        quorum=1,
        opened_unix_s=now,
        deadline_unix_s=now + 5,
    )
    o = await cluster.client.request(subjects.aggregator("open_round"), stale, RoundOutcome)
    assert o.state == "aborted" and "is at v2" in o.reason


async def test_round_records_are_trimmed_but_active_rounds_kept(redis_server, redis_prefix) -> None:
    from collm_aggregator.records import RoundRecords

    store = AdapterStore.from_url(redis_server.url, redis_prefix)
    try:
        rec = RoundRecords(store.r, redis_prefix, keep=10)
        for _ in range(15):
            rid = await rec.next_round_id()
            plan = RoundPlan(
                round_id=rid,
                adapter=ADAPTER,
                base_version=1,
                participants=[ParticipantPlan(replica_id="r0", token_budget=8)],
                quorum=1,
                opened_unix_s=0.0,
                deadline_unix_s=1.0,
            )
            state = "collecting" if rid == 1 else "published"  # round 1 is still active
            out = RoundOutcome(round_id=rid, adapter=ADAPTER, state=state, base_version=1)
            assert await rec.create(plan, out)
        assert not await rec.create(plan, out)  # an id is never recorded twice
        kept = [o.round_id for o in await rec.list_outcomes(None, None, 100)]
        assert 1 in kept and len(kept) == 11 and kept[:3] == [15, 14, 13]
        assert await rec.active_ids() == [1]
        assert await rec.count_by_state() == {"published": 10, "collecting": 1}
        await rec.reserve_round_id(40)
        assert await rec.next_round_id() == 41
    finally:
        await store.close()


async def test_built_in_plan_asks_a_replica_to_create_a_missing_adapter(cluster: Cluster) -> None:
    d = await cluster.add("r0", domain="math")
    await cluster.start_aggregator(
        default_plan=True,
        default_plan_period_s=1,
        default_plan_idle_s=1,
        default_plan_adapters={"fresh": []},
    )
    await wait_for(lambda: d.started, 10)
    cmd = d.started[0]
    assert (cmd.adapter, cmd.round_id, cmd.base_version) == ("fresh", None, None)
    st = await cluster.client.request(subjects.aggregator("status"), StatusRequest(), AggregatorStatus)
    assert st.active == [] and st.last_round_id == 0  # no round was opened for a missing adapter


async def test_participants_send_early_enough_for_the_version_to_serve_by_the_deadline(
    cluster: Cluster,
) -> None:
    """Participants get the round's deadline less the publish lead: the initial lead (capped by a
    fraction of the round) before any publication, then the measured close-to-publication time."""
    await cluster.seed_v1()
    await cluster.start_aggregator(publish_lead_initial_s=5.0, publish_lead_max_frac=0.25)
    a, b = await cluster.add("r0"), await cluster.add("r1")
    first = await cluster.open(["r0", "r1"], quorum=2, deadline_s=10.0)
    out = await cluster.wait_final(first.round_id)
    assert out.state == "published", out.reason
    deadline = first.deadline_unix_s
    assert a.started[0].deadline_unix_s == pytest.approx(deadline - 2.5)  # 5 s, capped at 25% of 10 s
    # The round's update and candidate blobs are gone once it ended; the new version keeps its own.
    store = cluster.store
    assert await store.r.keys(f"{store.prefix}:update:{first.round_id}:*") == []
    assert await store.get_blob(ADAPTER, 2)
    took_s = out.timeline["published"] - out.timeline["aggregating"]
    second = await cluster.open(["r0", "r1"], quorum=2, deadline_s=60.0)
    assert (await cluster.wait_final(second.round_id)).state == "published"
    lead_s = second.deadline_unix_s - b.started[1].deadline_unix_s
    assert lead_s == pytest.approx(1.25 * took_s, abs=1e-3)


@pytest.mark.parametrize("scale", [1.0, 0.5])
async def test_async_round_opens_while_the_last_one_evaluates_and_is_rebased_onto_it(
    cluster: Cluster, scale: float
) -> None:
    """Async rounds: a round that closed its collection no longer holds its adapter. The next round's
    participants train from v1 while round 1 evaluates; round 2 aggregates only after round 1 published
    v2, onto v2 (each update's change from v1, times `rebase_scale`, applied to v2), and judges its
    candidate against v2 with round 1's candidate scores, so no replica scores v1 or v2 for it."""
    from collm_common.lora import decode_adapter

    await cluster.seed_v1()
    await cluster.start_aggregator(strategy="fedavg", rebase_scale=scale)
    gate = asyncio.Event()  # round 1's evaluation waits until round 2 has collected
    # Small local steps (a round's change is a few small steps, not a jump to the target).
    r0 = await cluster.add("r0", eval_gate=gate, steps=2, step_size=0.05)
    r1 = await cluster.add("r1", eval_gate=gate, steps=2, step_size=0.05)
    await cluster.open(["r0", "r1"], quorum=2)
    await wait_for(lambda: any(e.round_id == 1 and e.state == "evaluating" for e in cluster.events), 10)
    second = await cluster.open(["r0", "r1"], quorum=2)
    assert second.round_id == 2 and second.state == "opened" and second.base_version == 1
    await wait_for(lambda: any(e.round_id == 2 and e.state == "aggregating" for e in cluster.events), 10)
    assert await cluster.store.current(ADAPTER) == 1
    assert not any(e.round_id == 2 and e.state == "evaluating" for e in cluster.events)  # waits for round 1
    gate.set()
    first = await cluster.wait_final(1)
    out = await cluster.wait_final(2)
    assert first.state == "published" and first.new_version == 2
    assert out.state == "published" and out.base_version == 2 and out.new_version == 3, out.reason
    v3 = await cluster.store.get_version(ADAPTER, 3)
    assert v3.parent == 2
    # Round 2's evaluators scored only its candidate (round 1's candidate scores stand for v2's).
    for d in (r0, r1):
        asks = [e for e in d.evaluated if e.round_id == 2]
        assert asks and all(e.candidate_key and not e.score_current for e in asks), asks
    # v3 = v2 + scale x the mean of round 2's changes from v1 (equal samples, FedAvg, server rate 1).
    tensors = {v: decode_adapter(await cluster.store.get_blob(ADAPTER, v)).tensors for v in (1, 2, 3)}
    updates = [
        decode_adapter(blob).tensors
        for d in (r0, r1)
        for key, blob in d.blobs.items()
        if key == cluster.store.update_key(2, d.replica_id)
    ]
    assert len(updates) == 2
    for k, v3_k in tensors[3].items():
        change = scale * sum(u[k] - tensors[1][k] for u in updates) / 2
        assert (v3_k - (tensors[2][k] + change)).abs().max().item() < 1e-5, k


async def test_versions_are_compared_on_the_same_sites_and_probed_for_task_metrics(cluster: Cluster) -> None:
    """Round 2 is scored on r0 only (r1 is down): v3's recorded loss is v2's plus the change on r0,
    not r0's own level. After each publication the evaluators score the new version's task metric,
    and v1's when it has none."""
    await cluster.seed_v1()
    await cluster.start_aggregator(eval_task_examples=4, eval_task_interval_s=0)
    r0 = await cluster.add("r0", domain="d", eval_examples=10)
    r1 = await cluster.add("r1", domain="d", eval_examples=30)  # its own target: another loss level
    out1 = await cluster.wait_final((await cluster.open(["r0", "r1"], quorum=2)).round_id)
    assert out1.state == "published" and out1.new_version == 2
    task = await wait_for_async(lambda: cluster.store.task_quality(ADAPTER, 2), 10)
    assert task["d"]["metric"] == "answer_accuracy" and task["d"]["examples"] == 8 and task["d"]["sites"] == 2
    assert (await cluster.store.task_quality(ADAPTER, 1))["d"]["score"] < task["d"]["score"]
    probes = [e for e in r0.evaluated if e.task_examples]
    assert [(e.candidate_version, e.task_examples) for e in probes] == [(1, 4), (2, 4)]

    q2 = (await cluster.store.quality(ADAPTER, 2))["d"]
    await r1.stop()  # r1 leaves: round 2 is trained and scored by r0 alone
    cluster.doubles.pop("r1")
    out2 = await cluster.wait_final((await cluster.open(["r0"], quorum=1)).round_id)
    assert out2.state == "published" and out2.new_version == 3
    on_r0 = await cluster.store.site_quality(ADAPTER, 3)
    assert list(on_r0) == ["d|r0|held-out-1"]
    change = on_r0["d|r0|held-out-1"]["loss"] - out2.domain_losses_before["d"]
    q3 = (await cluster.store.quality(ADAPTER, 3))["d"]
    assert q3 == pytest.approx(q2 + change) and out2.new_version_quality["d"] == pytest.approx(q3)
    assert q3 != pytest.approx(on_r0["d|r0|held-out-1"]["loss"])  # not r0's level alone
