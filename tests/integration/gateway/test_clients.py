"""The client libraries users run, against the gateway and a real replica process (tiny model).

LangChain (`langchain-openai`), litellm and the OpenAI Agents SDK, pinned as test dependencies beside
the openai package the other tests use, each through its own HTTP client on a real socket: chat, streams,
structured outputs, tools (streamed and not), a legacy batch of prompts, and the context-overflow error
each library turns into its own exception type. (instructor is not here: no release of it accepts the
openai package these tests pin.)
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
from pydantic import BaseModel, Field

from .conftest import BASE_MODEL, Gateway, eventually
from .test_real_replica import REPLICA_MAIN, replica_process

# litellm reads its model price map from the network at import unless told to use its bundled copy.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not REPLICA_MAIN.exists(), reason="the replica service is not built yet"),
]

LONG = "hello " * 1000  # well over the tiny model's 512-token context


class Digit(BaseModel):
    ok: bool
    n: int = Field(ge=0, le=9)


@contextlib.asynccontextmanager
async def served(
    make_served_gateway: Any, nats_server: Any, redis_server: Any, redis_prefix: str, tmp_path: Any
) -> AsyncIterator[Gateway]:
    with replica_process(nats_server, redis_server, redis_prefix, tmp_path, "c0") as log_path:
        async with make_served_gateway(first_event_timeout_s=10.0) as gw:
            try:
                await eventually(lambda: "c0" in gw.state.cluster.fresh_replicas(), timeout_s=120, what="c0")
            except AssertionError:
                pytest.fail("replica never reported telemetry:\n" + log_path.read_text()[-3000:])
            yield gw


@pytest.fixture
async def gw(
    make_served_gateway, nats_server, redis_server, redis_prefix, tmp_path
) -> AsyncIterator[Gateway]:
    async with served(make_served_gateway, nats_server, redis_server, redis_prefix, tmp_path) as g:
        yield g


async def test_langchain(gw: Gateway) -> None:
    from langchain_core.exceptions import ContextOverflowError
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI, OpenAI

    chat = ChatOpenAI(
        model=BASE_MODEL, base_url=f"{gw.base_url}/v1", api_key="x", max_tokens=6, temperature=0
    )
    answer = await chat.ainvoke("hello")
    assert isinstance(answer.content, str) and answer.response_metadata["finish_reason"] in ("stop", "length")
    chunks = [c async for c in chat.astream("hello")]
    assert "".join(str(c.content) for c in chunks) == answer.content
    roomy = ChatOpenAI(
        model=BASE_MODEL, base_url=f"{gw.base_url}/v1", api_key="x", max_tokens=120, temperature=0
    )
    for method in ("json_schema", "function_calling"):
        structured = roomy.with_structured_output(Digit, method=method)
        got = await structured.ainvoke("a digit")
        assert isinstance(got, Digit), method

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    tools = roomy.bind_tools([add], tool_choice="add")
    message: Any = None
    async for chunk in tools.astream("add two numbers"):
        message = chunk if message is None else message + chunk
    assert [c["name"] for c in message.tool_calls] == ["add"]
    assert set(message.tool_calls[0]["args"]) <= {"a", "b"}
    # The legacy completions client sends its batch as one request with a list of prompts.
    legacy = OpenAI(model=BASE_MODEL, base_url=f"{gw.base_url}/v1", api_key="x", max_tokens=3, temperature=0)
    texts = await legacy.abatch(["hello", "good morning"])
    assert len(texts) == 2 and all(isinstance(t, str) for t in texts)
    # OpenAI's code reaches LangChain's error. (langchain-openai 1.8 raises its ContextOverflowError when
    # str(error) holds "context_length_exceeded"; the openai 3.x package pinned here writes only the
    # message there, so it raises its BadRequestError subclass.)
    with pytest.raises(openai.BadRequestError) as overflow:
        await chat.ainvoke(LONG)
    assert overflow.value.code == "context_length_exceeded"
    assert isinstance(overflow.value, ContextOverflowError) == (
        "context_length_exceeded" in str(overflow.value)
    )


async def test_litellm(gw: Gateway) -> None:
    import litellm

    common: dict[str, Any] = {
        "model": f"openai/{BASE_MODEL}",
        "api_base": f"{gw.base_url}/v1",
        "api_key": "x",
    }
    reply = await litellm.acompletion(messages=[{"role": "user", "content": "hello"}], max_tokens=4, **common)
    assert reply.choices[0].finish_reason in ("stop", "length") and reply.usage.completion_tokens >= 1
    tool = {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
                "required": ["a"],
                "additionalProperties": False,
            },
        },
    }
    called = await litellm.acompletion(
        messages=[{"role": "user", "content": "add"}],
        tools=[tool],
        tool_choice="required",
        max_tokens=120,
        **common,
    )
    calls = called.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "add" and called.choices[0].finish_reason == "tool_calls"
    with pytest.raises(litellm.ContextWindowExceededError):
        await litellm.acompletion(messages=[{"role": "user", "content": LONG}], max_tokens=5, **common)


async def test_openai_agents_runs_a_function_tool(gw: Gateway) -> None:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    seen: list[int] = []

    @function_tool
    def next_digit(a: int) -> int:
        """The digit after a."""
        seen.append(a)
        return a + 1

    client = AsyncOpenAI(base_url=f"{gw.base_url}/v1", api_key="x", max_retries=0)
    agent = Agent(
        name="counter",
        instructions="Use the tool.",
        tools=[next_digit],
        model=OpenAIChatCompletionsModel(model=BASE_MODEL, openai_client=client),
        model_settings=ModelSettings(tool_choice="required", max_tokens=120, temperature=0),
        tool_use_behavior="stop_on_first_tool",
    )
    result = await Runner.run(agent, "count", max_turns=2)
    assert len(seen) == 1 and result.final_output == str(seen[0] + 1)  # the tool output, as text
