"""Structured-output and tool fields at the edge: validation, the grammar sent to the replica, the prompt
the model sees, and calls parsed back into OpenAI's shape."""

from __future__ import annotations

import json

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from pydantic import ValidationError

from collm_common.structured import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    ToolCall,
    parse_cut_tool_calls,
    parse_tool_calls,
    render_tool_calls,
)
from collm_gateway.errors import APIError, from_validation
from collm_gateway.protocol import ChatCompletionRequest
from collm_gateway.shapes import ChatShape, Choice, StreamIdentity
from collm_gateway.tools import openai_tool_calls

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}


def chat(**kw: object) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}
    )


def test_json_schema_and_json_object_become_grammars() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    g = chat(
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": schema, "strict": True},
        }
    ).grammar()
    assert g is not None and g.param == "response_format" and g.lark.startswith("start: %json {")
    assert json.loads(g.lark.split("%json", 1)[1])["properties"] == schema["properties"]
    obj = chat(response_format={"type": "json_object"}).grammar()
    assert obj is not None and '"type":"object"' in obj.lark
    assert chat(response_format={"type": "text"}).grammar() is None


@pytest.mark.parametrize(
    ("choice", "want"),
    [
        (None, "auto"),
        ("auto", "auto"),
        ("required", "required"),
        ("none", "none"),
        ({"type": "function", "function": {"name": "add"}}, "add"),
    ],
)
def test_tool_choice_and_its_grammar(choice: object, want: str) -> None:
    req = chat(tools=[WEATHER, ADD], **({} if choice is None else {"tool_choice": choice}))
    req.check_supported()
    assert req.tool_choice_name == want
    g = req.grammar()
    if want == "none":
        assert g is None
        assert [m.role for m in req.wire_messages()] == ["user"]
        return
    assert g is not None and g.param == "tools"
    assert ("TEXT" in g.lark) == (want == "auto")
    assert ('"const":"get_weather"' in g.lark) == (want != "add")
    first = req.wire_messages()[0]
    assert first.role == "system" and "get_weather" in first.content and TOOL_CALL_OPEN in first.content


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
    ],
)
def test_inconsistent_fields_are_400(fields: dict[str, object], param: str) -> None:
    with pytest.raises(APIError) as err:
        chat(**fields).check_supported()
    assert err.value.status == 400 and err.value.param == param


def test_multi_turn_calls_and_results_reach_the_prompt() -> None:
    req = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "tools": [WEATHER],
            "messages": [
                {"role": "user", "content": "weather in Paris?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
            ],
        }
    )
    msgs = req.wire_messages()
    assert [m.role for m in msgs] == ["system", "user", "assistant", "tool"]
    assert parse_tool_calls(msgs[2].content) == [ToolCall("get_weather", '{"city": "Paris"}')]
    assert msgs[3].content == "sunny, 21 C"


def test_tool_call_text_round_trip_and_plain_text() -> None:
    calls = [ToolCall("add", '{"a": 1, "b": 2}'), ToolCall("get_weather", '{"city": "Oslo"}')]
    assert parse_tool_calls(render_tool_calls(calls)) == calls
    assert parse_tool_calls("It is sunny.") is None
    assert parse_tool_calls(f"{TOOL_CALL_OPEN}{{not json}}{TOOL_CALL_CLOSE}") is None
    assert parse_tool_calls(f"{render_tool_calls(calls[:1])} and more text") is None


def test_tool_calls_in_openai_shapes() -> None:
    ident = StreamIdentity(id="chatcmpl-1", created=1, model="m", system_fingerprint="r0/base")
    calls = openai_tool_calls(render_tool_calls([ToolCall("add", '{"a": 1}')]))
    assert calls is not None and calls[0]["id"].startswith("call_")
    body = ChatShape().complete(ident, [Choice(0, "", "tool_calls", None, calls)], 3, 4)
    parsed = ChatCompletion.model_validate(body)
    msg = parsed.choices[0].message
    assert parsed.choices[0].finish_reason == "tool_calls" and msg.content is None
    assert msg.tool_calls is not None and msg.tool_calls[0].function.name == "add"  # type: ignore[union-attr]
    assert json.loads(msg.tool_calls[0].function.arguments) == {"a": 1}  # type: ignore[union-attr]
    delta = ChatCompletionChunk.model_validate(ChatShape().tool_calls_delta(ident, calls, 0))
    assert delta.choices[0].delta.tool_calls is not None and delta.choices[0].delta.tool_calls[0].index == 0


def test_an_earlier_call_with_arguments_that_are_not_json_is_400() -> None:
    body = {
        "model": "m",
        "messages": [
            {"role": "user", "content": "x"},
            {
                "role": "assistant",
                "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{oops"}}],
            },
        ],
    }
    with pytest.raises(ValidationError) as err:
        ChatCompletionRequest.model_validate(body)
    api = from_validation(err.value.errors())
    assert api.status == 400 and api.param is not None and api.param.startswith("messages.1.tool_calls.0")


@pytest.mark.parametrize(
    ("text", "named", "want"),
    [
        ("plain text", None, None),
        ('<tool_call>{"name":"', None, []),
        ('<tool_call>{"name":"', "add", [("add", "")]),
        ("<tool_c", "add", [("add", "")]),
        ('<tool_call>{"name":"add","arguments":{"a":', None, [("add", '{"a":')]),
        (
            '<tool_call>{"name":"add","arguments":{"a":1}}</tool_call><tool_call>{"name":"mul","argu',
            None,
            [("add", '{"a": 1}'), ("mul", "")],
        ),
        ('<tool_call>{"name":"add","arguments":{"a":1}}</to', None, [("add", '{"a": 1}')]),
    ],
)
def test_calls_cut_by_max_tokens(text: str, named: str | None, want: list[tuple[str, str]] | None) -> None:
    got = parse_cut_tool_calls(text, named)
    assert (None if got is None else [(c.name, c.arguments) for c in got]) == want
