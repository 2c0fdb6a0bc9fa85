"""A real replica (tiny model) in-process against real nats-server and redis-server on free ports."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from collm_common.bus import Bus
from collm_common.service import ServiceContext, serve_until_stopped
from collm_common.settings import CommonSettings
from collm_common.store import AdapterStore
from collm_replica.settings import ReplicaSettings
from collm_replica.worker import Replica, serve

REPLICA_ID = "rt1"


async def eventually(check: Callable[[], object], timeout_s: float = 10.0, what: str = "condition") -> None:
    end = asyncio.get_running_loop().time() + timeout_s
    while not check():
        if asyncio.get_running_loop().time() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def write_dataset(d: Path, n: int = 40) -> None:
    d.mkdir(parents=True, exist_ok=True)
    with (d / "med.jsonl").open("w") as f:
        for i in range(n):
            f.write(
                json.dumps(
                    {
                        "id": f"m{i}",
                        "prompt": f"hello world {i}",
                        "response": f"the quick fox {i % 4}",
                        "domain": "med",
                    }
                )
                + "\n"
            )


@dataclass
class Running:
    settings: ReplicaSettings
    bus: Bus
    store: AdapterStore
    replica: Replica


@pytest.fixture
async def replica(nats_server, redis_server, redis_prefix, tmp_path: Path) -> AsyncIterator[Running]:
    data = tmp_path / "data"
    write_dataset(data)
    settings = ReplicaSettings(
        nats_url=nats_server.url,
        redis_url=redis_server.url,
        redis_prefix=redis_prefix,
        nats_connect_timeout_s=5,
        replica_id=REPLICA_ID,
        model="tiny",
        data_dir=data,
        telemetry_interval_s=0.2,
        adapter_sync_interval_s=0.5,
        train_micro_tokens=64,
        train_batch_tokens=64,
        train_max_seq_len=64,
        eval_max_examples=8,
        publish_every_steps=2,
        round_deadline_margin_s=0.5,
        ft_share_default=0.5,
        task_metrics={"med": "rouge_l"},
    )
    stopping = asyncio.Event()
    holder: dict[str, Replica] = {}

    async def serve_and_keep(ctx: ServiceContext[ReplicaSettings]) -> None:
        # Same as `serve`, but hands the Replica object to the test.
        import collm_replica.worker as svc

        original = svc.Replica

        class Kept(original):  # type: ignore[misc, valid-type]
            async def start(self) -> None:
                await super().start()
                holder["r"] = self  # every endpoint registered: the test may call any

        svc.Replica = Kept  # type: ignore[misc]
        try:
            await serve(ctx)
        finally:
            svc.Replica = original  # type: ignore[misc]

    task = asyncio.create_task(serve_until_stopped("collm-replica", settings, serve_and_keep, stopping))
    bus = await Bus.connect(CommonSettings(nats_url=nats_server.url, nats_connect_timeout_s=5), "test-client")
    store = AdapterStore.from_url(redis_server.url, redis_prefix)
    try:
        await eventually(lambda: "r" in holder or task.done(), 60, "replica start")
        if task.done():
            task.result()
        yield Running(settings, bus, store, holder["r"])
    finally:
        stopping.set()
        await asyncio.wait_for(task, 30)
        await bus.close()
        await store.close()


_EXPORTERS: dict[int, InMemorySpanExporter] = {}


@pytest.fixture
def spans() -> InMemorySpanExporter:
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    exporter = _EXPORTERS.get(id(provider))
    if exporter is None:
        exporter = InMemorySpanExporter()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        _EXPORTERS[id(provider)] = exporter
    exporter.clear()
    return exporter
