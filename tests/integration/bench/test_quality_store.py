"""The served-quality table read from a real adapter store (redis-server on a free port)."""

from __future__ import annotations

import pytest

from collm_bench.quality_store import load_quality_from_store
from collm_common.store import AdapterStore
from collm_ops.servers import ServerProcess
from collm_workload.goodput import summarize
from collm_workload.records import RequestRecord

pytestmark = pytest.mark.integration


async def test_quality_records_of_served_versions(redis_server: ServerProcess, redis_prefix: str) -> None:
    store = AdapterStore.from_url(redis_server.url, prefix=redis_prefix)
    try:
        for blob in (b"one", b"two"):
            await store.create_version("medical", blob, base_model="m", source="round")
        await store.create_version("math", b"m1", base_model="m", source="create")  # zero-B: the base model
        await store.create_version("math", b"m2", base_model="m", source="round")
        await store.record_quality("medical", 1, {"medical": 1.6})
        await store.record_quality("medical", 2, {"medical": 1.3, "math": 1.1})
        await store.record_quality("medical", 0, {"medical": 2.0})  # base-model losses (version 0)
        await store.record_quality("math", 1, {"math": 1.0, "medical": 2.5})
        await store.record_quality("math", 2, {"math": 0.7})
    finally:
        await store.close()

    table = await load_quality_from_store(redis_server.url, redis_prefix, ["medical"])
    assert table.versions == {"medical@v1": {"medical": 1.6}, "medical@v2": {"medical": 1.3, "math": 1.1}}
    assert table.base == {"medical": 2.0}
    everything = await load_quality_from_store(redis_server.url, redis_prefix)
    assert everything.versions["math@v2"] == {"math": 0.7}
    # Base losses: version 0 records first, then the created (zero-B) version's.
    assert everything.base == {"medical": 2.0, "math": 1.0}

    def served(i: int, version: str) -> RequestRecord:
        return RequestRecord(
            f"r{i}", i, "medical", "medical", "ok", float(i), end_s=i + 1.0, ttft_ms=1, e2e_ms=2,
            completion_tokens=2, adapter_version=version,
        )  # fmt: skip

    recs = [served(0, "medical@v1"), served(1, "medical@v2+r0.1")]
    q = summarize(recs, quality=table)["quality"]
    assert q["mean_quality_gain"] == pytest.approx(((2.0 - 1.6) + (2.0 - 1.3)) / 2)
    assert q["by_domain"]["medical"]["last_quality_gain"] == pytest.approx(0.7)
