"""OpenAI chunk and body shapes, SSE framing."""

import dataclasses
import json

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from collm_common.wire.inference import TokenLogprob, TopLogprob
from collm_gateway.shapes import (
    DONE_EVENT,
    ChatShape,
    Choice,
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
    body = ChatShape().complete(ID, [Choice(0, "Hello", "stop")], 7, 2)
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
    body = s.complete(ID, [Choice(0, "abc", "length")], 3, 3)
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


LP = [
    TokenLogprob(
        token_id=5,
        token=" Hé",
        logprob=-0.25,
        top=[
            TopLogprob(token_id=5, token=" Hé", logprob=-0.25),
            TopLogprob(token_id=9, token="x", logprob=-2.0),
        ],
    ),
    TokenLogprob(token_id=7, token="llo", logprob=-1.5, top=[]),
]


def test_chat_logprobs_parse_with_openai_types() -> None:
    body = ChatShape().complete(ID, [Choice(0, " Héllo", "stop", LP)], 3, 2)
    parsed = ChatCompletion.model_validate(body)
    content = parsed.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and [c.token for c in content] == [" Hé", "llo"]
    assert content[0].bytes == list(" Hé".encode()) and content[0].logprob == -0.25
    assert [t.token for t in content[0].top_logprobs] == [" Hé", "x"] and content[1].top_logprobs == []
    chunk = ChatCompletionChunk.model_validate(ChatShape().delta(ID, " Hé", LP[:1]))
    assert chunk.choices[0].logprobs is not None and chunk.choices[0].logprobs.content[0].logprob == -0.25  # type: ignore[index]
    assert ChatShape().complete(ID, [Choice(0, "x", "stop")], 1, 1)["choices"][0]["logprobs"] is None


def test_text_logprobs_legacy_shape_with_offsets() -> None:
    body = TextShape().complete(ID, [Choice(0, " Héllo", "length", LP)], 3, 2)
    parsed = Completion.model_validate(body)
    lp = parsed.choices[0].logprobs
    assert lp is not None
    assert lp.tokens == [" Hé", "llo"] and lp.token_logprobs == [-0.25, -1.5]
    assert lp.top_logprobs == [{" Hé": -0.25, "x": -2.0}, {"llo": -1.5}]
    assert lp.text_offset == [0, 3]
    # A stream's chunk continues the offsets of the tokens before it.
    mid = TextShape().delta(ID, "llo", LP[1:], offset=3)
    assert mid["choices"][0]["logprobs"]["text_offset"] == [3]


def test_several_choices_in_openai_shapes() -> None:
    chat = ChatShape()
    body = chat.complete(ID, [Choice(0, "a", "stop"), Choice(1, "bc", "length", LP[1:])], 5, 3)
    parsed = ChatCompletion.model_validate(body)
    assert [(c.index, c.message.content, c.finish_reason) for c in parsed.choices] == [
        (0, "a", "stop"),
        (1, "bc", "length"),
    ]
    assert parsed.choices[0].logprobs is None and parsed.choices[1].logprobs is not None
    opening = ChatCompletionChunk.model_validate(chat.opening(ID, 3))
    assert [c.index for c in opening.choices] == [0, 1, 2]
    assert {c.delta.role for c in opening.choices} == {"assistant"}
    assert ChatCompletionChunk.model_validate(chat.delta(ID, "x", index=2)).choices[0].index == 2
    assert ChatCompletionChunk.model_validate(chat.closing(ID, "stop", 1)).choices[0].index == 1
    two = [Choice(0, "a", "stop"), Choice(1, "b", "stop")]
    text = Completion.model_validate(TextShape().complete(ID, two, 5, 2))
    assert [c.text for c in text.choices] == ["a", "b"]


def test_answers_to_a_list_of_prompts_merge_in_prompt_order() -> None:
    from collm_gateway.serving import merge_completions

    def answer(ident: str, texts: list[str], pt: int, ct: int) -> dict:
        return {
            "id": ident,
            "object": "text_completion",
            "choices": [{"index": i, "text": t, "finish_reason": "length"} for i, t in enumerate(texts)],
            "usage": {"prompt_tokens": pt, "completion_tokens": ct, "total_tokens": pt + ct},
        }

    merged = merge_completions([answer("a", ["x", "y"], 3, 4), answer("b", ["z", "w"], 5, 6)], n=2)
    assert merged["id"] == "a" and merged["object"] == "text_completion"
    assert [(c["index"], c["text"]) for c in merged["choices"]] == [(0, "x"), (1, "y"), (2, "z"), (3, "w")]
    assert merged["usage"] == {"prompt_tokens": 8, "completion_tokens": 10, "total_tokens": 18}
