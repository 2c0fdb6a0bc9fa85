"""Shared fixtures: real nats-server and redis-server on free ports, one pair per test that asks.

Servers are started from the project's own binaries (see collm_ops.servers), bound to 127.0.0.1, and
stopped with their data directories afterwards, so parallel runs never collide and nothing touches the
machine's standard ports.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from collm_ops.servers import ServerProcess, start_nats, start_redis

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SHARED = Path(__file__).resolve().parents[1].parent / "shared"


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[ServerProcess]:
    srv = start_nats(workdir=tmp_path / "nats")
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[ServerProcess]:
    srv = start_redis(workdir=tmp_path / "redis")
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def redis_prefix() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture
def shared_data() -> Path:
    """`../shared/data` when it exists; tests that need it skip cleanly otherwise."""
    d = SHARED / "data"
    if not d.is_dir():
        pytest.skip("../shared/data is not present")
    return d


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The replica's `tiny` model (seed 0) saved as a Hugging Face directory: usable as `COLLM_MODEL=<dir>`
    or with `AutoTokenizer.from_pretrained(dir)` (offline, seconds)."""
    from collm_replica.models import build_tiny_model

    d = tmp_path_factory.mktemp("tiny-model")
    model, tokenizer = build_tiny_model(0)
    model.save_pretrained(str(d))
    tokenizer.save_pretrained(str(d))
    return d


# --- tracing ------------------------------------------------------------------------------------------
# OpenTelemetry allows one global tracer provider per process, so the whole session shares one SDK
# provider with an in-memory exporter; `span_exporter` empties it for each test. If some other fixture
# already installed an SDK provider, the exporter joins that one instead of fighting over the global.
_SPAN_EXPORTERS: dict[int, tuple[TracerProvider, InMemorySpanExporter]] = {}


def session_span_exporter() -> InMemorySpanExporter:
    """The in-memory exporter attached to the process's global SDK tracer provider (installed once)."""
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
        provider = trace.get_tracer_provider()
        assert isinstance(provider, TracerProvider), "another tracer provider won the global slot"
    entry = _SPAN_EXPORTERS.get(id(provider))
    if entry is None:
        exporter = InMemorySpanExporter()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        entry = _SPAN_EXPORTERS[id(provider)] = (provider, exporter)
    return entry[1]


@pytest.fixture
def span_exporter() -> InMemorySpanExporter:
    """Spans finished during this test (the session's in-memory exporter, emptied first)."""
    exporter = session_span_exporter()
    exporter.clear()
    return exporter
