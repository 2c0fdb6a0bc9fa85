"""Adapter store semantics against a real redis-server."""

import asyncio

import pytest
import pytest_asyncio

from collm_common.store import AdapterStore, Conflict, CorruptBlob, NotFound

pytestmark = pytest.mark.integration


@pytest_asyncio.fixture
async def store(redis_server, redis_prefix):
    s = AdapterStore.from_url(redis_server.url, prefix=redis_prefix, retention_versions=2)
    yield s
    await s.close()


async def test_versions_only_grow_and_carry_digests(store: AdapterStore) -> None:
    a = await store.create_version("med", b"one", base_model="m", source="create")
    b = await store.create_version("med", b"two", base_model="m", source="round", round_id=1, parent=1)
    assert (a.version, b.version) == (1, 2)
    assert (await store.get_version("med", 2)).round_id == 1
    assert await store.get_blob("med", 1) == b"one"
    assert await store.list_adapters() == ["med"]
    assert [r.id for r in await store.list_versions("med")] == ["med@v1", "med@v2"]


async def test_cas_pointer(store: AdapterStore) -> None:
    await store.create_version("med", b"one", base_model="m", source="create")
    await store.cas_current("med", None, 1)
    assert await store.current("med") == 1
    await store.create_version("med", b"two", base_model="m", source="round")
    with pytest.raises(Conflict):
        await store.cas_current("med", None, 2)  # stale expectation
    await store.cas_current("med", 1, 2)
    assert await store.current("med") == 2
    with pytest.raises(NotFound):
        await store.cas_current("med", 2, 99)  # no such version


async def test_concurrent_cas_has_exactly_one_winner(store: AdapterStore) -> None:
    await store.publish("med", b"base", expected_current=None, base_model="m", source="create")
    for i in range(5):
        await store.create_version("med", f"c{i}".encode(), base_model="m", source="round")

    async def attempt(v: int) -> bool:
        try:
            await store.cas_current("med", 1, v)
            return True
        except Conflict:
            return False

    results = await asyncio.gather(*(attempt(v) for v in range(2, 7)))
    assert sum(results) == 1


async def test_versions_are_immutable(store: AdapterStore) -> None:
    rec = await store.create_version("med", b"one", base_model="m", source="create")
    # A reset counter must not allow an overwrite: the create script refuses.
    await store.r.set(store._k("med", "seq"), 0)
    with pytest.raises(Conflict):
        await store.create_version("med", b"evil", base_model="m", source="create")
    assert await store.get_blob("med", rec.version) == b"one"


async def test_digest_is_checked_on_every_read(store: AdapterStore) -> None:
    await store.create_version("med", b"good", base_model="m", source="create")
    await store.r.hset(store._k("med", "v", "1"), "blob", b"bad!")
    with pytest.raises(CorruptBlob):
        await store.get_blob("med", 1)


async def test_retention_keeps_newest_and_current_and_records(store: AdapterStore) -> None:
    await store.publish("med", b"v1", expected_current=None, base_model="m", source="create")
    for i in range(2, 6):
        await store.publish("med", f"v{i}".encode(), expected_current=i - 1, base_model="m", source="round")
    await store.rollback("med", 4)  # v6 = content of v4
    assert await store.current("med") == 6
    assert await store.get_blob("med", 6) == b"v4"
    pruned = [r.version for r in await store.list_versions("med") if r.pruned]
    assert pruned == [1, 2, 3, 4]
    rec = await store.get_version("med", 1)
    assert rec.pruned and rec.sha256  # the record survives retention
    with pytest.raises(NotFound, match="pruned"):
        await store.get_blob("med", 1)
    with pytest.raises(NotFound, match="pruned"):
        await store.rollback("med", 2)


async def test_events_stream_records_pointer_moves(store: AdapterStore) -> None:
    await store.publish("med", b"v1", expected_current=None, base_model="m", source="create")
    await store.publish("med", b"v2", expected_current=1, base_model="m", source="round")
    events = await store.r.xrange(store.events_key)
    assert [e[1][b"version"] for e in events] == [b"1", b"2"]


async def test_quality_records(store: AdapterStore) -> None:
    await store.create_version("med", b"v1", base_model="m", source="create")
    await store.record_quality("med", 1, {"medical": 1.5})
    await store.record_quality("med", 1, {"math": 2.0})
    assert await store.quality("med", 1) == {"medical": 1.5, "math": 2.0}


async def test_update_blobs_are_write_once(store: AdapterStore) -> None:
    key, sha = await store.put_update(3, "r0", b"delta")
    assert await store.get_update(key, sha) == b"delta"
    with pytest.raises(Conflict):
        await store.put_update(3, "r0", b"other")
    with pytest.raises(CorruptBlob):
        await store.get_update(key, "0" * 64)
