"""`POST /tokenize` and `POST /detokenize` end to end: the gateway app, real NATS and Redis, and a real
replica (the tiny model, in-process) answering on its `tokenize` endpoint."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from prometheus_client import REGISTRY

from collm_common.bus import Bus
from collm_common.store import AdapterStore
from collm_common.wire.inference import ChatMessage, GenerateRequest
from collm_gateway.keys import hash_key
from collm_replica.models import load_model
from collm_replica.settings import ReplicaSettings
from collm_replica.worker import Replica, prompt_ids

from .conftest import BASE_MODEL

pytestmark = pytest.mark.integration

torch.set_num_threads(1)
ACME, GLOBEX = "sk-tok-acme", "sk-tok-globex"
KEYS = {hash_key(ACME): {"tenant": "acme"}, hash_key(GLOBEX): {"tenant": "globex"}}
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]


@pytest.fixture
async def real_replica(nats_server, redis_server, redis_prefix, tmp_path: Path) -> AsyncIterator[Replica]:
    settings = ReplicaSettings(
        nats_url=nats_server.url,
        redis_url=redis_server.url,
        redis_prefix=redis_prefix,
        nats_connect_timeout_s=5,
        replica_id="tok0",
        model="tiny",
        data_dir=tmp_path / "data",
        samples_dir=tmp_path / "samples",
        telemetry_interval_s=0.2,
    )
    loaded = load_model("tiny", device="cpu", tiny_seed=0)
    bus = await Bus.connect(settings, "collm-replica-tok0")
    store = AdapterStore.from_url(redis_server.url, redis_prefix)
    replica = Replica(settings, loaded, bus, store)
    await replica.start()
    try:
        yield replica
    finally:
        await replica.stop()
        await bus.close()
        await store.close()


def refused(status: str, reason: str) -> float:
    labels = {"status": status, "reason": reason}
    return REGISTRY.get_sample_value("collm_gateway_requests_refused_total", labels) or 0.0


def error_of(resp: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if param is not None:
        assert err["param"] == param, err
    return err  # type: ignore[no-any-return]


async def test_tokenize_round_trip_and_chat_ids_through_a_real_replica(
    make_gateway, real_replica: Replica, store: AdapterStore
) -> None:
    await store.publish("med", b"v1", expected_current=None, base_model=BASE_MODEL, source="create")
    async with make_gateway() as gw:
        await gw.wait_replicas("tok0")
        text = "the quick brown fox caf\u00e9 \u4f60\u597d"
        resp = await gw.http.post("/tokenize", json={"model": BASE_MODEL, "prompt": text})
        assert resp.status_code == 200, resp.text
        out = resp.json()
        tok = real_replica.loaded.tokenizer
        assert out == {
            "count": len(out["tokens"]),
            "max_model_len": real_replica.loaded.max_model_len,
            "tokens": tok.encode(text),
            "token_strs": None,
        }
        back = await gw.http.post("/detokenize", json={"model": BASE_MODEL, "tokens": out["tokens"]})
        assert back.status_code == 200 and back.json() == {"prompt": text}
        # token strings on request; an adapter (current or pinned) and no model at all: the base tokenizer
        for model in ("med", "med@v1", None):
            body = {"prompt": text, "return_token_strs": True, **({"model": model} if model else {})}
            again = (await gw.http.post("/tokenize", json=body)).json()
            assert again["tokens"] == out["tokens"]
            assert again["token_strs"] == tok.convert_ids_to_tokens(out["tokens"])
        # chat: exactly the ids the replica feeds the model for these messages
        chat = await gw.http.post("/tokenize", json={"model": BASE_MODEL, "messages": MESSAGES})
        assert chat.status_code == 200, chat.text
        wire = [ChatMessage(**m) for m in MESSAGES]
        fed = prompt_ids(GenerateRequest(request_id="x", messages=wire), real_replica.loaded)
        assert chat.json()["tokens"] == fed and chat.json()["count"] == len(fed)
        done = await gw.openai.chat.completions.create(model=BASE_MODEL, messages=MESSAGES, max_tokens=2)
        assert done.usage is not None and done.usage.prompt_tokens == len(fed)
        # tools: the prompt a chat completion with them (tool_choice auto) is fed, tool description included
        tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
        with_tools = await gw.http.post("/tokenize", json={"messages": MESSAGES, "tools": tools})
        assert with_tools.status_code == 200, with_tools.text
        assert "get_time" in tok.decode(with_tools.json()["tokens"])
        called = await gw.openai.chat.completions.create(
            model=BASE_MODEL, messages=MESSAGES, tools=tools, max_tokens=2
        )
        assert called.usage is not None and called.usage.prompt_tokens == with_tools.json()["count"]
        # the chat options reach the template; content parts are text as on /v1/chat/completions
        parts = [
            {
                "role": "user",
                "content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "world"}],
            }
        ]
        cont = await gw.http.post(
            "/tokenize",
            json={
                "messages": [*parts, {"role": "assistant", "content": "The"}],
                "continue_final_message": True,
            },
        )
        assert cont.status_code == 200, cont.text
        assert tok.decode(cont.json()["tokens"]) == "<s>user: hello world</s><s>assistant: The"


async def test_refusals(make_gateway, real_replica: Replica, store: AdapterStore) -> None:
    await store.set_meta("globex-law", {"tenant": "globex"})
    await store.publish("globex-law", b"w", expected_current=None, base_model=BASE_MODEL, source="create")
    vocab = int(real_replica.loaded.config.vocab_size)
    async with make_gateway(api_keys=KEYS) as gw:
        await gw.wait_replicas("tok0")
        acme = {"Authorization": f"Bearer {ACME}"}
        before = refused("400", "invalid_value")
        resp = await gw.http.post(
            "/detokenize", json={"model": BASE_MODEL, "tokens": [5, vocab]}, headers=acme
        )
        err = error_of(resp, 400, "tokens")
        assert str(vocab) in err["message"] and err["type"] == "invalid_request_error"
        assert refused("400", "invalid_value") == before + 1
        error_of(await gw.http.post("/detokenize", json={"tokens": [-3]}, headers=acme), 400, "tokens")
        for model in ("nope", "globex-law", "med@v9"):  # another tenant's adapter looks unknown
            for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
                resp = await gw.http.post(path, json={"model": model, **body}, headers=acme)
                assert error_of(resp, 404, "model")["code"] == "model_not_found"
        assert (
            await gw.http.post(
                "/tokenize",
                json={"model": "globex-law", "prompt": "x"},
                headers={"Authorization": f"Bearer {GLOBEX}"},
            )
        ).status_code == 200
        # keys as on /v1/: none, or an unknown one, is 401 before the body is read
        for headers in ({}, {"Authorization": "Bearer sk-nope"}):
            for path in ("/tokenize", "/detokenize"):
                resp = await gw.http.post(path, content=b"{broken", headers=headers)
                assert error_of(resp, 401)["code"] == "invalid_api_key"
        bad = [
            ({"prompt": "x", "messages": MESSAGES}, None),
            ({}, None),
            ({"prompt": 5}, "prompt"),
            ({"messages": []}, "messages"),
            (
                {"messages": MESSAGES, "add_generation_prompt": True, "continue_final_message": True},
                "continue_final_message",
            ),
            ({"messages": MESSAGES, "tools": [{"type": "function"}]}, "tools.0.function"),
            ({"messages": MESSAGES, "chat_template": "{{ 1 }}"}, "chat_template"),
            ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages.0.content.0"),
            ({"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
        ]
        for body, param in bad:
            error_of(await gw.http.post("/tokenize", json=body, headers=acme), 400, param)
        # unknown fields are ignored, as on the completion routes
        ok = await gw.http.post("/tokenize", json={"prompt": "x", "priority": 3}, headers=acme)
        assert ok.status_code == 200, ok.text


async def test_no_replica_is_503(gateway) -> None:
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
        resp = await gateway.http.post(path, json={"model": BASE_MODEL, **body})
        err = error_of(resp, 503)
        assert err["code"] == "no_replica_available" and resp.headers["retry-after"]
