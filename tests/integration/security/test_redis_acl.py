"""The shipped Redis ACL (deploy/redis/users.acl, rendered by render-acl.sh) on a real redis-server.

Each CoLLM user can run every store operation its service runs, through the real `AdapterStore` and
`RoundRecords` with `redis://user:password@host` URLs, and nothing more: no key outside the prefix, no
administrative command, no write for the read-only user, no round record for replicas, no version write
for the gateway; the default user holds only PING, and no login works without the right password.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import redis.asyncio as aioredis
from redis.exceptions import AuthenticationError, NoPermissionError, ResponseError

from collm_aggregator.records import RoundRecords
from collm_common.store import AdapterStore
from collm_common.wire.admin import UpdateRecord
from collm_common.wire.rounds import LocalUpdate, ParticipantPlan, RoundOutcome, RoundPlan
from tests.integration.security.conftest import REDIS_USERS, SecureRedis, render_acl

pytestmark = pytest.mark.integration


@pytest_asyncio.fixture
async def stores(secure_redis: SecureRedis) -> AsyncIterator[dict[str, AdapterStore]]:
    out = {
        role: AdapterStore.from_url(
            secure_redis.url(f"collm-{role}"), secure_redis.prefix, retention_versions=2
        )
        for role in ("aggregator", "replica", "gateway", "reader")
    }
    try:
        yield out
    finally:
        for s in out.values():
            await s.close()


def test_render_refuses_a_missing_or_spaced_password(tmp_path: Path) -> None:
    env = dict.fromkeys(REDIS_USERS, "t-pw") | {"COLLM_REDIS_PREFIX": "collm"}
    done = render_acl(tmp_path / "ok.acl", env)
    assert done.returncode == 0, done.stderr
    lines = (tmp_path / "ok.acl").read_text().splitlines()
    assert [ln.split()[1] for ln in lines] == list(REDIS_USERS.values())
    assert all(ln.startswith("user ") and "${" not in ln for ln in lines), "comments and variables are gone"
    for var, value, why in (
        ("REDIS_PASSWORD_GATEWAY", "", "is not set"),
        ("REDIS_PASSWORD", "two words", "contains whitespace"),
    ):
        done = render_acl(tmp_path / "bad.acl", env | {var: value})
        assert done.returncode != 0 and f"{var} {why}" in done.stderr


async def test_the_aggregator_runs_the_whole_store(stores: dict[str, AdapterStore]) -> None:
    agg = stores["aggregator"]
    assert await agg.ping()
    v1 = await agg.publish("med", b"v1", expected_current=None, base_model="m", source="create")
    v2 = await agg.publish("med", b"v2", expected_current=1, base_model="m", source="round", round_id=1)
    await agg.publish("med", b"v3", expected_current=2, base_model="m", source="round", round_id=2)
    rb = await agg.rollback("med", 2)  # republishes v2's content as v4 (and prunes beyond retention)
    assert (v1.version, v2.version, rb.version, await agg.current("med")) == (1, 2, 4, 4)
    assert await agg.get_blob("med", 4) == b"v2"
    assert [r.pruned for r in await agg.list_versions("med")] == [True, True, False, False]
    await agg.record_quality("med", 4, {"med": 1.5})
    await agg.set_meta("med", {"domains": "med"})
    key, sha = await agg.put_update(3, "_candidate", b"aggregate")
    assert await agg.get_update(key, sha) == b"aggregate" and int(await agg.r.strlen(key)) == 9
    # Round records (MULTI/EXEC included).
    records = RoundRecords(agg.r, "collm", keep=10)
    rid = await records.next_round_id()
    now = time.time()
    plan = RoundPlan(
        round_id=rid,
        adapter="med",
        base_version=4,
        participants=[ParticipantPlan(replica_id="r0", token_budget=8)],
        quorum=1,
        opened_unix_s=now,
        deadline_unix_s=now + 60,
    )
    assert await records.create(
        plan, RoundOutcome(round_id=rid, adapter="med", state="opened", base_version=4)
    )
    upd = LocalUpdate(round_id=rid, adapter="med", replica_id="r0", base_version=4, blob_key=key, sha256=sha,
                      num_samples=1, num_tokens=1)  # fmt: skip
    rec = UpdateRecord(update=upd, received_unix_s=now)
    assert await records.add_update(rid, rec)
    await records.add_carry("med", rec)
    assert len(await records.take_carry("med")) == 1
    await records.save_outcome(RoundOutcome(round_id=rid, adapter="med", state="published", base_version=4))
    assert [o.state for o in await records.list_outcomes(None, None, 10)] == ["published"]
    await records.save_candidate(rid, key, sha)
    assert await records.candidate(rid) == (key, sha)
    await records.save_evals(rid, [])
    assert await records.evals(rid) == [] and len(await records.updates(rid)) == 1
    assert await records.count_by_state() == {"published": 1} and await records.active_ids() == []
    trimming = RoundRecords(agg.r, "collm", keep=0)  # keeps only active rounds: round 1 is dropped
    plan2 = plan.model_copy(update={"round_id": await trimming.next_round_id()})
    assert await trimming.create(plan2, RoundOutcome(round_id=plan2.round_id, adapter="med", state="opened",
                                                      base_version=4))  # fmt: skip
    assert not await trimming.exists(rid) and await trimming.active_ids() == [plan2.round_id]
    # Never outside the prefix, never an administrative command.
    for call in (
        agg.r.set("other:key", 1),
        agg.r.get("collmx:key"),
        agg.r.flushall(),
        agg.r.keys("*"),
        agg.r.config_get("*"),
        agg.r.execute_command("ACL", "LIST"),
        agg.r.eval("return 1", 0),  # only the store's loaded scripts (EVALSHA), no ad-hoc Lua
    ):
        with pytest.raises(NoPermissionError):
            await call


async def test_replica_reads_versions_writes_its_updates_and_creates_v1(
    stores: dict[str, AdapterStore],
) -> None:
    rep, agg = stores["replica"], stores["aggregator"]
    rec = await rep.publish("code", b"v1", expected_current=None, base_model="m", source="create")
    assert rec.version == 1 and await agg.current("code") == 1
    await agg.publish("code", b"v2", expected_current=1, base_model="m", source="round")
    assert await rep.current("code") == 2 and await rep.get_blob("code", 2) == b"v2"
    assert (await rep.get_version("code", 2)).sha256 == (await agg.get_version("code", 2)).sha256
    assert await rep.list_adapters() == ["code"]
    key, sha = await rep.put_update(1, "r0", b"delta")
    assert await agg.get_update(key, sha) == b"delta"
    ckey, csha = await agg.put_update(1, "_candidate", b"aggregate")
    assert await rep.get_update(ckey, csha) == b"aggregate"  # evaluates the candidate
    for call in (
        rep.r.get("collm:agg:round_seq"),  # round records are the aggregator's
        rep.r.hset("collm:agg:round:1", "outcome", b"x"),
        rep.r.set("elsewhere", 1),
        rep.r.delete("collm:adapter:{code}:current"),
        rep.r.flushdb(),
    ):
        with pytest.raises(NoPermissionError):
            await call


async def test_gateway_reads_the_catalog_and_writes_only_adapter_metadata(
    stores: dict[str, AdapterStore],
) -> None:
    gw, agg = stores["gateway"], stores["aggregator"]
    await agg.publish("bank", b"v1", expected_current=None, base_model="m", source="create")
    await agg.record_quality("bank", 1, {"bank": 2.0})
    assert await gw.list_adapters() == ["bank"] and await gw.current("bank") == 1
    assert (await gw.get_version("bank", 1)).size_bytes == 2 and await gw.quality("bank", 1) == {"bank": 2.0}
    assert [r.version for r in await gw.list_versions("bank")] == [1]
    await gw.set_meta("bank", {"owner": "tenant-a"})  # the adapter admin API: owner, (un)listing, unload
    assert await agg.meta("bank") == {"owner": "tenant-a"}
    await gw.delete_adapter_name("bank")
    assert await agg.list_adapters() == [] and await agg.current("bank") is None
    for call in (
        gw.create_version("bank", b"evil", base_model="m", source="create"),  # no version writes
        gw.put_update(1, "r0", b"evil"),  # no update blobs
        gw.r.get("collm:agg:round_seq"),  # no round records
        gw.r.set("collm:adapter:{bank}:current", 1),  # the pointer moves only by the aggregator's CAS
        gw.r.set("elsewhere", 1),
    ):
        with pytest.raises(NoPermissionError):
            await call


async def test_reader_only_reads(stores: dict[str, AdapterStore]) -> None:
    reader, agg = stores["reader"], stores["aggregator"]
    await agg.publish("sql", b"v1", expected_current=None, base_model="m", source="create")
    await agg.record_quality("sql", 1, {"sql": 1.0})
    assert await reader.current("sql") == 1 and await reader.quality("sql", 1) == {"sql": 1.0}
    assert await reader.get_blob("sql", 1) == b"v1"
    assert await RoundRecords(reader.r, "collm").last_round_id() == 0
    for call in (
        reader.record_quality("sql", 1, {"sql": 0.1}),
        reader.set_meta("sql", {"owner": "x"}),
        reader.delete_adapter_name("sql"),
        reader.r.set("collm:x", 1),
        reader.r.get("elsewhere"),
    ):
        with pytest.raises(NoPermissionError):
            await call


async def test_default_user_and_strangers_get_nothing(secure_redis: SecureRedis) -> None:
    port = secure_redis.server.port
    anonymous = aioredis.Redis.from_url(f"redis://127.0.0.1:{port}/0")
    with pytest.raises((AuthenticationError, ResponseError)):  # NOAUTH: no password, no command
        await anonymous.get("collm:adapters")
    await anonymous.aclose()
    health = aioredis.Redis.from_url(f"redis://:{secure_redis.passwords['default']}@127.0.0.1:{port}/0")
    assert await health.ping()  # compose's health check: REDISCLI_AUTH=$REDIS_PASSWORD redis-cli ping
    with pytest.raises(NoPermissionError):
        await health.get("collm:adapters")
    await health.aclose()
    for url in (
        secure_redis.url("collm-aggregator", "t-wrong"),
        secure_redis.url("collm-gateway", secure_redis.passwords["collm-aggregator"]),
        f"redis://mallory:t-x@127.0.0.1:{port}/0",
    ):
        r = aioredis.Redis.from_url(url)
        with pytest.raises(AuthenticationError):
            await r.ping()
        await r.aclose()
