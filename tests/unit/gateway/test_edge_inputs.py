"""Inputs JSON allows but the wire cannot carry: refused with 400 at the edge (found by tests/fuzz)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from collm_gateway.adapter_admin import LoadLoraAdapterRequest
from collm_gateway.errors import APIError
from collm_gateway.protocol import MAX_TOKEN_ID, ChatCompletionRequest, CompletionRequest, lone_surrogate_at
from collm_gateway.samples import SamplesIn

pytestmark = pytest.mark.unit

SURROGATE = "\ud800"  # what JSON's "\ud800" decodes to: not encodable as UTF-8


def test_lone_surrogates_are_found_anywhere() -> None:
    assert lone_surrogate_at("plain") is None and lone_surrogate_at("naïve ✓") is None
    assert lone_surrogate_at({"a": [1, {"b": SURROGATE}]}) == "a.1.b"
    with pytest.raises(ValidationError, match="lone surrogate"):
        CompletionRequest.model_validate({"model": "m", "prompt": SURROGATE})
    with pytest.raises(ValidationError, match="content contains a lone surrogate"):
        ChatCompletionRequest.model_validate(
            {"model": "m", "messages": [{"role": "user", "content": "a" + SURROGATE}]}
        )
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate(
            {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": SURROGATE}]}]}
        )
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate(
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": [SURROGATE]}
        )
    with pytest.raises(ValidationError):
        SamplesIn.model_validate({"samples": [{"replica_id": "r0", "prompt": "p", "response": SURROGATE}]})
    with pytest.raises(ValidationError):
        LoadLoraAdapterRequest.model_validate({"lora_name": "a", "lora_path": "/x/" + SURROGATE})


@pytest.mark.parametrize("prompt", [[MAX_TOKEN_ID], [[1, 2**70]], [2**63]])
def test_token_ids_beyond_any_vocabulary_are_refused(prompt: list) -> None:
    req = CompletionRequest.model_validate({"model": "m", "prompt": prompt})
    with pytest.raises(APIError) as err:
        req.wire_prompt()
    assert err.value.status == 400 and err.value.param == "prompt"
    ok = CompletionRequest.model_validate({"model": "m", "prompt": [MAX_TOKEN_ID - 1]})
    assert ok.wire_prompt() == (None, [MAX_TOKEN_ID - 1])


def test_a_text_part_without_text_says_so() -> None:
    req = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": [{"type": "text"}]}]}
    )
    with pytest.raises(APIError) as err:
        req.wire_messages()
    assert err.value.param == "messages.0.content.0.text" and "needs its 'text'" in err.value.message


@pytest.mark.parametrize("path", ["relative/dir", "~/adapter", "/a/\x00b", "/" + "x" * 256, ""])
def test_lora_path_must_be_an_absolute_usable_path(path: str) -> None:
    with pytest.raises(ValidationError):
        LoadLoraAdapterRequest.model_validate({"lora_name": "a", "lora_path": path})
    assert LoadLoraAdapterRequest.model_validate({"lora_name": "a", "lora_path": "/" + "x" * 255}).lora_path
