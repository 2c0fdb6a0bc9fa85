"""Update identity: the aggregator takes an update only from a participant of its round, sent as itself.

On the shipped secured NATS configuration a replica can publish an update only on its own subject
(`subjects.update(round, own_id)`), so the subject token is the authenticated sender. The aggregator
(the real `Aggregator`, logged in as `aggregator`, over the real ACL'd Redis) then refuses an update
whose payload claims another replica than its subject, and one from a replica that is not in the round's
plan, while the round runs and after it ended; each refusal is counted and reported in the round record.
Participants are clearly named doubles (tests/doubles/participant.py), each logged in as its own replica
user. What the published version was aggregated from is checked against the strategy itself: exactly the
honest participants' updates, none of the forged ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
import pytest
import pytest_asyncio

from collm_aggregator.collection import to_numpy
from collm_aggregator.service import Aggregator
from collm_aggregator.settings import AggregatorSettings
from collm_aggregator.strategies import WeightedUpdate, make_strategy
from collm_common import subjects
from collm_common.bus import Bus
from collm_common.clock import WallClock
from collm_common.lora import decode_adapter, encode_adapter
from collm_common.settings import CommonSettings
from collm_common.store import AdapterStore, sha256_hex
from collm_common.wire import encode
from collm_common.wire.admin import GetRound, RoundDetail
from collm_common.wire.rounds import LocalUpdate, ParticipantPlan, RoundOutcome, RoundPlan
from tests.doubles.participant import BASE_MODEL, ParticipantBehaviour, ParticipantDouble, tiny_adapter
from tests.integration.security.conftest import SecureNats, SecureRedis

pytestmark = pytest.mark.integration
ADAPTER = "med"


async def eventually(probe: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


class SecuredRound:
    """The aggregator and participant doubles, each logged in as its own user, plus an operator (admin)."""

    def __init__(self, nats: SecureNats, redis: SecureRedis) -> None:
        self.nats, self.redis = nats, redis
        self.events: list[RoundOutcome] = []
        self.doubles: dict[str, ParticipantDouble] = {}
        self.buses: list[Bus] = []
        self.stores: list[AdapterStore] = []

    def settings(self, user: str) -> CommonSettings:
        return CommonSettings(
            nats_url=self.nats.url,
            nats_user=user,
            nats_password=self.nats.passwords[user],
            nats_connect_timeout_s=5,
        )

    def store(self, redis_user: str) -> AdapterStore:
        s = AdapterStore.from_url(self.redis.url(redis_user), self.redis.prefix)
        self.stores.append(s)
        return s

    async def bus(self, user: str) -> Bus:
        b = await Bus.connect(self.settings(user), user)
        self.buses.append(b)
        return b

    async def __aenter__(self) -> SecuredRound:
        self.admin = await self.bus("admin")

        async def on_event(o: RoundOutcome, _m: object) -> None:
            self.events.append(o)

        await self.admin.subscribe(subjects.round_events_all(), RoundOutcome, on_event)
        self.settings_agg = AggregatorSettings(
            **self.settings("aggregator").model_dump(include={"nats_url", "nats_user", "nats_password"}),
            redis_url=self.redis.url("collm-aggregator"),
            redis_prefix=self.redis.prefix,
            default_plan=False,
            strategy="fedavg",
            eval_timeout_s=5,
            control_timeout_s=2,
        )
        self.agg = Aggregator(
            self.settings_agg, await self.bus("aggregator"), self.store("collm-aggregator"), WallClock()
        )
        await self.agg.start()
        await self.store("collm-aggregator").publish(
            ADAPTER,
            encode_adapter(tiny_adapter()),
            expected_current=None,
            base_model=BASE_MODEL,
            source="create",
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        # Bounded: a JetStream fetch cancelled while a message arrives can keep Aggregator.stop waiting
        # (seen only when a test fails mid-round); the rest of the teardown must still run.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self.agg.stop()), 10)
        for d in self.doubles.values():
            await d.stop()
        for b in reversed(self.buses):
            await b.close()
        for s in self.stores:
            await s.close()

    async def add(self, rid: str, **behaviour: Any) -> ParticipantDouble:
        d = ParticipantDouble(
            await self.bus(f"replica-{rid}"),
            self.store("collm-replica"),
            rid,
            ParticipantBehaviour(**behaviour),
        )
        self.doubles[rid] = await d.start()
        return d

    async def open(self, participants: list[str], deadline_s: float) -> RoundOutcome:
        now = time.time()
        plan = RoundPlan(
            adapter=ADAPTER,
            base_version=1,
            participants=[ParticipantPlan(replica_id=r, token_budget=64) for r in participants],
            quorum=2,
            opened_unix_s=now,
            deadline_unix_s=now + deadline_s,
            policy="test",
        )
        return await self.admin.request(subjects.aggregator("open_round"), plan, RoundOutcome, timeout_s=5)

    async def forge(
        self, sender: ParticipantDouble, round_id: int, claimed: str, blob_of: LocalUpdate | None = None
    ) -> LocalUpdate:
        """`sender` stores a trained blob under its own key (or reuses `blob_of`'s), then announces it on
        its own subject (the only one it may publish) while the payload claims to come from `claimed`."""
        if blob_of is None:
            base = decode_adapter(await sender.store.get_blob(ADAPTER, 1))
            blob = encode_adapter(sender.train(base))
            key, sha = await sender.store.put_update(round_id, sender.replica_id, blob)
            sender.blobs[key] = blob
        else:
            key, sha = blob_of.blob_key, blob_of.sha256
        forged = LocalUpdate(
            round_id=round_id, adapter=ADAPTER, replica_id=claimed, base_version=1, blob_key=key, sha256=sha,
            num_samples=10_000, num_tokens=1, created_unix_s=time.time(),
        )  # fmt: skip
        await sender.bus.js.publish(subjects.update(round_id, sender.replica_id), encode(forged))
        return forged

    async def final(self, round_id: int, timeout_s: float) -> RoundOutcome:
        return await eventually(
            lambda: next(
                (
                    e
                    for e in self.events
                    if e.round_id == round_id and e.state in ("published", "held_back", "aborted")
                ),
                None,
            ),
            timeout_s,
            f"round {round_id} to end",
        )


@pytest_asyncio.fixture
async def secured(secure_nats: SecureNats, secure_redis: SecureRedis) -> AsyncIterator[SecuredRound]:
    async with SecuredRound(secure_nats, secure_redis) as r:
        yield r


async def aggregate_of(
    store: AdapterStore, blobs: dict[str, bytes], updates: list[LocalUpdate], s: AggregatorSettings
) -> dict[str, Any]:
    """The aggregate of `updates`, from the blobs their senders stored (`blobs`, by key: the store
    deletes a round's update blobs once it ended)."""
    base = to_numpy(decode_adapter(await store.get_blob(ADAPTER, 1)))
    assert all(sha256_hex(blobs[u.blob_key]) == u.sha256 for u in updates)
    weighted = [
        WeightedUpdate(u.replica_id, to_numpy(decode_adapter(blobs[u.blob_key])), u.num_samples)
        for u in updates
    ]
    return make_strategy(s.strategy, s.clip_norm).aggregate(weighted, base)


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return set(a) == set(b) and all(np.allclose(a[k], b[k], rtol=1e-5, atol=1e-6) for k in a)


async def test_forged_and_foreign_updates_are_rejected_and_never_published(
    secured: SecuredRound, secure_nats: SecureNats
) -> None:
    r0 = await secured.add("r0")
    r1 = await secured.add("r1")
    r2 = await secured.add("r2", mode="silent")  # a participant that will lie about who it is
    g1 = await secured.add("g1", mode="harmful")  # not in the plan
    opened = await secured.open(["r0", "r1", "r2"], deadline_s=30)
    assert opened.state == "opened"
    rid = opened.round_id
    t0 = time.monotonic()

    # Under the secured configuration r2 cannot even publish on r1's update subject.
    errors: list[str] = []
    raw = await secure_nats.connect("replica-r2", errors=errors)
    try:
        await raw.publish(subjects.update(rid, "r1"), b"forged")
        await raw.flush()
        await eventually(lambda: any("permissions violation" in e.lower() for e in errors), 10, "a refusal")
    finally:
        await raw.close()
    # The server writes its log line beside the error it sends: read until it is there.
    forged_subject = ("replica-r2", "Publish", subjects.update(rid, "r1"))
    await eventually(lambda: forged_subject in secure_nats.violations(), 10, "the violation in the log")

    # g1, not invited, sends anyway. And what r2 can do: lie in the payload, on its own subject (after
    # everything else arrived: r2's refusal is then the last word the round waits for).
    machine = secured.agg.runners[rid].machine
    stranger = await g1.inject_update(rid, ADAPTER, 1)
    await eventually(lambda: {"r0", "r1"} <= set(machine.entries) and machine.refused, 10, "r0, r1, g1")
    forged = await secured.forge(r2, rid, claimed="r1")
    out = await secured.final(rid, 25)
    assert out.state == "published", out.reason
    # r2 counts as heard from once refused: the round closed then, not at its deadline (30 s).
    assert time.monotonic() - t0 < 20
    assert sorted(out.accepted) == ["r0", "r1"]
    assert sorted((r.replica_id, r.code) for r in out.rejected) == [
        ("g1", "not_participant"),
        ("r2", "sender_mismatch"),
    ]
    assert "claims 'r1'" in next(r.reason for r in out.rejected if r.code == "sender_mismatch")

    # The published version is the aggregate of exactly r0's and r1's updates.
    store = secured.store("collm-aggregator")
    assert await store.current(ADAPTER) == 2
    published = to_numpy(decode_adapter(await store.get_blob(ADAPTER, 2)))
    honest = [r0.sent[0], r1.sent[0]]
    s = secured.settings_agg
    blobs = {**r0.blobs, **r1.blobs, **r2.blobs, **g1.blobs}
    assert same(published, await aggregate_of(store, blobs, honest, s))
    for intruder in (forged, stranger):
        assert not same(published, await aggregate_of(store, blobs, [*honest, intruder], s))

    # After the round ended: a foreign update and a forged one are refused and added to its record.
    g0 = await secured.add("g0")
    await g0.inject_update(rid, ADAPTER, 1)
    await secured.forge(r2, rid, claimed="r0", blob_of=forged)
    want = {("g0", "not_participant"), ("r2", "sender_mismatch", "r0")}

    async def recorded() -> RoundDetail | None:
        d = await secured.admin.request(subjects.aggregator("round"), GetRound(round_id=rid), RoundDetail)
        got = {(r.replica_id, r.code) for r in d.outcome.rejected} | {
            (r.replica_id, r.code, "r0") for r in d.outcome.rejected if "claims 'r0'" in r.reason
        }
        return d if want <= got else None

    detail = await eventually_async(recorded, 10, "the late refusals in the round record")
    assert detail.outcome.state == "published" and detail.outcome.late == []
    assert sorted(detail.outcome.accepted) == ["r0", "r1"] and await store.current(ADAPTER) == 2


async def eventually_async(probe: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = await probe()
        if value:
            return value
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")
