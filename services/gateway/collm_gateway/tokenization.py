"""vLLM's `POST /tokenize` and `POST /detokenize`: the request bodies, and their answer by a replica.

The gateway holds no tokenizer. It resolves `model` as every route does (`ModelCatalog.resolve`: the
base model, `adapter` or `adapter@vN`; unknown or another tenant's is 404; absent means the base model,
as in vLLM), ranks the fresh replicas as it ranks a generation without an adapter (`rank_replicas`: the
least loaded first), and asks the first for the answer on its `tokenize` endpoint
(collm_common.wire.tokenize). Every adapter shares its base model's tokenizer, so the adapter itself
does not travel. A replica that does not answer (no responders, 503, or silence past
`first_event_timeout_s`) is replaced by the next ranked one, at most `max_retries` times; none fresh is
503. A chat request is tokenized by the replica's generate path (`collm_replica.tokenization.chat_ids`),
so its ids are the prompt the model would be fed for the same messages.

Bodies follow vLLM's `TokenizeCompletionRequest` / `TokenizeChatRequest` (one body with exactly one of
`prompt` and `messages`) and `DetokenizeRequest`. Unknown fields are ignored as on the completion
routes; `tools` are rendered as a chat completion with `tool_choice: auto` renders them (a first system
message, `collm_common.structured.tool_system_prompt`); the chat fields that would change the ids and
that CoLLM does not implement (`chat_template`, `chat_template_kwargs`, `documents`) are refused with a
400 naming them unless sent at a neutral value.
"""

from __future__ import annotations

import random
from typing import Any

from pydantic import BaseModel, Field, model_validator

from collm_common import subjects
from collm_common.bus import Bus, BusError, NoResponders, PayloadTooLarge
from collm_common.wire.tokenize import (
    Detokenize,
    DetokenizeReply,
    TokenizeChat,
    TokenizeReply,
    TokenizeText,
)
from collm_gateway import errors
from collm_gateway.auth import Principal
from collm_gateway.catalog import ModelCatalog
from collm_gateway.cluster import ClusterView
from collm_gateway.dispatch import Refusal, exhausted
from collm_gateway.errors import APIError, bad_request
from collm_gateway.protocol import (
    MAX_TOKEN_ID,
    Bool,
    ChatMessageIn,
    Int,
    OpenAIModel,
    prompt_messages,
    refuse_unsupported,
)
from collm_gateway.routing import rank_replicas
from collm_gateway.settings import GatewaySettings
from collm_gateway.tools import MAX_TOOLS, ToolIn, tool_choice_of

# Chat fields that change the rendered prompt and that CoLLM does not implement.
UNSUPPORTED_CHAT_FIELDS = ("chat_template", "chat_template_kwargs", "documents")

ModelField = Field(
    None, min_length=1, max_length=256, description="A model id as in /v1/models; absent: the base model."
)


class TokenizeRequest(OpenAIModel):
    """vLLM's `TokenizeCompletionRequest` (`prompt`) or `TokenizeChatRequest` (`messages`)."""

    model: str | None = ModelField
    prompt: str | None = Field(None, description="Text to tokenize (or send `messages`).")
    messages: list[ChatMessageIn] | None = Field(
        None, min_length=1, max_length=4096, description="Chat messages, rendered by the chat template."
    )
    add_special_tokens: Bool | None = Field(
        None, description="Add the tokenizer's special tokens (BOS); default true for prompt, false for chat."
    )
    add_generation_prompt: Bool | None = Field(
        None, description="Chat: open an assistant turn; default true unless continue_final_message."
    )
    continue_final_message: Bool = Field(False, description="Chat: leave the last message open.")
    tools: list[ToolIn] | None = Field(
        None,
        max_length=MAX_TOOLS,
        description="Chat: tools as a chat completion with `tool_choice: auto` presents them to the model.",
    )
    return_token_strs: Bool | None = Field(False, description="Also return each id's token string.")

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of prompt and messages")
        return self

    def wire(self) -> TokenizeText | TokenizeChat:
        """The replica's request; 400 naming the field for what CoLLM refuses."""
        strs = bool(self.return_token_strs)
        if self.prompt is not None:
            add = True if self.add_special_tokens is None else self.add_special_tokens
            return TokenizeText(prompt=self.prompt, add_special_tokens=add, return_token_strs=strs)
        assert self.messages is not None
        refuse_unsupported(self.model_extra or {}, UNSUPPORTED_CHAT_FIELDS)
        if self.continue_final_message and self.add_generation_prompt:
            raise bad_request(
                "continue_final_message and add_generation_prompt cannot both be true",
                "continue_final_message",
            )
        gen = (
            not self.continue_final_message
            if self.add_generation_prompt is None
            else self.add_generation_prompt
        )
        return TokenizeChat(
            messages=prompt_messages(self.messages, self.tools, tool_choice_of(self.tools, None)),
            add_generation_prompt=gen,
            continue_final_message=self.continue_final_message,
            add_special_tokens=bool(self.add_special_tokens),
            return_token_strs=strs,
        )


