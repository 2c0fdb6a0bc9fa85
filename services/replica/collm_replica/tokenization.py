"""Text to token ids and back with the replica's tokenizer: the one chat-template path of the replica.

`chat_ids` is how a generate request's messages become prompt ids, and what a `TokenizeChat` request
answers, so `/tokenize` shows exactly what the model is fed. `answer` serves the `tokenize` endpoint
(collm_common.wire.tokenize); everything here is pure over the tokenizer and raises `ReplicaError`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from collm_common.wire.inference import ChatMessage
from collm_common.wire.tokenize import (
    Detokenize,
    DetokenizeReply,
    TokenizeChat,
    TokenizeReply,
    TokenizeRequest,
    TokenizeText,
)
from collm_replica.errors import ReplicaError
from collm_replica.models import LoadedModel


def vocab_size(loaded: LoadedModel) -> int:
    """The number of token ids the model takes (ids are in [0, vocab_size))."""
    return int(loaded.config.vocab_size)


def check_token_ids(ids: Sequence[int], vocab: int, param: str, allow_empty: bool = False) -> list[int]:
    """`ids` as a list when every id is in [0, vocab) (and, unless `allow_empty`, there is one), else
    a 400 naming `param` and the range."""
    if (not ids and not allow_empty) or any(t < 0 or t >= vocab for t in ids):
        what = "ids" if allow_empty else "non-empty ids"
        raise ReplicaError(400, f"{param} must be {what} in the vocabulary [0, {vocab})", param=param)
    return list(ids)


def chat_ids(
    tokenizer: Any,
    messages: Sequence[ChatMessage],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    add_special_tokens: bool = False,
) -> list[int]:
    """`messages` rendered by the tokenizer's chat template, then encoded (the defaults are a generate
    request's); 400 naming `messages` when they are empty or the template rejects them."""
    if not messages:
        raise ReplicaError(400, "messages must not be empty", param="messages")
    try:
        text = tokenizer.apply_chat_template(
            [{"role": m.role, "content": m.content} for m in messages],
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=False,
        )
    except Exception as exc:  # noqa: BLE001 - a template that rejects these messages
        raise ReplicaError(400, f"the chat template rejected the messages: {exc}", param="messages") from None
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def answer(req: TokenizeRequest, loaded: LoadedModel) -> TokenizeReply | DetokenizeReply:
    """The reply to one `tokenize` request (ReplicaError 400 for bad input)."""
    tok = loaded.tokenizer
    if isinstance(req, Detokenize):
        ids = check_token_ids(req.tokens, vocab_size(loaded), "tokens", allow_empty=True)
        return DetokenizeReply(prompt=tok.decode(ids))
    if isinstance(req, TokenizeChat):
        ids = chat_ids(
            tok, req.messages, req.add_generation_prompt, req.continue_final_message, req.add_special_tokens
        )
    else:
        assert isinstance(req, TokenizeText)
        ids = list(tok.encode(req.prompt, add_special_tokens=req.add_special_tokens))
    strs = list(tok.convert_ids_to_tokens(ids)) if req.return_token_strs else None
    return TokenizeReply(tokens=ids, token_strs=strs, max_model_len=loaded.max_model_len)
