"""OpenAI request schemas at the HTTP edge (pydantic), and their translation to the wire request.

Sampling fields, as OpenAI and vLLM define them (collm_replica.sampling states each definition):
`n` (choices from one prefill, up to the gateway's `max_n`), `temperature`, `top_p`, `top_k`, `min_p`,
`presence_penalty`, `frequency_penalty`, `repetition_penalty`, `logit_bias` (at most 300 token ids,
biases in [-100, 100]), `seed` (choice i of a seeded request draws with seed + i), `stop`, `ignore_eos`,
and log
probabilities (chat: `logprobs` with `top_logprobs` 0..20; completions: `logprobs` 0..20), of the raw
model distribution. Fields whose silent omission would change the answer and that CoLLM does not
implement (`UNSUPPORTED_FIELDS`, `echo`, `best_of`, `suffix`: tools, structured outputs, beam search,
...) and non-text content parts are refused with a 400 that names the field; a field sent at its
neutral value (`null`, `[]`, `"none"`, `{"type": "text"}`) is accepted. Other unknown fields are
accepted and ignored, like vLLM (they are logged at debug level), so clients that send newer fields
keep working.
Numeric and boolean fields take only their JSON type, as OpenAI enforces them (`Int`, `Number`, `Bool`).
CoLLM's extension: `slo: {"ttft_ms", "tpot_ms"}` in the body (or the `x-collm-slo-ttft-ms` /
`x-collm-slo-tpot-ms` headers; the body wins), per-model defaults otherwise.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from collm_common.structured import render_tool_calls, tool_system_prompt
from collm_common.wire.inference import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    ChatMessage,
    OutputGrammar,
    SamplingParams,
    SloTargets,
)
from collm_gateway.errors import bad_request
from collm_gateway.settings import GatewaySettings
from collm_gateway.tools import (
    MAX_TOOLS,
    ResponseFormatIn,
    ToolCallIn,
    ToolChoiceIn,
    ToolIn,
    calls_of,
    output_grammar,
    tool_choice_of,
    wire_tools,
)

log = logging.getLogger(__name__)

MAX_STOP_SEQUENCES = 8
# Token ids travel as msgpack integers; no vocabulary comes near this bound (the replica checks the
# real vocabulary size and answers 400 with it).
MAX_TOKEN_ID = 2**31
SLO_TTFT_HEADER = "x-collm-slo-ttft-ms"
SLO_TPOT_HEADER = "x-collm-slo-tpot-ms"

# Types as OpenAI enforces them: an integer field takes only a JSON integer, a number field a JSON
# number (an integer included: `"temperature": 1`), a boolean field only true or false; a string,
# a boolean or a decimal where they do not belong is a 400 naming the field.
Int = Annotated[int, Strict()]
Number = Annotated[float, Strict()]
Bool = Annotated[bool, Strict()]
# A boolean flag that OpenAI also takes as null, meaning its default (false): `"stream": null`.
FlagOrNull = Annotated[
    bool,
    Strict(),
    BeforeValidator(lambda v: False if v is None else v),
    WithJsonSchema({"anyOf": [{"type": "boolean"}, {"type": "null"}], "default": False}),
]


def lone_surrogate_at(value: Any, path: str = "") -> str | None:
    """Where a string holds a lone UTF-16 surrogate (valid in JSON's `\\ud800`, not in UTF-8 text), or None.

    Such a string cannot be encoded for the wire (msgpack writes UTF-8): it is refused at the edge.
    """
    if isinstance(value, str):
        if value.isascii():
            return None
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "(body)"
        return None
    if isinstance(value, BaseModel):
        items: Any = value.__dict__.items()
    elif isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list | tuple):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        found = lone_surrogate_at(item, f"{path}.{key}" if path else str(key))
        if found is not None:
            return found
    return None


class EdgeModel(BaseModel):
    """Base of every HTTP request body: its text must be valid Unicode (it travels as UTF-8)."""

    @model_validator(mode="after")
    def _valid_text(self) -> EdgeModel:
        where = lone_surrogate_at(self)
        if where is not None:
            raise ValueError(f"{where} contains a lone surrogate: not valid Unicode text")
        return self


class OpenAIModel(EdgeModel):
    """Base of request bodies: unknown fields allowed (ignored), known ones validated."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    @model_validator(mode="after")
    def _log_ignored(self) -> OpenAIModel:
        if self.model_extra:
            log.debug("ignoring unsupported fields %s", sorted(self.model_extra))
        return self

    @property
    def ignored_fields(self) -> list[str]:
        return sorted(self.model_extra or {})


class StreamOptions(OpenAIModel):
    include_usage: FlagOrNull = False


class SloIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    ttft_ms: Number | None = Field(None, gt=0, le=3_600_000)
    tpot_ms: Number | None = Field(None, gt=0, le=3_600_000)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ChatMessageIn(OpenAIModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: the call it answers

    def text(self, index: int) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        pieces = []
        for j, part in enumerate(self.content):
            if part.type == "text" and part.text is None:
                raise bad_request(
                    "a content part of type 'text' needs its 'text'",
                    param=f"messages.{index}.content.{j}.text",
                )
            if part.type != "text" or part.text is None:
                raise bad_request(
                    f"content part of type {part.type!r} is not supported (text only)",
                    param=f"messages.{index}.content.{j}",
                    code="unsupported_value",
                )
            pieces.append(part.text)
        return "".join(pieces)


# Fields that would change the answer and that CoLLM does not implement: refused with a 400 naming them
# unless sent at a neutral value (below). Other unknown fields are ignored.
UNSUPPORTED_FIELDS = (
    "tools",  # chat completions declare these four (collm_gateway.tools); completions refuse them
    "tool_choice",
    "parallel_tool_calls",
    "response_format",
    "functions",
    "function_call",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
    "prediction",
    "audio",
    "modalities",
    "use_beam_search",
    "length_penalty",
    "min_tokens",
    "stop_token_ids",
    "bad_words",
    "allowed_token_ids",
    "prompt_logprobs",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "echo_prompt",
    "logits_processors",
)


def refuse_unsupported(extra: Mapping[str, Any], names: tuple[str, ...]) -> None:
    """400 naming the first of `names` sent in `extra` at a value that is not neutral (`_neutral`)."""
    for name in names:
        if name in extra and not _neutral(name, extra[name]):
            raise bad_request(f"{name} is not supported by CoLLM", name, "unsupported_value")


def _neutral(name: str, value: Any) -> bool:
    """A value of an unsupported field that asks for nothing (the default behaviour)."""
    if value is None or value == [] or value == {}:
        return True
    if name in ("tool_choice", "function_call"):
        return value == "none"
    if name == "response_format":
        return isinstance(value, dict) and value.get("type") == "text"
    if name == "modalities":
        return value == ["text"]
    if name == "parallel_tool_calls":  # without tools it changes nothing
        return isinstance(value, bool)
    if name == "skip_special_tokens":  # CoLLM's text never holds special tokens
        return value is True
    if name in ("use_beam_search", "include_stop_str_in_output", "echo_prompt"):
        return value is False
    if name == "min_tokens":
        return value == 0
    if name == "length_penalty":
        return value == 1 or value == 1.0
    return False


def logit_bias_pairs(bias: dict[str, float] | None) -> list[tuple[int, float]]:
    """OpenAI's `logit_bias` (token id as a string -> bias) as (id, bias) pairs; 400 naming the field."""
    pairs: list[tuple[int, float]] = []
    for key, value in (bias or {}).items():
        if not key.isdigit() or int(key) >= MAX_TOKEN_ID:
            raise bad_request(f"logit_bias keys must be token ids (got {key!r})", "logit_bias")
        pairs.append((int(key), value))
    return pairs


class SamplingIn(OpenAIModel):
    """Fields shared by chat and text completions."""

    model: str = Field(min_length=1, max_length=256)
    max_tokens: Int | None = Field(None, ge=1)
    temperature: Number | None = Field(None, ge=0.0, le=2.0)
    top_p: Number | None = Field(None, gt=0.0, le=1.0)
    top_k: Int | None = Field(None, ge=-1)
    min_p: Number | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: Number | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: Number | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: Number | None = Field(None, gt=0.0, le=100.0)
    logit_bias: dict[str, Annotated[float, Strict(), Field(ge=-100.0, le=100.0)]] | None = Field(
        None, max_length=MAX_LOGIT_BIAS
    )
    seed: Int | None = Field(None, ge=-(2**63), lt=2**63)
    stop: str | list[str] | None = None
    n: Int | None = Field(None, ge=1)
    stream: FlagOrNull = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=256)
    ignore_eos: FlagOrNull = False  # vLLM's extension, useful for fixed-length benchmarks
    slo: SloIn | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str] | None:
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else v
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are supported")
        if any(not s for s in stops):
            raise ValueError("stop sequences must not be empty")
        return stops

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def wire_logprobs(self) -> int | None:
        """How many top logprobs per position the replica returns (None: no logprobs)."""
        return None

    def check_supported(self) -> None:
        refuse_unsupported(self.model_extra or {}, UNSUPPORTED_FIELDS)
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed with stream=true", "stream_options")

    def sampling(self, settings: GatewaySettings) -> SamplingParams:
        max_tokens = self.requested_max_tokens()
        if max_tokens is not None and max_tokens > settings.max_tokens_limit:
            raise bad_request(
                f"max_tokens={max_tokens} exceeds this gateway's limit of {settings.max_tokens_limit}",
                "max_tokens",
            )
        if self.n is not None and self.n > settings.max_n:
            raise bad_request(f"n={self.n} exceeds this gateway's limit of {settings.max_n} choices", "n")
        params: dict[str, Any] = {
            "max_tokens": max_tokens or settings.default_max_tokens,
            "n": self.n or 1,
            "stop": list(self.stop or []),
            "seed": self.seed,
            "ignore_eos": self.ignore_eos,
        }
        for name in (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ):
            value = getattr(self, name)
            if value is not None:
                params[name] = value
        params["logit_bias"] = logit_bias_pairs(self.logit_bias)
        params["logprobs"] = self.wire_logprobs()
        return SamplingParams(**params)

    def slo_targets(
        self, headers: Mapping[str, str], default_ttft_ms: float | None, default_tpot_ms: float | None
    ) -> SloTargets:
        """Body `slo` over headers over the model's defaults."""
        ttft = _header_ms(headers, SLO_TTFT_HEADER)
        tpot = _header_ms(headers, SLO_TPOT_HEADER)
        if self.slo is not None:
            ttft = self.slo.ttft_ms if self.slo.ttft_ms is not None else ttft
            tpot = self.slo.tpot_ms if self.slo.tpot_ms is not None else tpot
        return SloTargets(
            ttft_ms=ttft if ttft is not None else default_ttft_ms,
            tpot_ms=tpot if tpot is not None else default_tpot_ms,
        )


