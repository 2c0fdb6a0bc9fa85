"""Tool calls at the gateway, with a scripted replica double: text under `tool_choice: "auto"` streams
as it comes, a call goes out as its tool-call delta, and a call cut by `max_tokens` returns the calls so
far (never the call markup), streamed or not."""

from __future__ import annotations

import json
from typing import Any

import pytest
from doubles.replica import ReplicaBehaviour

from .conftest import BASE_MODEL

pytestmark = pytest.mark.integration

MSGS = [{"role": "user", "content": "add one"}]
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    },
}


async def chat_stream(gw: Any, **kw: Any) -> list[Any]:
    stream = await gw.openai.chat.completions.create(
        model=BASE_MODEL, messages=MSGS, tools=[ADD], stream=True, **kw
    )
    return [c async for c in stream]


def contents(chunks: list[Any]) -> list[str]:
    return [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]


def calls(chunks: list[Any]) -> list[Any]:
    return [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]


def finishes(chunks: list[Any]) -> list[str]:
    return [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]


async def test_text_under_auto_streams_as_it_comes(make_gateway, replicas) -> None:
    async with make_gateway() as gw:
        await replicas("r0", ReplicaBehaviour(tokens=[" ", "It", " is", " sunny", "."]))
        await gw.wait_replicas("r0")
        chunks = await chat_stream(gw)
        # The leading space is held until the output commits to text ("It"), then every token is a delta.
        assert contents(chunks) == [" It", " is", " sunny", "."]
        assert calls(chunks) == [] and finishes(chunks) == ["stop"]


async def test_a_call_under_auto_is_one_tool_call_delta(make_gateway, replicas) -> None:
    tokens = ["<tool_call>", '{"name":"add",', '"arguments":{"a":1}}', "</tool_call>"]
    async with make_gateway() as gw:
        await replicas("r0", ReplicaBehaviour(tokens=tokens))
        await gw.wait_replicas("r0")
        chunks = await chat_stream(gw)
        assert contents(chunks) == []
        got = calls(chunks)
        assert [(c.function.name, json.loads(c.function.arguments)) for c in got] == [("add", {"a": 1})]
        assert finishes(chunks) == ["tool_calls"]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "add"}}])
async def test_a_call_cut_by_max_tokens_returns_the_call_so_far(make_gateway, replicas, tool_choice) -> None:
    tokens = ["<tool_call>", '{"name":"add",', '"arguments":{"a":', "1}}", "</tool_call>"]
    async with make_gateway() as gw:
        await replicas("r0", ReplicaBehaviour(tokens=tokens))
        await gw.wait_replicas("r0")
        whole = await gw.openai.chat.completions.create(
            model=BASE_MODEL, messages=MSGS, tools=[ADD], tool_choice=tool_choice, max_tokens=3
        )
        choice = whole.choices[0]
        assert choice.finish_reason == "length" and choice.message.content is None
        assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []] == [
            ("add", '{"a":')
        ]
        chunks = await chat_stream(gw, tool_choice=tool_choice, max_tokens=3)
        assert contents(chunks) == [] and finishes(chunks) == ["length"]
        assert [(c.function.name, c.function.arguments) for c in calls(chunks)] == [("add", '{"a":')]


async def test_a_call_cut_before_its_name_sends_no_markup(make_gateway, replicas) -> None:
    async with make_gateway() as gw:
        await replicas("r0", ReplicaBehaviour(tokens=["<tool", "_call>", '{"na', 'me":"add"}']))
        await gw.wait_replicas("r0")
        whole = await gw.openai.chat.completions.create(
            model=BASE_MODEL, messages=MSGS, tools=[ADD], tool_choice="required", max_tokens=3
        )
        choice = whole.choices[0]
        assert choice.finish_reason == "length" and not choice.message.content
        assert not choice.message.tool_calls
        chunks = await chat_stream(gw, tool_choice="required", max_tokens=3)
        assert contents(chunks) == [] and calls(chunks) == [] and finishes(chunks) == ["length"]
