"""Structured outputs and tool calls at the HTTP edge: OpenAI's request fields (`response_format`,
`tools`, `tool_choice`, `parallel_tool_calls`, assistant `tool_calls` and `tool` turns) validated, turned
into the grammar the replica enforces (`collm_common.structured`), and the output turned back into
OpenAI's `tool_calls`.

Contract: with `response_format` `json_object` or `json_schema`, a choice that ends with `stop` is JSON
valid against the schema (`strict` or not: the schema is always enforced); with `tools` and a
`tool_choice` other than `none` (the default is `auto`), a choice that ends with `stop` and made calls has
`message.tool_calls` (ids `call_...`, arguments as JSON text valid against the tool's parameters) and
`finish_reason: "tool_calls"`; `auto` may answer in text instead. A choice cut by `max_tokens` ends
with `length`: its partial text, or, when it was calling tools, its calls so far (the last with its
arguments as far as they got, as vLLM returns it; one whose name was not reached is left out) and no
content, so the call markup never reaches the client. `response_format` together with active tools is a
400. A schema the grammar library cannot run is a 400 from the replica naming the field.
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, field_validator

from collm_common.structured import (
    ANY_JSON_OBJECT,
    Tool,
    ToolCall,
    json_schema_grammar,
    parse_cut_tool_calls,
    parse_tool_calls,
    tool_grammar,
)
from collm_common.wire.inference import OutputGrammar
from collm_gateway.errors import bad_request

FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"
MAX_TOOLS = 128


class _Strict(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)


class JsonSchemaIn(_Strict):
    name: str = Field("response", pattern=FUNCTION_NAME)
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=lambda: dict(ANY_JSON_OBJECT), alias="schema")
    strict: Annotated[bool, Strict()] | None = None


class ResponseFormatIn(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaIn | None = None


class FunctionIn(_Strict):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: Annotated[bool, Strict()] | None = None


class ToolIn(_Strict):
    type: Literal["function"]
    function: FunctionIn


class FunctionNameIn(_Strict):
    name: str = Field(pattern=FUNCTION_NAME)


class NamedToolChoiceIn(_Strict):
    type: Literal["function"]
    function: FunctionNameIn


ToolChoiceIn = Literal["none", "auto", "required"] | NamedToolChoiceIn


class FunctionCallIn(_Strict):
    name: str
    arguments: str = "{}"

    @field_validator("arguments")
    @classmethod
    def _json(cls, v: str) -> str:
        try:
            json.loads(v)
        except json.JSONDecodeError as exc:
            raise ValueError(f"arguments must be JSON text: {exc}") from None
        return v


class ToolCallIn(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


def tool_choice_of(tools: list[ToolIn] | None, choice: ToolChoiceIn | None) -> str:
    """ "none", "auto", "required", or the name of the function to call (400 for an unknown name)."""
    if not tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return "none"
    if choice is None:
        return "auto"
    if isinstance(choice, NamedToolChoiceIn):
        if choice.function.name not in {t.function.name for t in tools}:
            msg = f"tool_choice names {choice.function.name!r}, which is not in tools"
            raise bad_request(msg, "tool_choice")
        return choice.function.name
    return choice


def output_grammar(
    response_format: ResponseFormatIn | None,
    tools: list[ToolIn] | None,
    choice: str,
    parallel: bool | None,
) -> OutputGrammar | None:
    """The grammar the replica enforces for these fields, if any."""
    wants_json = response_format is not None and response_format.type != "text"
    if wants_json and choice != "none":
        raise bad_request("response_format together with tools is not supported", "response_format")
    if wants_json:
        assert response_format is not None
        if response_format.type == "json_schema":
            if response_format.json_schema is None:
                raise bad_request("response_format json_schema needs its json_schema", "response_format")
            schema = response_format.json_schema.schema_
        else:
            schema = ANY_JSON_OBJECT
        return OutputGrammar(lark=json_schema_grammar(schema), param="response_format")
    if choice == "none" or not tools:
        return None
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise bad_request("tools must have distinct function names", "tools")
    return OutputGrammar(lark=tool_grammar(wire_tools(tools), choice, parallel is not False), param="tools")


def wire_tools(tools: list[ToolIn]) -> list[Tool]:
    return [Tool(t.function.name, t.function.description or "", t.function.parameters or {}) for t in tools]


def calls_of(tool_calls: list[ToolCallIn]) -> list[ToolCall]:
    return [ToolCall(c.function.name, c.function.arguments) for c in tool_calls]


def openai_tool_calls(text: str) -> list[dict[str, Any]] | None:
    """OpenAI's `tool_calls` for an output made of calls; None for plain text."""
    calls = parse_tool_calls(text)
    return None if calls is None else _openai_calls(calls)


def openai_cut_tool_calls(text: str, choice: str) -> list[dict[str, Any]] | None:
    """OpenAI's `tool_calls` for an output of calls that `max_tokens` cut (the last with its arguments as
    far as they got, as vLLM returns it); None for plain text. `choice`: the request's tool choice (a
    function's name forces that function)."""
    named = None if choice in ("auto", "required", "none") else choice
    calls = parse_cut_tool_calls(text, named)
    return None if calls is None else _openai_calls(calls)


def _openai_calls(calls: list[ToolCall]) -> list[dict[str, Any]]:
    return [
        {
            "id": "call_" + uuid.uuid4().hex[:24],
            "type": "function",
            "function": {"name": c.name, "arguments": c.arguments},
        }
        for c in calls
    ]
