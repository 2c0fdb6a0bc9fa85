"""OpenAI response bodies and stream chunks, built as plain dicts (pure; shapes tested in unit tests).

Streams follow OpenAI's shape: every chunk carries the same `id`, `created` and `model`; a chat stream
opens with a delta carrying the role, the last choice chunk carries `finish_reason`, and with
`stream_options.include_usage` every chunk carries `"usage": null` and one more chunk follows with
`choices: []` and the usage (OpenAI's shape: only the last chunk's usage is set). The serving
layer ends every stream with `data: [DONE]`. `system_fingerprint` names the replica and the exact
adapter version that produced the tokens (`r0/medical@v3`).

Log probabilities, when asked, come in OpenAI's shapes: chat `logprobs.content` lists `{token, logprob,
bytes, top_logprobs}` per token; completions use the legacy `{tokens, token_logprobs, top_logprobs,
text_offset}`, where each `top_logprobs` dict holds the chosen token and the most likely ones, and
`text_offset` is the position of each token's text in the completion (the sum of the lengths of the
tokens before it, as vLLM counts it). A token is its text decoded alone; its `bytes` are its raw bytes
(a byte of a multi-byte character is that byte, as OpenAI sends it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from fastapi.sse import format_sse_event

from collm_common.wire.inference import TokenLogprob

DONE_EVENT = format_sse_event(data_str="[DONE]")

OpenAIFinish = Literal["stop", "length", "tool_calls"]


def fingerprint(replica_id: str, adapter_version_id: str) -> str:
    return f"{replica_id}/{adapter_version_id}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def sse(obj: dict[str, Any]) -> bytes:
    """One `data:` event with a JSON payload."""
    return format_sse_event(data_str=json.dumps(obj, separators=(",", ":"), ensure_ascii=False))


@dataclass(frozen=True)
class StreamIdentity:
    """What every chunk of one response repeats."""

    id: str
    created: int
    model: str
    system_fingerprint: str
    include_usage: bool = False  # stream_options.include_usage: every chunk has a `usage` key


def _with_usage_key(ident: StreamIdentity, chunk: dict[str, Any]) -> dict[str, Any]:
    """`chunk` with `"usage": null` when the stream reports usage (the last chunk then sets it)."""
    if ident.include_usage:
        chunk["usage"] = None
    return chunk


def _top_entry(token: str, logprob: float, raw: bytes | None = None) -> dict[str, Any]:
    """OpenAI's entry; `bytes` are the token's raw bytes when the replica sent them (a partial UTF-8
    character's own byte), else the UTF-8 of its text."""
    return {
        "token": token,
        "logprob": logprob,
        "bytes": list(raw if raw is not None else token.encode("utf-8")),
    }


def chat_logprobs(entries: list[TokenLogprob]) -> dict[str, Any]:
    """A chat choice's `logprobs`: one entry per token."""
    content = []
    for e in entries:
        item = _top_entry(e.token, e.logprob, e.token_bytes)
        item["top_logprobs"] = [_top_entry(t.token, t.logprob, t.token_bytes) for t in e.top]
        content.append(item)
    return {"content": content, "refusal": None}


def text_logprobs(entries: list[TokenLogprob], offset: int = 0) -> dict[str, Any]:
    """A completion choice's legacy `logprobs`; `offset`: the text length of the tokens before these."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{e.token: e.logprob} | {t.token: t.logprob for t in e.top} for e in entries],
        "text_offset": offsets,
    }


@dataclass
class Choice:
    """One choice of a whole (non-streamed) answer."""

    index: int
    text: str
    finish_reason: OpenAIFinish
    logprobs: list[TokenLogprob] | None = None
    # OpenAI's tool_calls (finish_reason "tool_calls", or "length" for calls cut short).
    tool_calls: list[dict[str, Any]] | None = None


def _message(c: Choice) -> dict[str, Any]:
    if c.tool_calls:
        return {"role": "assistant", "content": None, "tool_calls": c.tool_calls}
    return {"role": "assistant", "content": c.text}


def _envelope(ident: StreamIdentity, object_name: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
    """An answer's or a stream chunk's fields around its `choices` (both shapes, whole or streamed)."""
    return {
        "id": ident.id,
        "object": object_name,
        "created": ident.created,
        "model": ident.model,
        "system_fingerprint": ident.system_fingerprint,
        "choices": choices,
    }


class _Stream:
    """What the two shapes' streams share: chunks of the object `chunk_object`, and the usage chunk."""

    chunk_object = ""

    def _chunk(self, ident: StreamIdentity, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return _with_usage_key(ident, _envelope(ident, self.chunk_object, choices))

    def usage_chunk(
        self, ident: StreamIdentity, prompt_tokens: int, completion_tokens: int
    ) -> dict[str, Any]:
        chunk = self._chunk(ident, [])
        chunk["usage"] = usage(prompt_tokens, completion_tokens)
        return chunk


class ChatShape(_Stream):
    """`chat.completion` and `chat.completion.chunk`."""

    id_prefix = "chatcmpl-"
    param = "messages"
    chunk_object = "chat.completion.chunk"

    def opening(self, ident: StreamIdentity, n: int = 1) -> dict[str, Any] | None:
        return self._chunk(
            ident,
            [
                {
                    "index": i,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                for i in range(n)
            ],
        )

    def delta(
        self,
        ident: StreamIdentity,
        text: str,
        logprobs: list[TokenLogprob] | None = None,
        offset: int = 0,
        index: int = 0,
    ) -> dict[str, Any]:
        del offset  # chat logprobs carry no text offsets
        lp = chat_logprobs(logprobs) if logprobs is not None else None
        return self._chunk(
            ident, [{"index": index, "delta": {"content": text}, "logprobs": lp, "finish_reason": None}]
        )

    def closing(self, ident: StreamIdentity, finish_reason: OpenAIFinish, index: int = 0) -> dict[str, Any]:
        return self._chunk(
            ident, [{"index": index, "delta": {}, "logprobs": None, "finish_reason": finish_reason}]
        )

    def tool_calls_delta(
        self, ident: StreamIdentity, tool_calls: list[dict[str, Any]], index: int = 0
    ) -> dict[str, Any]:
        """A choice's complete tool calls in one delta (each call whole, numbered by its `index`)."""
        calls = [{"index": k, **call} for k, call in enumerate(tool_calls)]
        return self._chunk(
            ident, [{"index": index, "delta": {"tool_calls": calls}, "logprobs": None, "finish_reason": None}]
        )

    def complete(
        self, ident: StreamIdentity, choices: list[Choice], prompt_tokens: int, completion_tokens: int
    ) -> dict[str, Any]:
        choice_docs = [
            {
                "index": c.index,
                "message": _message(c),
                "logprobs": chat_logprobs(c.logprobs) if c.logprobs is not None else None,
                "finish_reason": c.finish_reason,
            }
            for c in choices
        ]
        return _envelope(ident, "chat.completion", choice_docs) | {
            "usage": usage(prompt_tokens, completion_tokens)
        }


class TextShape(_Stream):
    """`text_completion` (the legacy completions API; chunks have the same object name)."""

    id_prefix = "cmpl-"
    param = "prompt"
    chunk_object = "text_completion"

    def opening(self, ident: StreamIdentity, n: int = 1) -> dict[str, Any] | None:
        del ident, n  # text streams have no role delta
        return None

    def delta(
        self,
        ident: StreamIdentity,
        text: str,
        logprobs: list[TokenLogprob] | None = None,
        offset: int = 0,
        index: int = 0,
    ) -> dict[str, Any]:
        lp = text_logprobs(logprobs, offset) if logprobs is not None else None
        return self._chunk(ident, [{"index": index, "text": text, "logprobs": lp, "finish_reason": None}])

    def closing(self, ident: StreamIdentity, finish_reason: OpenAIFinish, index: int = 0) -> dict[str, Any]:
        return self._chunk(
            ident, [{"index": index, "text": "", "logprobs": None, "finish_reason": finish_reason}]
        )

    def complete(
        self, ident: StreamIdentity, choices: list[Choice], prompt_tokens: int, completion_tokens: int
    ) -> dict[str, Any]:
        out = self._chunk(
            ident,
            [
                {
                    "index": c.index,
                    "text": c.text,
                    "logprobs": text_logprobs(c.logprobs) if c.logprobs is not None else None,
                    "finish_reason": c.finish_reason,
                }
                for c in choices
            ],
        )
        out["usage"] = usage(prompt_tokens, completion_tokens)
        return out


Shape = ChatShape | TextShape


def model_card(
    model_id: str, created: int, owned_by: str, parent: str | None, root: str, max_model_len: int | None
) -> dict[str, Any]:
    """An OpenAI model card (vLLM's fields: `root`, `parent`, `max_model_len`, `permission`)."""
    card: dict[str, Any] = {
        "id": model_id,
        "object": "model",
        "created": created,
        "owned_by": owned_by,
        "root": root,
        "parent": parent,
        "permission": [],
    }
    if max_model_len is not None:
        card["max_model_len"] = max_model_len
    return card
