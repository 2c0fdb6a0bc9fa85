"""The request path: gateway -> replica `generate`, and the streamed events back.

Protocol. The gateway subscribes to a fresh inbox, then publishes a `GenerateRequest` to
`subjects.replica(id, "generate")` with that inbox as the reply subject and W3C trace context in the
headers. The replica answers on the inbox with a sequence of `GenerateEvent`s: exactly one `Accepted`
or `GenerateError` first, then `TokenChunk`s numbered from 0 without gaps, then one `Finished` (or a
`GenerateError` if generation fails midway). A gap in `seq` means a lost chunk and the gateway fails
the stream with a clear error rather than return text with a hole. A request for `n` choices gets one
numbering of chunks for all of them (each chunk names its choice in `index`) and a single `Finished`
once every choice has ended, with each choice's end in `Finished.choices`. `CancelRequest` on
`subjects.replica(id, "cancel")` stops a generation (client disconnect).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, TypeAdapter, field_validator

from collm_common.wire.base import WireModel


class ChatMessage(WireModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


MAX_LOGPROBS = 20  # most likely tokens a request may ask for per position (vLLM's default max_logprobs)
MAX_LOGIT_BIAS = 300  # entries of logit_bias (OpenAI's limit)
MAX_CHOICES = 16  # most choices (`n`) one request may ask for on the wire; the gateway's limit is lower


class SamplingParams(WireModel):
    """How the replica picks tokens; definitions in collm_replica.sampling (OpenAI's and vLLM's)."""

    max_tokens: int = Field(16, ge=1)
    # Choices generated from one prefill of the prompt (each with its own sampling state).
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)  # 0 or -1: off
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=100.0)
    # (token id, bias) pairs; the replica refuses ids outside its vocabulary.
    logit_bias: list[tuple[int, float]] = Field(default_factory=list, max_length=MAX_LOGIT_BIAS)
    # None: no logprobs; k >= 0: the chosen token's logprob and the k most likely tokens' at each position.
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    seed: int | None = None
    stop: list[str] = Field(default_factory=list, max_length=8)
    ignore_eos: bool = False

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, v: list[tuple[int, float]]) -> list[tuple[int, float]]:
        for token_id, bias in v:
            if token_id < 0 or not -100.0 <= bias <= 100.0:
                raise ValueError("logit_bias pairs need a token id >= 0 and a bias in [-100, 100]")
        return v


class OutputGrammar(WireModel):
    """A grammar every output must follow (llguidance's Lark dialect; `collm_common.structured` builds it
    from `response_format` or `tools`); `param` names the request field it came from, for errors."""

    lark: str = Field(min_length=1)
    param: str = "response_format"


class SloTargets(WireModel):
    """Per-request latency targets; the gateway fills per-model defaults when the client sends none."""

    ttft_ms: float | None = Field(None, gt=0)
    tpot_ms: float | None = Field(None, gt=0)


class GenerateRequest(WireModel):
    request_id: str = Field(min_length=1, max_length=128)
    # Exactly one of prompt / messages / prompt_token_ids is set; the replica tokenizes.
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    prompt_token_ids: list[int] | None = None
    # Adapter addressed by name; `adapter_version` pins `name@vN`, None means the current version.
    adapter: str | None = None
    adapter_version: int | None = Field(None, ge=1)
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    grammar: OutputGrammar | None = None
    slo: SloTargets = Field(default_factory=SloTargets)
    tenant: str | None = None
    arrival_unix_s: float = 0.0
    # The replica drops the request if it has not started by then (the gateway already gave up).
    deadline_unix_s: float | None = None
    # How long the replica may wait to batch a first token (0 = no pacing); reserved.
    priority: int = 0


class Accepted(WireModel):
    kind: Literal["accepted"] = "accepted"
    request_id: str
    replica_id: str
    # Exact version that will serve every token of this request, e.g. "medical@v3" or "base".
    adapter_version_id: str
    prompt_tokens: int
    queue_position: int = 0


class TopLogprob(WireModel):
    token_id: int
    token: str  # the token decoded on its own (a partial UTF-8 character decodes as U+FFFD)
    logprob: float
    # Additive (v1): the token's raw bytes (a partial UTF-8 character's own bytes); None: unknown.
    token_bytes: bytes | None = None


class TokenLogprob(WireModel):
    """Log-probabilities at one generated position, from the raw model distribution."""

    token_id: int
    token: str
    logprob: float
    top: list[TopLogprob] = Field(default_factory=list)
    # Additive (v1): the token's raw bytes (a partial UTF-8 character's own bytes); None: unknown.
    token_bytes: bytes | None = None


class TokenChunk(WireModel):
    kind: Literal["token"] = "token"
    request_id: str
    seq: int
    token_ids: list[int]
    text: str
    # One entry per token in `token_ids` when the request asked for logprobs.
    logprobs: list[TokenLogprob] | None = None
    index: int = 0  # the choice these tokens belong to (0..n-1)


class ChoiceFinish(WireModel):
    index: int
    finish_reason: Literal["stop", "length", "cancelled", "deadline"]
    completion_tokens: int


class Finished(WireModel):
    kind: Literal["finished"] = "finished"
    request_id: str
    seq: int
    finish_reason: Literal["stop", "length", "cancelled", "deadline"]
    prompt_tokens: int
    completion_tokens: int
    adapter_version_id: str
    replica_id: str
    queue_ms: float = 0.0
    ttft_ms: float = 0.0
    tpot_ms: float = 0.0
    e2e_ms: float = 0.0
    # n > 1: how each choice ended (finish_reason above is choice 0's, completion_tokens the sum, the
    # timings choice 0's); None for a single choice.
    choices: list[ChoiceFinish] | None = None


# `GenerateError.error_code` of a request whose prompt plus max_tokens does not fit the model's context.
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


class GenerateError(WireModel):
    kind: Literal["error"] = "error"
    request_id: str
    # HTTP-like status: 400 bad input, 404 unknown adapter, 429 queue full, 503 unavailable, 500 internal.
    code: int
    type: str = "server_error"
    message: str
    param: str | None = None
    # The OpenAI error code the gateway sends (e.g. "context_length_exceeded"), when one says more than
    # the status.
    error_code: str | None = None


GenerateEvent = Annotated[Accepted | TokenChunk | Finished | GenerateError, Field(discriminator="kind")]
GENERATE_EVENT = TypeAdapter(GenerateEvent)
GENERATE_EVENT.schema_name = "collm.v1.GenerateEvent"  # type: ignore[attr-defined]


class CancelRequest(WireModel):
    request_id: str
    reason: str = "client_disconnected"
