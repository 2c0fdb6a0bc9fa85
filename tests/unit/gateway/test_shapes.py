"""OpenAI chunk and body shapes, SSE framing."""

import dataclasses
import json

import pytest

from collm_gateway.shapes import (
    DONE_EVENT,
    ChatShape,
    StreamIdentity,
    TextShape,
    fingerprint,
    model_card,
    sse,
)

pytestmark = pytest.mark.unit

ID = StreamIdentity(
    id="chatcmpl-1", created=1700000000, model="medical", system_fingerprint=fingerprint("r0", "medical@v3")
)


def test_sse_framing_and_done() -> None:
    assert sse({"a": 1}) == b'data: {"a":1}\n\n'
    assert DONE_EVENT == b"data: [DONE]\n\n"
    assert sse({"t": "é\n"}).decode().startswith('data: {"t":"é\\n"}')


def test_chat_stream_chunks() -> None:
    s = ChatShape()
    first = s.opening(ID)
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first["choices"][0]["finish_reason"] is None
    mid = s.delta(ID, "Hi")
    assert mid["choices"][0]["delta"] == {"content": "Hi"} and mid["choices"][0]["finish_reason"] is None
    last = s.closing(ID, "length")
    assert last["choices"][0]["finish_reason"] == "length" and last["choices"][0]["delta"] == {}
    u = s.usage_chunk(ID, 7, 3)
    assert u["choices"] == [] and u["usage"] == {
        "prompt_tokens": 7,
        "completion_tokens": 3,
        "total_tokens": 10,
    }
    for chunk in (first, mid, last, u):
        assert (chunk["id"], chunk["created"], chunk["model"]) == ("chatcmpl-1", 1700000000, "medical")
        assert chunk["system_fingerprint"] == "r0/medical@v3"


@pytest.mark.parametrize("shape", [ChatShape(), TextShape()], ids=["chat", "text"])
def test_with_include_usage_every_chunk_before_the_last_has_null_usage(shape: ChatShape | TextShape) -> None:
    ident = dataclasses.replace(ID, include_usage=True)
    before = [shape.opening(ident), shape.delta(ident, "Hi"), shape.closing(ident, "stop")]
    for chunk in (c for c in before if c is not None):
        assert "usage" in chunk and chunk["usage"] is None
    assert shape.usage_chunk(ident, 7, 3)["usage"]["total_tokens"] == 10
    # without include_usage no chunk has the key
    plain = [shape.opening(ID), shape.delta(ID, "Hi"), shape.closing(ID, "stop")]
    assert not any("usage" in c for c in plain if c is not None)


def test_chat_complete_body() -> None:
    body = ChatShape().complete(ID, "Hello", "stop", 7, 2)
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hello"}
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["total_tokens"] == 9
    json.dumps(body)


def test_text_stream_chunks_and_body() -> None:
    s = TextShape()
    assert s.opening(ID) is None
    assert s.delta(ID, "x")["choices"][0] == {
        "index": 0,
        "text": "x",
        "logprobs": None,
        "finish_reason": None,
    }
    assert s.closing(ID, "stop")["choices"][0]["finish_reason"] == "stop"
    assert s.usage_chunk(ID, 1, 1)["choices"] == []
    body = s.complete(ID, "abc", "length", 3, 3)
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == "abc"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}


def test_model_card() -> None:
    card = model_card("medical", 5, "collm", "base", "medical@v3", None)
    assert card == {
        "id": "medical",
        "object": "model",
        "created": 5,
        "owned_by": "collm",
        "root": "medical@v3",
        "parent": "base",
        "permission": [],
    }
    assert model_card("base", 5, "collm", None, "base", 2048)["max_model_len"] == 2048
