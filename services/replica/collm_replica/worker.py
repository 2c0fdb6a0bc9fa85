"""The replica's NATS shell (`python -m collm_replica`): endpoints, subscriptions and telemetry.

Micro service `collm-replica` (metadata: replica_id, model), every endpoint registered through the bus's
micro-service path (`MicroService.endpoint` / `stream_endpoint`) on `subjects.replica(id, verb)`:

* `generate` (streaming): `GenerateRequest` -> on the request's reply inbox, `Accepted` (or a
  `GenerateError`, also sent with micro error headers so a plain request sees the code), `TokenChunk`s
  seq 0.., then `Finished`. Each request runs in a task: tokenization, adapter resolution (the adapter
  manager loads a version that is not resident, never in the engine thread) and admission happen there.
  W3C trace context from the headers becomes the parent of a `generate` span (captured here: contextvars
  do not reach the engine). Each request ends with its metrics by model and exact version and one
  `collm_replica.requests` log line written in the span's context (its trace id), both from
  `collm_replica.observe`.
* `cancel`: `CancelRequest` (reply optional) stops a generation.
* `control`: `CONTROL_COMMAND` -> `ControlReply` (share with TTL, start/stop training, pause/resume,
  publish now, sync adapter).
* `status`: `StatusRequest` (an empty body is one) -> the current `ReplicaTelemetry`.
* `tokenize`: a `TOKENIZE_REQUEST` (text, chat messages, or ids to decode) -> `TokenizeReply` or
  `DetokenizeReply` (`collm_replica.tokenization`, off the event loop; chat messages take the generate
  path's chat template), or an error reply with an `ErrorReply` body naming the field at fault.
* `evaluate` (streaming, one reply): `EvaluateCandidate` -> `EvalReport` (`Participant.evaluate`), or an
  error reply with an `ErrorReply` body. Each evaluation runs in a task; the engine orders them itself (a
  candidate on a publication's critical path before background pre-scoring).

`control`, `status` and `tokenize` also take and answer JSON (`Content-Type: application/json`);
`generate`, `cancel` and `evaluate` are msgpack only. Every refusal is a `ReplicaError`
(`collm_replica.errors`), which the bus's endpoint wrapper turns into the error reply.

Background: telemetry every `telemetry_interval_s` on `subjects.telemetry(id)`; adapter versions from
`subjects.adapter_published_all()` and the store's pointers (`AdapterManager`, re-read at start and every
`adapter_sync_interval_s`: events can be lost); the samples consumer (`SamplesConsumer`); round jobs and
their updates (`Participant`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Mapping
from typing import Any

import torch
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from collm_common import subjects, tracing
from collm_common.bus import Bus, ServiceFailure, message_size
from collm_common.clock import Clock, WallClock
from collm_common.service import ServiceContext
from collm_common.step_log import StepLog
from collm_common.store import AdapterStore, version_id
from collm_common.streams import ensure_streams
from collm_common.wire import encode_reply
from collm_common.wire.adapters import AdapterPublished
from collm_common.wire.admin import StatusRequest
from collm_common.wire.control import (
    CONTROL_COMMAND,
    ControlReply,
    ErrorReply,
    PauseTraining,
    PublishNow,
    ResumeTraining,
    SetFineTuneShare,
    StartTraining,
    StopTraining,
    SyncAdapter,
)
from collm_common.wire.inference import CONTEXT_LENGTH_EXCEEDED, CancelRequest, GenerateError, GenerateRequest
from collm_common.wire.rounds import EvalReport, EvaluateCandidate
from collm_common.wire.telemetry import ReplicaTelemetry
from collm_common.wire.tokenize import (
    TOKENIZE_REQUEST,
    Detokenize,
    DetokenizeReply,
    TokenizeReply,
    TokenizeRequest,
)
from collm_replica import __version__, metrics, observe, vllm_metrics
from collm_replica.adapters import AdapterManager
from collm_replica.engine import Engine, EngineConfig, EngineRequest
from collm_replica.errors import ReplicaError, context_length_exceeded
from collm_replica.models import LoadedModel, load_model
from collm_replica.participant import Participant
from collm_replica.samples import SamplesConsumer, load_local_dataset
from collm_replica.settings import ReplicaSettings
from collm_replica.tasks import Tasks
from collm_replica.telemetry import TelemetryBuilder
from collm_replica.tokenization import answer, chat_ids, check_token_ids, vocab_size

log = logging.getLogger(__name__)
request_log = logging.getLogger("collm_replica.requests")  # one line per finished request

# Admission attempts of a request whose adapter version is not resident (loaded between attempts).


def prompt_ids(gr: GenerateRequest, loaded: LoadedModel) -> list[int]:
    """The prompt's token ids: given ids as they are, messages through the chat template, or the prompt
    text encoded (400 unless exactly one of the three is set and valid)."""
    given = [x is not None for x in (gr.prompt, gr.messages, gr.prompt_token_ids)]
    if sum(given) != 1:
        raise ReplicaError(
            400, "exactly one of prompt, messages and prompt_token_ids must be set", param="messages"
        )
    if gr.prompt_token_ids is not None:
        return check_token_ids(gr.prompt_token_ids, vocab_size(loaded), "prompt")
    refuse_surely_too_long(gr, loaded)
    if gr.messages is not None:
        return chat_ids(loaded.tokenizer, gr.messages)
    assert gr.prompt is not None
    return list(loaded.tokenizer.encode(gr.prompt))


@functools.cache
def longest_token_chars(tokenizer: Any) -> int:
    """The most characters one token of `tokenizer` stands for (its longest vocabulary entry: a byte-level
    entry has one character per byte, and a character is at least one byte)."""
    return max((len(t) for t in tokenizer.get_vocab()), default=1) or 1


def refuse_surely_too_long(gr: GenerateRequest, loaded: LoadedModel) -> None:
    """400 `context_length_exceeded` for a prompt whose characters alone are more tokens than the context
    holds (each token stands for at most `longest_token_chars`), before spending time tokenizing it."""
    chars = len(gr.prompt or "") + sum(len(m.content) for m in gr.messages or [])
    at_least = -(-chars // longest_token_chars(loaded.tokenizer))
    limit = loaded.max_model_len
    if at_least + gr.sampling.max_tokens > limit:
        param = "messages" if gr.messages is not None else "prompt"
        raise context_length_exceeded(limit, at_least, gr.sampling.max_tokens, param, prompt_chars=chars)


def engine_request(gr: GenerateRequest, ids: list[int], span: Span, vocab_size: int) -> EngineRequest:
    """The engine's view of a generate request (its adapter name and logit_bias ids checked: 400)."""
    sp = gr.sampling
    bad = [t for t, _ in sp.logit_bias if t >= vocab_size]
    if bad:
        msg = f"logit_bias token id {bad[0]} is not in the vocabulary [0, {vocab_size})"
        raise ReplicaError(400, msg, param="logit_bias")
    er = EngineRequest(
        request_id=gr.request_id,
        prompt_ids=ids,
        adapter=gr.adapter,
        version_id=version_id(gr.adapter, gr.adapter_version) if gr.adapter and gr.adapter_version else None,
        max_tokens=sp.max_tokens,
        n=sp.n,
        temperature=sp.temperature,
        top_p=sp.top_p,
        top_k=sp.top_k,
        min_p=sp.min_p,
        presence_penalty=sp.presence_penalty,
        frequency_penalty=sp.frequency_penalty,
        repetition_penalty=sp.repetition_penalty,
        logit_bias=dict(sp.logit_bias),
        logprobs=sp.logprobs,
        grammar=gr.grammar.lark if gr.grammar is not None else None,
        grammar_param=gr.grammar.param if gr.grammar is not None else "response_format",
        seed=sp.seed,
        stop=list(gr.sampling.stop),
        ignore_eos=gr.sampling.ignore_eos,
        ttft_slo_ms=gr.slo.ttft_ms,
        tpot_slo_ms=gr.slo.tpot_ms,
        deadline_unix_s=gr.deadline_unix_s,
        span=span,
    )
    if gr.adapter is not None:
        try:
            subjects.check_token(gr.adapter, "adapter name")
        except ValueError as exc:
            raise ReplicaError(400, str(exc), param="model") from None
    return er


