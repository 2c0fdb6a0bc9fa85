"""Gateway -> NATS -> a real `python -m collm_replica` process (tiny model), through the openai client."""

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from .conftest import BASE_MODEL, eventually

pytestmark = pytest.mark.integration

REPLICA_MAIN = Path(__file__).resolve().parents[3] / "services" / "replica" / "collm_replica" / "__main__.py"


@contextlib.contextmanager
def replica_process(
    nats_server, redis_server, redis_prefix, tmp_path: Path, replica_id: str
) -> Iterator[Path]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLLM_")}
    env.update(
        {
            "COLLM_NATS_URL": nats_server.url,
            "COLLM_REDIS_URL": redis_server.url,
            "COLLM_REDIS_PREFIX": redis_prefix,
            "COLLM_REPLICA_ID": replica_id,
            "COLLM_MODEL": "tiny",
            "COLLM_TORCH_THREADS": "1",
            "COLLM_TELEMETRY_INTERVAL_S": "0.5",
            "COLLM_LOG_JSON": "false",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "OMP_NUM_THREADS": "1",
            "OTEL_SDK_DISABLED": "true",
        }
    )
    log_path = tmp_path / f"replica-{replica_id}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "collm_replica"], env=env, stdout=log, stderr=subprocess.STDOUT
        )
    try:
        yield log_path
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.skipif(not REPLICA_MAIN.exists(), reason="the replica service is not built yet")
async def test_stream_through_a_real_replica_on_the_tiny_model(
    make_gateway, nats_server, redis_server, redis_prefix, tmp_path
) -> None:
    with replica_process(nats_server, redis_server, redis_prefix, tmp_path, "real0") as log_path:
        async with make_gateway(first_event_timeout_s=10.0) as gw:
            try:
                await eventually(
                    lambda: "real0" in gw.state.cluster.fresh_replicas(), timeout_s=120, what="replica"
                )
            except AssertionError:
                pytest.fail("replica never reported telemetry:\n" + log_path.read_text()[-3000:])
            stream = await gw.openai.chat.completions.create(
                model=BASE_MODEL,
                messages=[{"role": "user", "content": "hello"}],
                max_tokens=6,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = [c async for c in stream]
            assert chunks[0].choices[0].delta.role == "assistant"
            usage = chunks[-1].usage
            assert usage is not None and 1 <= usage.completion_tokens <= 6 and usage.prompt_tokens > 0
            finishes = [
                c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
            ]
            assert finishes in (["stop"], ["length"])
            assert {c.system_fingerprint for c in chunks} == {"real0/base"}
            # non-streaming, pinned to greedy: the same prompt gives the same text twice
            a = await gw.openai.chat.completions.create(
                model=BASE_MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=6, temperature=0
            )
            b = await gw.openai.chat.completions.create(
                model=BASE_MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=6, temperature=0
            )
            assert a.choices[0].message.content == b.choices[0].message.content
            assert a.usage.completion_tokens == usage.completion_tokens
            # Sampling parity: logprobs (chat and completions, streamed and not), penalties and bias.
            lp = await gw.openai.chat.completions.create(
                model=BASE_MODEL,
                messages=[{"role": "user", "content": "hello"}],
                max_tokens=6,
                temperature=0,
                logprobs=True,
                top_logprobs=3,
            )
            content = lp.choices[0].logprobs.content  # type: ignore[union-attr]
            assert content is not None and len(content) == lp.usage.completion_tokens  # type: ignore[union-attr]
            assert all(len(c.top_logprobs) == 3 and c.logprob <= 0 for c in content)
            # Raw bytes: a whole character's token is its UTF-8, a byte of one is that byte alone.
            assert all(
                c.bytes == list(c.token.encode()) or (c.token == "\ufffd" and c.bytes and len(c.bytes) < 3)
                for c in content
            )
            streamed = await gw.openai.completions.create(
                model=BASE_MODEL, prompt="hello", max_tokens=5, temperature=0, logprobs=2, stream=True
            )
            legacy = [c.choices[0].logprobs async for c in streamed if c.choices and c.choices[0].logprobs]
            tokens = [t for lp_chunk in legacy for t in lp_chunk.tokens or []]
            offsets = [o for lp_chunk in legacy for o in lp_chunk.text_offset or []]
            assert 1 <= len(tokens) <= 5 and offsets[0] == 0 and offsets == sorted(offsets)
            # +100 on one token id: every generated token is that token, whatever the other fields.
            biased = await gw.openai.chat.completions.create(
                model=BASE_MODEL,
                messages=[{"role": "user", "content": "hello"}],
                max_tokens=4,
                temperature=1.0,
                logprobs=True,
                frequency_penalty=1.0,
                logit_bias={"5": 100},
                extra_body={"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2, "ignore_eos": True},
            )
            got = biased.choices[0].logprobs.content  # type: ignore[union-attr]
            assert got is not None and len(got) == 4 and len({c.token for c in got}) == 1
            with pytest.raises(openai.BadRequestError) as err:
                await gw.openai.chat.completions.create(
                    model=BASE_MODEL,
                    messages=[{"role": "user", "content": "hello"}],
                    max_tokens=2,
                    logit_bias={"99999999": 5},
                )
            assert "logit_bias" in str(err.value)
            # A prompt over the context: OpenAI's code, the field as sent, vLLM's words (clients match them).
            long_text = "hello " * 1000
            with pytest.raises(openai.BadRequestError) as err:
                await gw.openai.chat.completions.create(
                    model=BASE_MODEL, messages=[{"role": "user", "content": long_text}], max_tokens=5
                )
            assert (err.value.code, err.value.param) == ("context_length_exceeded", "messages")
            assert err.value.body["message"].startswith("This model's maximum context length is ")  # type: ignore[index]
            with pytest.raises(openai.BadRequestError) as err:
                await gw.openai.completions.create(model=BASE_MODEL, prompt=long_text, max_tokens=5)
            assert (err.value.code, err.value.param) == ("context_length_exceeded", "prompt")
            # A list of prompts: each prompt's n choices in order (LangChain's batch sends such lists).
            listed = await gw.openai.completions.create(
                model=BASE_MODEL, prompt=["hello", "good morning", "hello"], max_tokens=3, temperature=0, n=2
            )
            assert [c.index for c in listed.choices] == [0, 1, 2, 3, 4, 5]
            texts = [c.text for c in listed.choices]
            assert texts[0] == texts[1] == texts[4] == texts[5]  # greedy: the same prompt, the same text
            alone = await gw.openai.completions.create(
                model=BASE_MODEL, prompt="good morning", max_tokens=3, temperature=0
            )
            assert texts[2] == texts[3] == alone.choices[0].text
            hello = await gw.openai.completions.create(model=BASE_MODEL, prompt="hello", max_tokens=1)
            assert listed.usage is not None and alone.usage is not None and hello.usage is not None
            assert listed.usage.prompt_tokens == 2 * hello.usage.prompt_tokens + alone.usage.prompt_tokens
            assert 6 <= listed.usage.completion_tokens <= 6 * 3
            # null where OpenAI allows it: the default.
            nulls = await gw.http.post(
                "/v1/completions",
                json={"model": BASE_MODEL, "prompt": "hello", "max_tokens": 2, "stream": None, "echo": None},
            )
            assert nulls.status_code == 200, nulls.text
            # n choices from one prefill: greedy choices agree, seeded ones are each their own draw.
            three = await gw.openai.chat.completions.create(
                model=BASE_MODEL,
                messages=[{"role": "user", "content": "hello"}],
                max_tokens=4,
                temperature=0,
                n=3,
            )
            assert [c.index for c in three.choices] == [0, 1, 2]
            assert len({c.message.content for c in three.choices}) == 1
            assert {c.finish_reason for c in three.choices} == {"length"}
            assert three.usage is not None and three.usage.completion_tokens == 3 * 4
            stream = await gw.openai.completions.create(
                model=BASE_MODEL, prompt="hello", max_tokens=4, temperature=1.0, seed=7, n=2, stream=True
            )
            texts = ["", ""]
            ends: dict[int, str] = {}
            async for chunk in stream:
                for choice in chunk.choices:
                    texts[choice.index] += choice.text
                    if choice.finish_reason:
                        ends[choice.index] = choice.finish_reason
            assert set(ends) == {0, 1}
            alone = await gw.openai.completions.create(
                model=BASE_MODEL, prompt="hello", max_tokens=4, temperature=1.0, seed=8
            )
            assert texts[1] == alone.choices[0].text  # choice 1 of seed 7 draws as seed 8 alone
            # Structured outputs and tools, constrained on the replica and parsed by the openai package.
            schema = {
                "type": "object",
                "properties": {
                    "ok": {"type": "boolean"},
                    "n": {"type": "integer", "minimum": 0, "maximum": 9},
                },
                "required": ["ok", "n"],
                "additionalProperties": False,
            }
            js = await gw.openai.chat.completions.create(
                model=BASE_MODEL,
                messages=[{"role": "user", "content": "hello"}],
                max_tokens=40,
                seed=3,
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": schema, "strict": True},
                },
            )
            assert js.choices[0].finish_reason == "stop"
            parsed = json.loads(js.choices[0].message.content or "")
            assert set(parsed) == {"ok", "n"} and isinstance(parsed["ok"], bool) and 0 <= parsed["n"] <= 9
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
            call = await gw.openai.chat.completions.create(
                model=BASE_MODEL,
                messages=[{"role": "user", "content": "add"}],
                max_tokens=60,
                seed=4,
                tools=[tool],
                tool_choice="required",
                parallel_tool_calls=False,
            )
            assert call.choices[0].finish_reason == "tool_calls"
            calls = call.choices[0].message.tool_calls
            assert calls is not None and len(calls) == 1 and calls[0].function.name == "add"  # type: ignore[union-attr]
            assert 0 <= json.loads(calls[0].function.arguments)["a"] <= 9  # type: ignore[union-attr]
            streamed_call = await gw.openai.chat.completions.create(
                model=BASE_MODEL,
                messages=[{"role": "user", "content": "add"}],
                max_tokens=60,
                seed=4,
                tools=[tool],
                tool_choice={"type": "function", "function": {"name": "add"}},
                parallel_tool_calls=False,
                stream=True,
            )
            deltas = [c async for c in streamed_call]
            got = [tc for c in deltas if c.choices for tc in c.choices[0].delta.tool_calls or []]
            assert [tc.function.name for tc in got] == ["add"]  # type: ignore[union-attr]
            assert 0 <= json.loads(got[0].function.arguments or "")["a"] <= 9  # type: ignore[union-attr]
            assert [
                c.choices[0].finish_reason for c in deltas if c.choices and c.choices[0].finish_reason
            ] == ["tool_calls"]
            with pytest.raises(openai.BadRequestError) as bad:
                await gw.openai.chat.completions.create(
                    model=BASE_MODEL,
                    messages=[{"role": "user", "content": "x"}],
                    max_tokens=4,
                    response_format={
                        "type": "json_schema",
                        "json_schema": {
                            "name": "x",
                            "schema": {"type": "object", "propertyNames": {"maxLength": 2}},
                        },
                    },
                )
            assert bad.value.param == "response_format" and "propertyNames" in bad.value.message
            assert "x-guidance" not in bad.value.message and "%json" not in bad.value.message
