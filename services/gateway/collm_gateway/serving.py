"""Completions: translate an OpenAI request into a `GenerateRequest`, dispatch it, answer as JSON or SSE.

Errors before any token has been sent are HTTP errors (the route's exception handler writes the
envelope). Once a stream has started, an error is sent as `data: {"error": {...}}` and the stream
still ends with `data: [DONE]`. Response headers `x-collm-replica` and `x-collm-adapter-version` (and
`system_fingerprint` in the body) name what served the request; they are known before the first byte
because the gateway waits for the replica's `Accepted` before answering (`x-collm-trace-id`, on every
response, comes from traceid.py).

A request whose replica is lost before its first token is moved to another replica by the dispatcher
(`Generation.events`), unseen by the client. A plain answer's headers and body then name the replica
that generated it. A stream's headers have already gone out naming the replica that accepted it first;
its chunks are built as they go, and the first one (a chat stream's role chunk included) is sent only
with the first generated event, so every chunk's `system_fingerprint` names the replica that produced
it. A stream cut after its first token ends with the error event and `[DONE]`, a plain request with the
error's status and envelope (503 `replica_lost` for a lost replica).

A client that disconnects cancels its generation on the replica: for streams through
`GenerationEventStream` (which always releases the generation, whatever ended the response), for
non-streaming requests by racing the generation against the connection's `http.disconnect`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from fastapi.sse import KEEPALIVE_COMMENT, EventSourceResponse
from opentelemetry import trace
from starlette.types import Receive, Scope, Send

from collm_common.clock import Clock
from collm_common.wire.inference import ChoiceFinish, Finished, GenerateRequest, TokenChunk, TokenLogprob
from collm_gateway import metrics
from collm_gateway.auth import Principal
from collm_gateway.catalog import ModelCatalog
from collm_gateway.dispatch import Dispatcher, Generation
from collm_gateway.errors import APIError
from collm_gateway.observe import CLIENT_CLOSED, RequestRecord, annotate, record, request_attributes
from collm_gateway.protocol import ChatCompletionRequest, CompletionRequest, SamplingIn
from collm_gateway.settings import GatewaySettings
from collm_gateway.shapes import (
    DONE_EVENT,
    ChatShape,
    Choice,
    OpenAIFinish,
    Shape,
    StreamIdentity,
    TextShape,
    fingerprint,
    sse,
)
from collm_gateway.tools import openai_cut_tool_calls, openai_tool_calls

REPLICA_HEADER = "x-collm-replica"
ADAPTER_VERSION_HEADER = "x-collm-adapter-version"
REQUEST_ID_HEADER = "x-request-id"


class GenerationEventStream(EventSourceResponse):
    """An SSE response that runs `on_close` however the stream ends (done, error, or disconnect)."""

    def __init__(
        self, content: AsyncIterator[bytes], headers: dict[str, str], on_close: Callable[[], Awaitable[None]]
    ):
        super().__init__(content, headers=headers)
        self.headers["Cache-Control"] = "no-cache"
        self.headers["X-Accel-Buffering"] = "no"
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # Shielded: a disconnect or shutdown cancels the response, but the cancel must reach the replica.
            with anyio.CancelScope(shield=True):
                aclose = getattr(self.body_iterator, "aclose", None)
                if aclose is not None:
                    with contextlib.suppress(Exception):
                        await aclose()
                await self._on_close()


class CompletionServing:
    def __init__(
        self, settings: GatewaySettings, catalog: ModelCatalog, dispatcher: Dispatcher, clock: Clock
    ) -> None:
        self.settings = settings
        self.catalog = catalog
        self.dispatcher = dispatcher
        self.clock = clock
        self.chat_shape = ChatShape()
        self.text_shape = TextShape()

    async def chat(self, body: ChatCompletionRequest, request: Request, principal: Principal) -> Response:
        return await self._serve(body, self.chat_shape, "chat", request, principal)

    async def completion(self, body: CompletionRequest, request: Request, principal: Principal) -> Response:
        parts = body.split_prompts(self.settings.max_prompts)
        if len(parts) == 1:
            return await self._serve(parts[0], self.text_shape, "completions", request, principal)
        # A list of prompts: each is its own request (routed, recorded and traced alone), served at once;
        # the answer holds prompt i's choice j at index i * n + j, and the summed usage (OpenAI's shape).
        served = await asyncio.gather(
            *(self._serve(p, self.text_shape, "completions", request, principal) for p in parts),
            return_exceptions=True,
        )
        for r in served:
            if isinstance(r, BaseException):
                raise r
        responses = [r for r in served if isinstance(r, Response)]
        if any(not isinstance(r, JSONResponse) for r in responses):
            return Response(status_code=CLIENT_CLOSED)  # the client went away
        payloads = [json.loads(bytes(r.body)) for r in responses]
        first = {k: v for k, v in responses[0].headers.items() if k.startswith("x-")}
        return JSONResponse(merge_completions(payloads, body.n or 1), headers=first)

    def _wire_request(
        self,
        body: SamplingIn,
        request_id: str,
        adapter: str | None,
        version: int | None,
        principal: Principal,
        slo: Any,
    ) -> GenerateRequest:
        now_unix_s = self.clock.now()
        fields: dict[str, Any] = {}
        if isinstance(body, ChatCompletionRequest):
            fields["messages"] = body.wire_messages()
            fields["grammar"] = body.grammar()
        else:
            assert isinstance(body, CompletionRequest)
            prompt, ids = body.wire_prompt()
            fields["prompt"] = prompt
            fields["prompt_token_ids"] = ids
        return GenerateRequest(
            request_id=request_id,
            adapter=adapter,
            adapter_version=version,
            sampling=body.sampling(self.settings),
            slo=slo,
            tenant=principal.tenant,
            arrival_unix_s=now_unix_s,
            deadline_unix_s=now_unix_s + self.settings.request_deadline_s,
            **fields,
        )

    async def _serve(
        self, body: SamplingIn, shape: Shape, endpoint: str, request: Request, principal: Principal
    ) -> Response:
        arrival_s = self.clock.monotonic()
        request_id = shape.id_prefix + uuid.uuid4().hex
        span = trace.get_current_span()
        rec = RequestRecord(
            request_id=request_id,
            endpoint=endpoint,
            model="unknown",
            requested_model=body.model,
            stream=body.stream,
            arrival_s=arrival_s,
            tenant=principal.tenant,
        )
        metrics.IN_FLIGHT.inc()
        handed_over = False
        try:
            body.check_supported()
            ref = await self.catalog.resolve(body.model, principal, self.settings.retry_after_s)
            rec.model = ref.label
            defaults = self.settings.slo_for(ref.label)
            slo = body.slo_targets(request.headers, defaults.ttft_ms, defaults.tpot_ms)
            rec.slo_ttft_ms, rec.slo_tpot_ms = slo.ttft_ms, slo.tpot_ms
            wire = self._wire_request(body, request_id, ref.adapter, ref.version, principal, slo)
            span.set_attribute("collm.model", body.model)
            span.set_attribute("collm.request_id", request_id)
            sp = wire.sampling
            span.set_attributes(
                request_attributes(
                    endpoint, body.model, request_id, sp.max_tokens, sp.temperature, sp.top_p, body.stream
                )
            )
            gen = await self.dispatcher.start(wire, arrival_s + self.settings.request_deadline_s)
            rec.replica_id = gen.replica_id
            rec.adapter_version_id = gen.adapter_version_id
            rec.routing_source = gen.choice.source
            rec.attempts = gen.attempts
            rec.prompt_tokens = gen.prompt_tokens
            span.set_attribute("collm.replica", gen.replica_id)
            span.set_attribute("collm.adapter_version", gen.adapter_version_id)
            ident = StreamIdentity(
                id=request_id,
                created=int(self.clock.now()),
                model=body.model,
                system_fingerprint=fingerprint(gen.replica_id, gen.adapter_version_id),
                include_usage=body.include_usage,
            )
            if body.stream:
                response = GenerationEventStream(
                    self._stream(gen, shape, ident, rec, span, _tool_choice(body)),
                    headers=_headers(gen, request_id),
                    on_close=lambda: self._finish(gen, rec, span),
                )
                handed_over = True
                return response
            try:
                payload = await self._complete(gen, shape, ident, rec, request, _tool_choice(body))
            finally:
                await self._finish(gen, rec, span)
                handed_over = True
            if payload is None:
                return Response(status_code=CLIENT_CLOSED)
            return JSONResponse(payload, headers=_headers(gen, request_id))
        except APIError as err:
            rec.status, rec.error = err.status, err.message
            raise
        except Exception as exc:
            rec.status, rec.error = 500, f"{type(exc).__name__}: {exc}"
            raise
        finally:
            if not handed_over:
                rec.end_s = rec.end_s or self.clock.monotonic()
                record(rec, span, self.settings.base_model)
                metrics.IN_FLIGHT.dec()

    @staticmethod
    def _absorb(gen: Generation, rec: RequestRecord) -> None:
        """Copy what the generation knows (timing, usage, exact version) into the request's record."""
        rec.replica_id = gen.replica_id
        rec.attempts = gen.attempts
        rec.first_token_s = gen.first_token_s
        rec.end_s = gen.end_s
        rec.completion_tokens = gen.completion_tokens
        rec.prompt_tokens = gen.prompt_tokens
        rec.adapter_version_id = gen.adapter_version_id
        if gen.finished is not None:
            rec.finish_reason = gen.finished.finish_reason

    async def _finish(self, gen: Generation, rec: RequestRecord, span: trace.Span) -> None:
        """Release the generation (cancel on the replica if unfinished) and write the record once."""
        if rec.recorded:
            return
        if gen.finished is None and rec.status == 200:  # neither finished nor failed: the client went away
            rec.status = CLIENT_CLOSED
        try:
            await gen.aclose("client_disconnected" if rec.status == CLIENT_CLOSED else "gateway_error")
        finally:
            self._absorb(gen, rec)
            record(rec, span, self.settings.base_model)
            metrics.IN_FLIGHT.dec()

    async def _stream(
        self,
        gen: Generation,
        shape: Shape,
        ident: StreamIdentity,
        rec: RequestRecord,
        span: trace.Span | None = None,
        tool_choice: str | None = None,
    ) -> AsyncIterator[bytes]:
        """SSE chunks as tokens arrive. With active tools (`tool_choice` not None) a choice is held until
        its output commits: text that starts with anything but `<` (only a call may) streams from there
        on; a call is held until the choice ends and goes out as one tool-call delta (module
        `collm_gateway.tools`)."""
        opened = False
        offsets: dict[int, int] = {}  # per choice: text length of its tokens so far (legacy text_offset)
        held: dict[int, list[TokenChunk]] = {}
        texting: set[int] = set()  # choices whose output committed to text: streamed as it comes
        try:
            async for event in gen.events(heartbeat_s=self.settings.sse_ping_s):
                if event is None:
                    yield KEEPALIVE_COMMENT
                    continue
                if not opened:  # the replica that generates is known from here on (module docstring)
                    opened = True
                    ident = _identity(ident, gen)
                    opening = shape.opening(ident, gen.request.sampling.n)
                    if opening is not None:
                        yield sse(opening)
                if isinstance(event, TokenChunk) and tool_choice is not None and event.index not in texting:
                    chunks = held.setdefault(event.index, [])
                    chunks.append(event)
                    start = "".join(c.text for c in chunks).lstrip()
                    if start and not start.startswith("<"):
                        texting.add(event.index)
                        chunk, _ = _held_choice(
                            shape, ident, held.pop(event.index), event.index, "stop", None
                        )
                        if chunk is not None:
                            yield sse(chunk)
                elif isinstance(event, TokenChunk):
                    i = event.index
                    if event.text or event.logprobs:
                        yield sse(shape.delta(ident, event.text, event.logprobs, offsets.get(i, 0), i))
                    offsets[i] = offsets.get(i, 0) + sum(len(e.token) for e in event.logprobs or [])
                elif isinstance(event, Finished):
                    for index, reason in _choice_ends(event):
                        if tool_choice is not None and index not in texting:
                            chunk, reason = _held_choice(
                                shape, ident, held.pop(index, []), index, reason, tool_choice
                            )
                            if chunk is not None:
                                yield sse(chunk)
                        yield sse(shape.closing(ident, reason, index))
                    if ident.include_usage:
                        yield sse(shape.usage_chunk(ident, event.prompt_tokens, event.completion_tokens))
        except APIError as err:
            rec.status, rec.error = err.status, err.message
            yield sse(err.body())
        # The HTTP span ends with the last byte: write the outcome on it now (the record follows on close).
        self._absorb(gen, rec)
        annotate(rec, span, self.settings.base_model)
        yield DONE_EVENT

    async def _complete(
        self,
        gen: Generation,
        shape: Shape,
        ident: StreamIdentity,
        rec: RequestRecord,
        request: Request,
        tool_choice: str | None = None,
    ) -> dict[str, Any] | None:
        """The whole answer, or None if the client disconnected first (the generation is then cancelled)."""

        n = gen.request.sampling.n
        want_logprobs = gen.request.sampling.logprobs is not None
        parts: list[list[str]] = [[] for _ in range(n)]
        logprobs: list[list[TokenLogprob]] = [[] for _ in range(n)]

        async def collect() -> Finished:
            async for event in gen.events():
                if isinstance(event, TokenChunk):
                    parts[event.index].append(event.text)
                    logprobs[event.index].extend(event.logprobs or [])
                elif isinstance(event, Finished):
                    return event
            raise AssertionError("event stream ended without Finished")  # events() raises or finishes

        work = asyncio.ensure_future(collect())
        gone = asyncio.ensure_future(_client_gone(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()
        if not work.done() or work.cancelled():
            rec.status = CLIENT_CLOSED
            with contextlib.suppress(asyncio.CancelledError):
                await work
            return None
        try:
            fin = work.result()
        except APIError as err:
            rec.status, rec.error = err.status, err.message
            raise
        except Exception as exc:
            rec.status, rec.error = 500, f"{type(exc).__name__}: {exc}"
            raise
        choices = []
        for i, reason in _choice_ends(fin):
            text = "".join(parts[i])
            calls, finish = _choice_calls(text, reason, tool_choice)
            if calls is not None:
                text = ""  # its calls, never the call markup
            lps = logprobs[i] if want_logprobs else None
            choices.append(Choice(i, text, finish, lps, calls))
        return shape.complete(_identity(ident, gen), choices, fin.prompt_tokens, fin.completion_tokens)


def merge_completions(payloads: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """One text completion from the answers to each prompt of a list, in order: prompt i's choice j at
    index i * n + j, usage summed, the rest (id, model, fingerprint) the first answer's."""
    choices = []
    for i, p in enumerate(payloads):
        for c in p["choices"]:
            choices.append({**c, "index": i * n + int(c["index"])})
    usage = {
        k: sum(int((p.get("usage") or {}).get(k, 0)) for p in payloads)
        for k in ("prompt_tokens", "completion_tokens", "total_tokens")
    }
    return {**payloads[0], "choices": choices, "usage": usage}


def _choice_calls(
    text: str, reason: OpenAIFinish, tool_choice: str | None
) -> tuple[list[dict[str, Any]] | None, OpenAIFinish]:
    """A choice's OpenAI `tool_calls` (None: it is text) and finish reason: the calls of an output that
    ended with `stop` ("tool_calls"), or those so far of one `max_tokens` cut ("length")."""
    calls = None
    if tool_choice is not None and reason == "stop":
        calls = openai_tool_calls(text)
    elif tool_choice is not None and reason == "length":
        calls = openai_cut_tool_calls(text, tool_choice)
    return calls, "tool_calls" if calls and reason == "stop" else reason


def _held_choice(
    shape: Shape,
    ident: StreamIdentity,
    chunks: list[TokenChunk],
    index: int,
    reason: OpenAIFinish,
    tool_choice: str | None,
) -> tuple[dict[str, Any] | None, OpenAIFinish]:
    """A held choice's one chunk (its tool calls, or its text) and its finish reason; `tool_choice` None:
    it is text."""
    text = "".join(c.text for c in chunks)
    calls, finish = _choice_calls(text, reason, tool_choice)
    if calls is not None:
        assert isinstance(shape, ChatShape)  # tools exist in chat completions only
        if not calls:
            return None, finish  # cut before the first call's name: nothing to send
        return shape.tool_calls_delta(ident, calls, index), finish
    if not chunks:
        return None, reason
    lps = [lp for c in chunks for lp in c.logprobs or []] if chunks[0].logprobs is not None else None
    return shape.delta(ident, text, lps, 0, index), reason


def _tool_choice(body: SamplingIn) -> str | None:
    """The request's tool choice ("auto", "required" or a function's name); None without active tools."""
    if not isinstance(body, ChatCompletionRequest):
        return None
    choice = body.tool_choice_name
    return None if choice == "none" else choice


def _choice_ends(fin: Finished) -> list[tuple[int, OpenAIFinish]]:
    """(index, OpenAI finish_reason) of every choice the replica ended."""
    ends = fin.choices or [ChoiceFinish(index=0, finish_reason=fin.finish_reason, completion_tokens=0)]
    return [(e.index, "length" if e.finish_reason == "length" else "stop") for e in ends]


def _identity(ident: StreamIdentity, gen: Generation) -> StreamIdentity:
    """`ident` with the fingerprint of the replica and adapter version now serving `gen`."""
    fp = fingerprint(gen.replica_id, gen.adapter_version_id)
    return ident if fp == ident.system_fingerprint else dataclasses.replace(ident, system_fingerprint=fp)


def _headers(gen: Generation, request_id: str) -> dict[str, str]:
    return {
        REPLICA_HEADER: gen.replica_id,
        ADAPTER_VERSION_HEADER: gen.adapter_version_id,
        REQUEST_ID_HEADER: request_id,
    }


async def _client_gone(request: Request) -> None:
    """Returns when the client disconnects (the body has been read, so the next message is the end)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