class Replica:
    """One replica: its engine, adapter manager, round participant, NATS endpoints and background loops."""

    def __init__(self, settings: ReplicaSettings, loaded: LoadedModel, bus: Bus, store: AdapterStore,
                 engine: Engine | None = None, clock: Clock | None = None) -> None:  # fmt: skip
        self.s = settings
        self.clock = clock or WallClock()
        self.rid = settings.replica_id
        self.loaded = loaded
        self.bus = bus
        self.store = store
        self.tasks = Tasks()
        self.engine = engine or Engine(
            loaded,
            EngineConfig.from_settings(settings),
            dataset=load_local_dataset(settings),
            clock=self.clock.monotonic,
            wall=self.clock.now,
        )
        self.adapters = AdapterManager(settings, loaded, self.engine, store, bus, self.tasks, self.clock)
        self.participant = Participant(
            self.rid, loaded, self.engine, store, bus, self.adapters, self.tasks, settings.task_metrics,
            self.clock,
        )  # fmt: skip
        self.engine.on_job_event = self.participant.on_job_event_threadsafe
        self.samples = SamplesConsumer(settings, bus, self.engine, self.clock)
        self.step_log = StepLog(settings.step_log_path) if settings.step_log_path is not None else None
        if self.step_log is not None:
            self.engine.step_log = self.step_log.write
        self.telemetry_builder = TelemetryBuilder(
            self.rid, loaded.name, settings.telemetry_interval_s, settings.max_resident_adapters, self.clock
        )
        self.tracer = tracing.tracer("collm.replica")

    # ================================================================================== lifecycle
    async def start(self) -> None:
        metrics.ENGINE_TOKENS.attach(self.rid, lambda: self.engine)
        self.engine.start()
        with contextlib.suppress(Exception):
            await ensure_streams(self.bus.js, self.s.nats_stream_replicas)
        svc = await self.bus.service(
            subjects.SERVICE_REPLICA,
            __version__,
            f"CoLLM replica {self.rid}: inference with co-executed LoRA fine-tuning",
            metadata={"replica_id": self.rid, "model": self.loaded.name},
        )
        self.micro = svc
        rid = self.rid
        await svc.stream_endpoint(
            "generate", subjects.replica(rid, "generate"), GenerateRequest, self._generate, self.tasks.spawn,
            self._generate_error, metadata={"kind": "inference", "replica_id": rid},
        )  # fmt: skip
        await svc.endpoint("cancel", subjects.replica(rid, "cancel"), CancelRequest, self._cancel, json=False)
        await svc.endpoint("status", subjects.replica(rid, "status"), StatusRequest, self._status)
        await svc.endpoint("control", subjects.replica(rid, "control"), CONTROL_COMMAND, self._control)
        await svc.endpoint(
            "tokenize", subjects.replica(rid, "tokenize"), TOKENIZE_REQUEST, self._tokenize,
            error_body=_error_reply,
        )  # fmt: skip
        await svc.stream_endpoint(
            "evaluate", subjects.replica(rid, "evaluate"), EvaluateCandidate, self._evaluate,
            self.tasks.spawn, _error_reply,
        )  # fmt: skip
        await self.bus.subscribe(
            subjects.adapter_published_all(), AdapterPublished, self.adapters.on_published
        )
        self.tasks.spawn(self._telemetry_loop())
        self.tasks.spawn(self.adapters.run_sync(self.s.adapter_sync_interval_s))
        self.tasks.spawn(self.samples.run())
        log.info("replica %s serving %s (%s)", self.rid, self.loaded.name, self.loaded.device)

    async def stop(self) -> None:
        await self.tasks.cancel_all()
        await asyncio.to_thread(self.engine.stop)
        metrics.ENGINE_TOKENS.detach(self.rid)
        if self.step_log is not None:
            self.step_log.close()

    # ================================================================================== generate
    def _generate_error(self, gr: GenerateRequest | None, err: ServiceFailure) -> GenerateError:
        """The error reply of a refused generate request (counted as `refused_<code>`)."""
        model = observe.model_label(gr, self.loaded.name) if gr is not None else "unknown"
        observe.record_failed(self.rid, model, None, f"refused_{err.code}")
        return GenerateError(
            request_id=gr.request_id if gr is not None else "?",
            code=err.code,
            type=err.type,
            message=err.message,
            param=err.param,
            error_code=err.error_code,
        )

    async def _admit(self, gr: GenerateRequest, span: Span, sink: Any) -> None:
        """Tokenize and submit to the engine, loading the adapter version when it is not resident."""
        ids = (
            await asyncio.to_thread(prompt_ids, gr, self.loaded)
            if gr.messages
            else prompt_ids(gr, self.loaded)
        )
        er = engine_request(gr, ids, span, int(self.loaded.config.vocab_size))
        try:
            await self.adapters.submit(er, sink, gr.adapter_version)
        except ReplicaError as err:
            if err.error_code == CONTEXT_LENGTH_EXCEEDED and err.param is None:
                err.param = "messages" if gr.messages else "prompt"  # the field as the client sent it
            raise

    async def _generate(self, gr: GenerateRequest, headers: Mapping[str, str]) -> AsyncIterator[Any]:
        span = self.tracer.start_span(
            "generate",
            context=tracing.extract(headers),
            kind=SpanKind.SERVER,
            attributes={"collm.request_id": gr.request_id, "collm.replica_id": self.rid,
                        "collm.adapter": gr.adapter or "base",
                        **observe.request_attributes(gr, self.loaded.name)},
        )  # fmt: skip
        model = observe.model_label(gr, self.loaded.name)
        events: asyncio.Queue[Any] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def sink(ev: Any) -> None:
            loop.call_soon_threadsafe(events.put_nowait, ev)

        try:
            await self._admit(gr, span, sink)
        except ReplicaError as err:
            span.set_status(Status(StatusCode.ERROR, err.message))
            span.set_attribute("collm.refused", err.code)
            span.end()
            raise
        except Exception as exc:  # noqa: BLE001
            log.exception("generate %s failed before admission", gr.request_id)
            span.end()
            raise ReplicaError(500, f"internal error: {type(exc).__name__}", "server_error") from None
        if gr.adapter:
            self.adapters.track(gr.adapter)
        version: str | None = None
        while True:
            ev = await events.get()
            if ev.kind == "finished":
                # Counted and logged before the last event goes out: whoever has the response sees the
                # request in the metrics and the log.
                observe.record_finished(self.rid, model, ev)
                vllm_metrics.record_finished(self.loaded.name, self.rid, ev, gr.sampling.max_tokens)
                # Written in the span's context: the line carries the request's trace id (the span has
                # ended in the engine by now; its context still names the trace).
                with trace.use_span(span, end_on_exit=False):
                    request_log.info(
                        "request %s %s", gr.request_id, ev.finish_reason,
                        extra=observe.finished_fields(ev, model),
                    )  # fmt: skip
                yield ev
                return
            yield ev
            if ev.kind == "accepted":
                version = ev.adapter_version_id
            elif ev.kind == "error":
                observe.record_failed(self.rid, model, version, "error")
                with trace.use_span(span, end_on_exit=False):
                    request_log.warning(
                        "request %s failed: %s %s", gr.request_id, ev.code, ev.message,
                        extra={"request_id": gr.request_id, "model": model, "adapter_version": version,
                               "code": ev.code},
                    )  # fmt: skip
                return

    # ================================================================================== control
    async def _cancel(self, c: CancelRequest, _headers: Mapping[str, str]) -> ControlReply:
        found = self.engine.cancel(c.request_id)
        return ControlReply(ok=found, message="cancelled" if found else "not in flight")

    async def _control(self, cmd: Any, _headers: Mapping[str, str]) -> ControlReply:
        e = self.engine
        if isinstance(cmd, SetFineTuneShare):
            await asyncio.wrap_future(e.set_share(cmd.share, cmd.ttl_s, cmd.spend))  # in force once we reply
            return ControlReply(ok=True, message=f"share {cmd.share:.2f} for {cmd.ttl_s:.0f}s")
        if isinstance(cmd, PauseTraining):
            await asyncio.wrap_future(e.pause_training())
            return ControlReply(ok=True, message="training paused")
        if isinstance(cmd, ResumeTraining):
            await asyncio.wrap_future(e.resume_training())
            return ControlReply(ok=True, message="training resumed")
        if isinstance(cmd, StopTraining):
            ok = await asyncio.wrap_future(e.stop_job(cmd.adapter))
            return ControlReply(ok=ok, message="stopped" if ok else f"no job for {cmd.adapter}")
        if isinstance(cmd, PublishNow):
            vid = await asyncio.wrap_future(e.publish_now(cmd.adapter))
            if vid is None:
                return ControlReply(ok=False, message="no slot free for the refresh")
            return ControlReply(ok=True, message=f"published {vid}", detail={"version_id": vid})
        if isinstance(cmd, SyncAdapter):
            try:
                name = subjects.check_token(cmd.adapter, "adapter name")
            except ValueError as exc:
                raise ReplicaError(400, str(exc), "invalid_request") from None
            if cmd.create and cmd.version is None and await self.store.current(name) is None:
                await self.adapters.create_initial(name)
            vid = await self.adapters.ensure(name, cmd.version)
            return ControlReply(ok=True, message=f"{vid} resident", detail={"version_id": vid})
        if isinstance(cmd, StartTraining):
            return await self.participant.start_training(cmd)
        raise ReplicaError(400, f"unsupported control command {type(cmd).__name__}")

    # ================================================================================== evaluate
    async def _evaluate(self, ev: EvaluateCandidate, headers: Mapping[str, str]) -> AsyncIterator[EvalReport]:
        failure: ReplicaError | None = None
        with self.tracer.start_as_current_span(
            "evaluate", context=tracing.extract(headers), kind=SpanKind.SERVER,
            attributes={"collm.adapter": ev.adapter, "collm.round_id": ev.round_id or 0},
        ) as span:  # fmt: skip
            try:
                report = await self.participant.evaluate(ev)
            except ReplicaError as exc:
                span.set_status(Status(StatusCode.ERROR, exc.message))
                failure = exc
            except Exception as exc:  # noqa: BLE001 - answered, never left hanging
                log.exception("evaluation of %s failed", ev.adapter)
                failure = ReplicaError(500, f"evaluation failed: {type(exc).__name__}", "server_error")
        if failure is not None:
            raise failure
        yield report

    # ================================================================================== tokenize
    async def _tokenize(
        self, req: TokenizeRequest, headers: Mapping[str, str]
    ) -> TokenizeReply | DetokenizeReply:
        """`tokenization.answer` off the event loop; 413 for a reply that would not fit in one message."""
        reply = await asyncio.to_thread(answer, req, self.loaded)
        body, reply_headers = encode_reply(reply, headers)
        size, limit = message_size(body, reply_headers), self.bus.nc.max_payload
        if size > limit:
            raise ReplicaError(
                413,
                f"the reply would be {size} bytes, more than the {limit} bytes of one NATS message: send "
                "less text (or leave return_token_strs off)",
                param="tokens" if isinstance(req, Detokenize) else None,
            )
        return reply

    # ================================================================================== telemetry
    def telemetry(self) -> ReplicaTelemetry:
        snap = self.engine.snapshot()
        p = self.participant
        return self.telemetry_builder.build(snap, p.role(snap.jobs), p.round_id)

    async def _status(self, _req: StatusRequest, _headers: Mapping[str, str]) -> ReplicaTelemetry:
        return self.telemetry()

    async def _telemetry_loop(self) -> None:
        subject = subjects.telemetry(self.rid)
        while True:
            try:
                await self.bus.publish(subject, self.telemetry())
            except Exception as exc:  # noqa: BLE001 - telemetry is best effort; the next one is a full snapshot
                log.debug("telemetry not sent: %s", exc)
            if self.step_log is not None:
                self.step_log.flush()
            await self.clock.sleep(self.s.telemetry_interval_s)


def _error_reply(_req: Any, err: ServiceFailure) -> ErrorReply:
    """The body of an error reply of `evaluate` and `tokenize`."""
    return ErrorReply(
        code=err.code, type=err.type, message=err.message, param=err.param, error_code=err.error_code
    )


async def serve(ctx: ServiceContext[ReplicaSettings]) -> None:
    """Enter model, bus, store and replica in order (unwound in reverse on stop)."""
    s = ctx.settings
    torch.set_num_threads(s.torch_threads)
    loaded = await asyncio.to_thread(
        load_model, s.model, device=s.device, cache_dir=s.model_cache_dir, tiny_seed=s.tiny_seed,
        max_model_len=s.max_model_len, matmul_dtype=s.matmul_dtype,
    )  # fmt: skip
    bus = await ctx.stack.enter_async_context(await Bus.connect(s, f"collm-replica-{s.replica_id}"))
    store = AdapterStore.connect(s, clock=ctx.clock)
    ctx.stack.push_async_callback(store.close)
    replica = Replica(s, loaded, bus, store, clock=ctx.clock)
    await replica.start()
    ctx.stack.push_async_callback(replica.stop)
    ctx.started()
    await ctx.stopping.wait()
