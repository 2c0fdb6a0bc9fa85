"""`ScriptedOpenAIServer`: an OpenAI-compatible HTTP server with scripted timing, for load-generator tests.

It answers `/v1/chat/completions` and `/v1/completions` with `stream: true` as vLLM does (SSE
`data: {chunk}` events, a role-only first chat delta, `finish_reason` on the last choice chunk, one usage
chunk with `choices: []` when `stream_options.include_usage`, then `data: [DONE]`). There is no model:
each request gets `max_tokens` chunks of the text "tok ", paced by the `Behaviour` of the requested
`model`: delay before the first token, gap between tokens, and failure modes (HTTP error, error event
mid-stream, stall, truncated stream, no usage, a plain JSON answer). It runs uvicorn on a free port in a
thread and records every request body it receives.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from collm_ops.servers import free_port


@dataclass(frozen=True)
class Behaviour:
    ttft_s: float = 0.0
    itl_s: float = 0.0
    http_status: int | None = None  # answer this status with an OpenAI error envelope, no stream
    error_after_tokens: int | None = None  # send an error event after this many tokens
    stall_after_tokens: int | None = None  # stop sending (keep the connection open) after this many
    truncate_after_tokens: int | None = None  # close the stream without finish_reason or [DONE]
    usage: bool = True
    adapter_version: str | None = None  # sent as the x-collm-adapter-version header
    replica: str | None = None  # sent as the x-collm-replica header
    fingerprint: str | None = None  # sent as system_fingerprint in every chunk
    json_answer: bool = False  # ignore `stream` and answer one JSON object
    prompt_tokens: int = 17


@dataclass
class ScriptedOpenAIServer:
    behaviours: Mapping[str, Behaviour] = field(default_factory=dict)
    default: Behaviour = field(default_factory=Behaviour)
    received: list[dict[str, Any]] = field(default_factory=list)
    port: int = 0

    def __post_init__(self) -> None:
        self.app = self._build()
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _build(self) -> FastAPI:
        app = FastAPI()

        async def handle(request: Request, chat: bool) -> Any:
            body = await request.json()
            self.received.append(body)
            b = self.behaviours.get(body.get("model", ""), self.default)
            if b.http_status is not None:
                return JSONResponse(
                    {
                        "error": {
                            "message": f"scripted {b.http_status}",
                            "type": "Scripted",
                            "code": b.http_status,
                        }
                    },
                    status_code=b.http_status,
                )
            n = int(body.get("max_tokens", 16))
            headers = {"x-collm-adapter-version": b.adapter_version} if b.adapter_version else {}
            if b.replica:
                headers["x-collm-replica"] = b.replica
            if b.json_answer:
                await asyncio.sleep(b.ttft_s + b.itl_s * max(0, n - 1))
                choice: dict[str, Any] = (
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "tok " * n},
                        "finish_reason": "length",
                    }
                    if chat
                    else {"index": 0, "text": "tok " * n, "finish_reason": "length"}
                )
                usage = {
                    "prompt_tokens": b.prompt_tokens,
                    "completion_tokens": n,
                    "total_tokens": b.prompt_tokens + n,
                }
                return JSONResponse(
                    {"id": "x", "model": body.get("model"), "choices": [choice], "usage": usage},
                    headers=headers,
                )
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(
                self._stream(body, b, n, chat, include_usage), media_type="text/event-stream", headers=headers
            )

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Any:
            return await handle(request, True)

        @app.post("/v1/completions")
        async def completions(request: Request) -> Any:
            return await handle(request, False)

        return app

    async def _stream(
        self, body: dict[str, Any], b: Behaviour, n: int, chat: bool, include_usage: bool
    ) -> AsyncIterator[str]:
        model = body.get("model")
        base: dict[str, Any] = {"id": "cmpl-scripted", "created": int(time.time()), "model": model}
        if b.fingerprint:
            base["system_fingerprint"] = b.fingerprint

        def chunk(text: str | None, finish: str | None = None) -> str:
            if chat:
                delta = {"content": text} if text is not None else {"role": "assistant", "content": ""}
                obj = {
                    **base,
                    "object": "chat.completion.chunk",
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
                }
            else:
                obj = {
                    **base,
                    "object": "text_completion",
                    "choices": [{"index": 0, "text": text or "", "finish_reason": finish}],
                }
            return f"data: {json.dumps(obj)}\n\n"

        if chat:
            yield chunk(None)
        await asyncio.sleep(b.ttft_s)
        for i in range(n):
            if i > 0:
                await asyncio.sleep(b.itl_s)
            if b.error_after_tokens is not None and i == b.error_after_tokens:
                err = {"error": {"message": "scripted failure mid-stream", "type": "Scripted", "code": 500}}
                yield f"data: {json.dumps(err)}\n\n"
                yield "data: [DONE]\n\n"
                return
            if b.stall_after_tokens is not None and i == b.stall_after_tokens:
                await asyncio.sleep(3600)
            if b.truncate_after_tokens is not None and i == b.truncate_after_tokens:
                return
            yield chunk("tok ", "length" if i == n - 1 else None)
        if include_usage and b.usage:
            usage = {
                "prompt_tokens": b.prompt_tokens,
                "completion_tokens": n,
                "total_tokens": b.prompt_tokens + n,
            }
            yield f"data: {json.dumps({**base, 'choices': [], 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"

    def start(self) -> ScriptedOpenAIServer:
        self.port = self.port or free_port()
        config = uvicorn.Config(
            self.app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off"
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="scripted-openai-server", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("scripted OpenAI server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._server.force_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
