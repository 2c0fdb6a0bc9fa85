"""The adapter manager and the engine's offload verb: loads share one fetch, refusals are `ReplicaError`s,
an offloaded version leaves its slot and comes back on demand."""

from __future__ import annotations

import asyncio

import pytest

from collm_common.lora import encode_adapter
from collm_common.store import NotFound
from collm_replica.adapters import AdapterManager
from collm_replica.engine import Engine, EngineConfig
from collm_replica.engine.cosched import NoTraining
from collm_replica.errors import ReplicaError
from collm_replica.models import LoadedModel
from collm_replica.settings import ReplicaSettings
from collm_replica.tasks import Tasks
from tests.unit.replica.helpers import Collector, greedy, random_adapter

P = [8, 9, 10, 200, 201, 202]


class MemoryStore:
    """The two reads the manager makes of an `AdapterStore`, from memory (blob reads counted)."""

    def __init__(self, blobs: dict[tuple[str, int], bytes]) -> None:
        self.blobs = blobs
        self.blob_reads = 0

    async def current(self, name: str) -> int | None:
        return max((v for n, v in self.blobs if n == name), default=None)

    async def get_blob(self, name: str, version: int) -> bytes:
        self.blob_reads += 1
        await asyncio.sleep(0.01)
        if (name, version) not in self.blobs:
            raise NotFound(f"{name}@v{version} does not exist")
        return self.blobs[(name, version)]


def test_offload_frees_the_slot_unless_requests_use_it(tiny: LoadedModel) -> None:
    eng = Engine(tiny, EngineConfig(max_resident_adapters=2), NoTraining())  # iterations run by hand
    eng.install_version("a@v1", random_adapter(tiny, 1))
    eng._iteration()
    assert eng.is_resident("a@v1")
    c = Collector()
    eng.submit(greedy("pa", P, 3, adapter="a"), c)
    busy = eng.offload_version("a@v1")
    eng._iteration()
    with pytest.raises(ReplicaError) as exc:
        busy.result(1)
    assert exc.value.code == 409 and eng.is_resident("a@v1")
    while not c.done.is_set():
        eng._iteration()
    done = eng.offload_version("a@v1")
    eng._iteration()
    assert done.result(1) is True and not eng.is_resident("a@v1") and eng.current_version("a") is None
    again = eng.offload_version("a@v1")
    eng._iteration()
    assert again.result(1) is False


async def test_the_manager_fetches_once_loads_and_offloads(tiny: LoadedModel) -> None:
    store = MemoryStore({("a", 1): encode_adapter(random_adapter(tiny, 1))})
    with Engine(tiny, EngineConfig(max_resident_adapters=2), NoTraining()) as eng:
        tasks = Tasks()
        mgr = AdapterManager(ReplicaSettings(replica_id="t"), tiny, eng, store, None, tasks)  # type: ignore[arg-type]
        assert await mgr.load("a", 1, make_current=True) == "a@v1"
        reads = store.blob_reads
        assert await asyncio.gather(mgr.ensure("a"), mgr.ensure("a", 1)) == ["a@v1", "a@v1"]
        assert store.blob_reads == reads, "a resident current version is not fetched again"
        assert await mgr.offload("a@v1") is True and not eng.is_resident("a@v1")
        assert await asyncio.gather(mgr.ensure("a"), mgr.ensure("a")) == ["a@v1", "a@v1"]
        assert store.blob_reads == reads + 1, "concurrent loads of one version share one fetch"
        assert eng.current_version("a") == "a@v1" and "a" in mgr.known
        with pytest.raises(ReplicaError) as exc:
            await mgr.ensure("nosuch")
        assert (exc.value.code, exc.value.type, exc.value.param) == (404, "not_found", "model")
        with pytest.raises(ReplicaError) as exc:
            await mgr.ensure("a", 7)
        assert exc.value.code == 404
        store.blobs[("a", 3)] = b"not an adapter"
        with pytest.raises(ReplicaError) as exc:
            await mgr.ensure("a")
        assert (exc.value.code, exc.value.type) == (422, "invalid_adapter")
        await tasks.cancel_all()


async def test_a_store_pointer_behind_the_served_version_is_logged_and_counted_once(
    tiny: LoadedModel, caplog: pytest.LogCaptureFixture
) -> None:
    """Versions only grow: a current pointer moved back (by hand, around the aggregator) is a catalogue
    that disagrees with what the replica serves. Sync keeps serving the newer version, logs and counts it
    once per pointer value, and picks up the next real publication as usual."""
    from prometheus_client import REGISTRY

    store = MemoryStore({("a", 1): encode_adapter(random_adapter(tiny, 1))})
    store.blobs[("a", 2)] = encode_adapter(random_adapter(tiny, 2))
    pointer: dict[str, int] = {"a": 2}

    async def current(name: str) -> int | None:
        return pointer.get(name)

    store.current = current  # type: ignore[method-assign]
    labels = {"replica": "cat", "adapter": "a"}

    def behind() -> float:
        return REGISTRY.get_sample_value("collm_replica_catalog_behind_total", labels) or 0.0

    with Engine(tiny, EngineConfig(max_resident_adapters=2), NoTraining()) as eng:
        tasks = Tasks()
        mgr = AdapterManager(ReplicaSettings(replica_id="cat"), tiny, eng, store, None, tasks)  # type: ignore[arg-type]
        assert await mgr.load("a", 2, make_current=True) == "a@v2"
        before = behind()
        pointer["a"] = 1  # SET <prefix>:adapter:{a}:current 1
        await mgr.sync()
        await mgr.sync()
        assert eng.current_version("a") == "a@v2" and behind() == before + 1
        assert sum("behind v2 that this replica serves" in r.getMessage() for r in caplog.records) == 1
        store.blobs[("a", 3)] = encode_adapter(random_adapter(tiny, 3))
        pointer["a"] = 3  # the next publication
        await mgr.sync()
        assert eng.current_version("a") == "a@v3" and behind() == before + 1
        await tasks.cancel_all()
