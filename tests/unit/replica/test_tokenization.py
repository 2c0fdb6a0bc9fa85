"""The replica's `tokenize` answers with the tiny model's real tokenizer, and its chat path is the one a
generate request takes."""

from __future__ import annotations

import time

import pytest

from collm_common.wire import decode_json, encode_json
from collm_common.wire.inference import ChatMessage, GenerateRequest
from collm_common.wire.tokenize import (
    TOKENIZE_REQUEST,
    Detokenize,
    DetokenizeReply,
    TokenizeChat,
    TokenizeReply,
    TokenizeText,
)
from collm_replica.errors import ReplicaError
from collm_replica.models import LoadedModel
from collm_replica.tokenization import answer
from collm_replica.worker import longest_token_chars, prompt_ids

MESSAGES = [
    ChatMessage(role="system", content="be brief"),
    ChatMessage(role="user", content="What is the capital of France?"),
]


def test_text_is_encoded_and_decodes_back(tiny: LoadedModel) -> None:
    text = "the quick brown fox caf\u00e9 \u4f60\u597d"
    reply = answer(TokenizeText(prompt=text, return_token_strs=True), tiny)
    assert isinstance(reply, TokenizeReply)
    assert reply.tokens == tiny.tokenizer.encode(text) and len(reply.tokens) > 5
    assert reply.max_model_len == tiny.max_model_len
    assert reply.token_strs == tiny.tokenizer.convert_ids_to_tokens(reply.tokens)
    back = answer(Detokenize(tokens=reply.tokens), tiny)
    assert back == DetokenizeReply(prompt=text)


def test_token_strs_only_when_asked(tiny: LoadedModel) -> None:
    reply = answer(TokenizeText(prompt="hello world"), tiny)
    assert isinstance(reply, TokenizeReply) and reply.token_strs is None


def test_chat_ids_are_the_generate_prompt_ids(tiny: LoadedModel) -> None:
    reply = answer(TokenizeChat(messages=MESSAGES), tiny)
    fed = prompt_ids(GenerateRequest(request_id="r", messages=MESSAGES), tiny)
    assert isinstance(reply, TokenizeReply) and reply.tokens == fed
    text = tiny.tokenizer.decode(fed)
    assert text.startswith("<s>system: be brief</s>") and text.endswith("<s>assistant: ")


def test_chat_options_change_the_rendering(tiny: LoadedModel) -> None:
    prefill = [*MESSAGES, ChatMessage(role="assistant", content="The capital")]
    open_turn = answer(
        TokenizeChat(messages=prefill, add_generation_prompt=False, continue_final_message=True), tiny
    )
    assert isinstance(open_turn, TokenizeReply)
    assert tiny.tokenizer.decode(open_turn.tokens).endswith("<s>assistant: The capital")
    closed = answer(TokenizeChat(messages=MESSAGES, add_generation_prompt=False), tiny)
    assert isinstance(closed, TokenizeReply)
    assert tiny.tokenizer.decode(closed.tokens).endswith("France?</s>")


def test_refusals_name_the_field(tiny: LoadedModel) -> None:
    vocab = int(tiny.config.vocab_size)
    for bad in ([vocab], [-1], [0, vocab + 7]):
        with pytest.raises(ReplicaError) as err:
            answer(Detokenize(tokens=bad), tiny)
        assert err.value.code == 400 and err.value.param == "tokens" and str(vocab) in err.value.message
    assert answer(Detokenize(tokens=[vocab - 1]), tiny)  # the last id is in the vocabulary
    assert answer(Detokenize(tokens=[]), tiny) == DetokenizeReply(prompt="")
    with pytest.raises(ReplicaError) as err:
        answer(TokenizeChat(messages=[]), tiny)
    assert err.value.code == 400 and err.value.param == "messages"
    with pytest.raises(ReplicaError) as err:  # the template refuses both at once
        answer(TokenizeChat(messages=MESSAGES, continue_final_message=True), tiny)
    assert err.value.code == 400 and err.value.param == "messages"


def test_requests_travel_as_json_too() -> None:
    for msg in (TokenizeText(prompt="x"), TokenizeChat(messages=MESSAGES), Detokenize(tokens=[1, 2])):
        assert decode_json(TOKENIZE_REQUEST, encode_json(msg)) == msg


def test_a_prompt_surely_over_the_context_is_refused_before_tokenizing(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 1 MiB prompt is more tokens than the context holds whatever its text: refused at once, never
    tokenized; a prompt that may fit is tokenized and judged by the engine."""
    longest = longest_token_chars(tiny.tokenizer)
    assert longest >= 1
    calls: list[str] = []
    real_encode = tiny.tokenizer.encode
    monkeypatch.setattr(
        tiny.tokenizer, "encode", lambda text, **kw: calls.append(text) or real_encode(text, **kw)
    )
    big = GenerateRequest(request_id="big", prompt="x" * (1 << 20))
    t0 = time.perf_counter()
    with pytest.raises(ReplicaError) as err:
        prompt_ids(big, tiny)
    assert time.perf_counter() - t0 < 0.5 and calls == []
    e = err.value
    assert (e.code, e.param, e.error_code) == (400, "prompt", "context_length_exceeded")
    assert e.message.startswith(f"This model's maximum context length is {tiny.max_model_len} tokens.")
    chat = GenerateRequest(request_id="chat", messages=[ChatMessage(role="user", content="y" * (1 << 20))])
    with pytest.raises(ReplicaError) as err:
        prompt_ids(chat, tiny)
    assert err.value.param == "messages"
    # Near the bound (fewer characters than context x longest token): tokenized, as before.
    room = tiny.max_model_len - big.sampling.max_tokens - 1
    near = GenerateRequest(request_id="near", prompt="x" * (room * longest))
    assert len(prompt_ids(near, tiny)) > 0 and calls