def _header_ms(headers: Mapping[str, str], name: str) -> float | None:
    raw = headers.get(name)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not (0 < value <= 3_600_000):
        raise bad_request(f"header {name} must be a positive number of milliseconds (got {raw!r})", name)
    return value


class ChatCompletionRequest(SamplingIn):
    messages: list[ChatMessageIn] = Field(min_length=1, max_length=4096)
    max_completion_tokens: Int | None = Field(None, ge=1)
    logprobs: Bool | None = None
    top_logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: ResponseFormatIn | None = None
    tools: list[ToolIn] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoiceIn | None = None
    parallel_tool_calls: Bool | None = None

    @property
    def tool_choice_name(self) -> str:
        """ "none", "auto", "required" or the function to call (collm_gateway.tools)."""
        return tool_choice_of(self.tools, self.tool_choice)

    def grammar(self) -> OutputGrammar | None:
        choice = self.tool_choice_name
        return output_grammar(self.response_format, self.tools, choice, self.parallel_tool_calls)

    def requested_max_tokens(self) -> int | None:
        # `max_completion_tokens` is OpenAI's newer name; it wins when both are present.
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def wire_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
        self.grammar()  # 400s for inconsistent tool and format fields, before any replica is asked

    def wire_messages(self) -> list[ChatMessage]:
        """The conversation as the replica templates it, active tools as a first system message."""
        return prompt_messages(self.messages, self.tools, self.tool_choice_name)


