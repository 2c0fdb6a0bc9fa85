"""A replica's tokenizer on request: `subjects.replica(id, "tokenize")`, msgpack or JSON.

The gateway's `POST /tokenize` and `POST /detokenize` (vLLM's) are answered by a replica, which holds the
tokenizer. Every adapter of a replica shares the base model's tokenizer, so requests name no model.

| request (`TOKENIZE_REQUEST`, by `op`) | reply            |
|---------------------------------------|------------------|
| `TokenizeText`                        | `TokenizeReply`  |
| `TokenizeChat`                        | `TokenizeReply`  |
| `Detokenize`                          | `DetokenizeReply`|

A refusal is an error reply with an `ErrorReply` body naming the field at fault (`param`): 400 for token
ids outside the vocabulary (`tokens`), empty messages or messages the chat template rejects
(`messages`); 413 for a reply that would not fit in one NATS message.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, TypeAdapter

from collm_common.wire.base import WireModel
from collm_common.wire.inference import ChatMessage


class TokenizeText(WireModel):
    """`prompt` encoded as the replica encodes a completion's prompt (special tokens when asked)."""

    op: Literal["tokenize_text"] = "tokenize_text"
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChat(WireModel):
    """`messages` through the chat template, then encoded: with the defaults, exactly the prompt ids a
    generate request with these messages gets."""

    op: Literal["tokenize_chat"] = "tokenize_chat"
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False


class Detokenize(WireModel):
    """Token ids decoded to text (special tokens included, as vLLM decodes them)."""

    op: Literal["detokenize"] = "detokenize"
    tokens: list[int]


TokenizeRequest = Annotated[TokenizeText | TokenizeChat | Detokenize, Field(discriminator="op")]
TOKENIZE_REQUEST = TypeAdapter(TokenizeRequest)
TOKENIZE_REQUEST.schema_name = "collm.v1.TokenizeRequest"  # type: ignore[attr-defined]


class TokenizeReply(WireModel):
    tokens: list[int]
    # Each id's token string (`convert_ids_to_tokens`) when the request asked for them, else None.
    token_strs: list[str] | None = None
    # The longest sequence (prompt plus completion) this replica's model takes.
    max_model_len: int


class DetokenizeReply(WireModel):
    prompt: str