class DetokenizeRequest(OpenAIModel):
    """vLLM's `DetokenizeRequest`."""

    model: str | None = ModelField
    tokens: list[Int] = Field(description="Token ids to decode.")

    def wire(self) -> Detokenize:
        if any(t < 0 or t >= MAX_TOKEN_ID for t in self.tokens):
            raise bad_request("tokens must be token ids (integers in the vocabulary, from 0)", "tokens")
        return Detokenize(tokens=list(self.tokens))


class TokenizeResponse(BaseModel):
    """vLLM's `TokenizeResponse`."""

    count: int = Field(description="Number of tokens.")
    max_model_len: int = Field(description="Longest sequence (prompt plus completion) the model takes.")
    tokens: list[int]
    token_strs: list[str] | None = Field(description="Each id's token string, when asked; else null.")


class DetokenizeResponse(BaseModel):
    """vLLM's `DetokenizeResponse`."""

    prompt: str


class Tokenization:
    """Answers `/tokenize` and `/detokenize` through a replica (see the module docstring)."""

    def __init__(
        self,
        settings: GatewaySettings,
        bus: Bus,
        cluster: ClusterView,
        catalog: ModelCatalog,
        rng: random.Random | None = None,
    ) -> None:
        self.settings = settings
        self.bus = bus
        self.cluster = cluster
        self.catalog = catalog
        self.rng = rng or random.Random()

    async def tokenize(self, body: TokenizeRequest, principal: Principal) -> TokenizeResponse:
        reply = await self._ask(body.model, body.wire(), principal, TokenizeReply)
        return TokenizeResponse(
            count=len(reply.tokens),
            max_model_len=reply.max_model_len,
            tokens=reply.tokens,
            token_strs=reply.token_strs,
        )

    async def detokenize(self, body: DetokenizeRequest, principal: Principal) -> DetokenizeResponse:
        reply = await self._ask(body.model, body.wire(), principal, DetokenizeReply)
        return DetokenizeResponse(prompt=reply.prompt)

    async def _ask(self, model: str | None, msg: Any, principal: Principal, reply_type: type[Any]) -> Any:
        """`msg` answered by the best-ranked replica that answers, or APIError."""
        s = self.settings
        await self.catalog.resolve(model or s.base_model, principal, s.retry_after_s)
        if not self.bus.connected:
            raise errors.no_replica(s.retry_after_s, "NATS is unreachable")
        decision = rank_replicas(
            self.cluster.snapshots(), None, None, self.rng.random(), self.cluster.routing
        )
        if not decision.ranked:
            raise errors.no_replica(s.retry_after_s, "no replica has reported fresh telemetry")
        refusals: list[Refusal] = []
        for choice in decision.ranked[: s.max_retries + 1]:
            subject = subjects.replica(choice.replica_id, "tokenize")
            try:
                return await self.bus.request(subject, msg, reply_type, s.first_event_timeout_s)
            except PayloadTooLarge as exc:  # nothing was sent; no replica can take it
                raise errors.too_large_to_send(exc.size, exc.max_payload) from None
            except NoResponders as exc:
                refusals.append(Refusal("no_responders", errors.from_replica(503, exc.message)))
            except BusError as exc:
                err = _from_replica(exc, s.retry_after_s)
                if exc.code not in (503, 504):
                    raise err from None
                refusals.append(Refusal(f"refused_{exc.code}", err))
        raise exhausted(refusals, s.retry_after_s, s.first_event_timeout_s)


def _from_replica(exc: BusError, retry_after_s: int) -> APIError:
    """A replica's error reply as the client sees it (a 400 without a code of its own: invalid_value)."""
    err = errors.from_replica(exc.code, exc.message, exc.type, exc.param, retry_after_s)
    if err.status == 400 and err.code is None:
        err.code = "invalid_value"
    return err