def prompt_messages(
    messages: list[ChatMessageIn], tools: list[ToolIn] | None, choice: str
) -> list[ChatMessage]:
    """Chat messages as the replica templates them (`wire_messages`), with the tools a `choice` other than
    "none" makes active as a first system message (`tool_system_prompt`)."""
    if choice == "none" or not tools:
        return wire_messages(messages)
    prompt = tool_system_prompt(wire_tools(tools), choice)
    return [ChatMessage(role="system", content=prompt), *wire_messages(messages)]


def wire_messages(messages: list[ChatMessageIn]) -> list[ChatMessage]:
    """Chat messages as the replica takes them: text content (400 naming a part that is not text), and
    assistant turns that called tools with their calls in the text format the model writes."""
    out = []
    for i, m in enumerate(messages):
        text = m.text(i)
        if m.role == "assistant" and m.tool_calls:
            text += render_tool_calls(calls_of(m.tool_calls))
        out.append(ChatMessage(role=m.role, content=text))
    return out


class CompletionRequest(SamplingIn):
    prompt: str | list[str] | list[Int] | list[list[Int]]
    echo: FlagOrNull = False
    logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: Int | None = None
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise bad_request("echo=true is not supported", "echo", "unsupported_value")
        if self.best_of not in (None, 1):
            raise bad_request("best_of > 1 is not supported", "best_of", "unsupported_value")
        if self.suffix:
            raise bad_request("suffix is not supported", "suffix", "unsupported_value")

    def wire_logprobs(self) -> int | None:
        return self.logprobs

    def split_prompts(self, max_prompts: int) -> list[CompletionRequest]:
        """One request per prompt of a list of prompts (strings or token-id lists; at most
        `max_prompts`), else `[self]`; a request with prompt lists streams nothing (400)."""
        p = self.prompt
        if isinstance(p, str) or len(p) <= 1 or all(isinstance(x, int) for x in p):
            return [self]
        if len(p) > max_prompts:
            raise bad_request(
                f"{len(p)} prompts exceed this gateway's limit of {max_prompts} per request", "prompt"
            )
        if self.stream:
            raise bad_request(
                "stream=true takes one prompt per request (a list of prompts is answered unstreamed)",
                "stream",
                "unsupported_value",
            )
        return [self.model_copy(update={"prompt": [x]}) for x in p]

    def wire_prompt(self) -> tuple[str | None, list[int] | None]:
        """(prompt text, prompt token ids): exactly one is set."""
        p = self.prompt
        if isinstance(p, str):
            return p, None
        if not p:
            raise bad_request("prompt must not be empty", "prompt")
        if len(p) != 1 and not all(isinstance(x, int) for x in p):
            raise bad_request(f"a list of {len(p)} prompts is served by split_prompts, one by one", "prompt")
        first = p[0]
        if isinstance(first, str):
            return first, None
        ids = [int(x) for x in p] if isinstance(first, int) else list(first)  # type: ignore[arg-type]
        if not ids:
            raise bad_request("prompt must not be empty", "prompt")
        if any(t < 0 for t in ids):
            raise bad_request("prompt token ids must be non-negative", "prompt")
        if any(t >= MAX_TOKEN_ID for t in ids):
            raise bad_request(f"prompt token ids must be below {MAX_TOKEN_ID}", "prompt")
        return None, ids
