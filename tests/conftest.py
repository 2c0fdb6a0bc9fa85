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
