"""The whole stack through its launcher, used with the official `openai` package, unchanged."""

from __future__ import annotations

import io
import time
from collections.abc import Iterator

import pytest
from openai import OpenAI

from collm_ops.launcher import ReplicaSpec, Stack, StackConfig
from collm_ops.servers import free_port

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    from collm_ops.servers import start_nats, start_redis

    tmp = tmp_path_factory.mktemp("stack")
    nats = start_nats(workdir=tmp / "nats")
    redis = start_redis(workdir=tmp / "redis")
    logs = io.StringIO()
    cfg = StackConfig(
        nats_url=nats.url,
        redis_url=redis.url,
        redis_prefix="e2e",
        model="tiny",
        gateway_port=free_port(),
        replicas=[ReplicaSpec("r0"), ReplicaSpec("r1")],
        start_servers=False,
        run_dir=tmp / "run",
        ready_timeout_s=180,
    )
    s = Stack(cfg, log_sink=logs)
    try:
        s.start()
    except Exception:
        print(logs.getvalue()[-5000:])
        nats.stop()
        redis.stop()
        raise
    try:
        yield s
    finally:
        s.stop()
        nats.stop()
        redis.stop()


def test_streaming_chat_completion_and_models_list(stack: Stack) -> None:
    client = OpenAI(base_url=f"{stack.gateway_url}/v1", api_key="e2e-key")
    models = [m.id for m in client.models.list()]
    assert models, "the base model is always listed"
    base = models[0]
    stream = client.chat.completions.create(
        model=base,
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage, finish = "", None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert usage is not None and usage.completion_tokens >= 1
    assert finish in ("stop", "length")
    assert usage.completion_tokens <= 8


def test_replicas_answer_nats_micro(stack: Stack) -> None:
    # One ping gathers the answers of half a second: a replica busy on a loaded machine may answer the
    # next one instead.
    end = time.monotonic() + 30.0
    while (answering := stack.replicas_answering()) != {"r0", "r1"} and time.monotonic() < end:
        time.sleep(0.2)
    assert answering == {"r0", "r1"}
