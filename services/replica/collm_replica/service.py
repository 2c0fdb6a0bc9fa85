"""The replica's NATS shell around the engine (`python -m collm_replica`).

Micro service `collm-replica` (metadata: replica_id, model) with endpoints on `subjects.replica(id, verb)`:

* `generate`: `GenerateRequest` -> on the request's reply inbox, `Accepted` (or a `GenerateError`, also sent
  with micro error headers so a plain request sees the code), `TokenChunk`s seq 0.., then `Finished`. The
  handler only decodes and hands off to a task; tokenization, adapter resolution (fetch from the store
  when not resident, never in the engine thread) and admission happen there. W3C trace context from the
  headers becomes the parent of a `generate` span (captured here: contextvars do not reach the engine).
  Each request ends with its metrics by model and exact version and one `collm_replica.requests` log
  line written in the span's context (its trace id), both from `collm_replica.observe`.
* `cancel`: `CancelRequest` (reply optional) stops a generation.
* `control`: `CONTROL_COMMAND` -> `ControlReply` (share with TTL, start/stop training, pause/resume,
  publish now, sync adapter).
* `status`: `StatusRequest` (an empty body is one) -> the current `ReplicaTelemetry`.

`control` and `status` go through the bus's endpoint path, so they also take and answer JSON
(`Content-Type: application/json`); `generate`, `cancel` and `evaluate` are msgpack only.
* `evaluate`: `EvaluateCandidate` -> `EvalReport` (held-out loss of a candidate blob or stored version and,
  unless `score_current=False`, of the current version on the local eval split, per domain, with the
  digest of the items scored). Handed to a task; the engine scores a publication's candidate before
  background pre-scoring and caches results by weights digest and eval set.

Background: telemetry every `telemetry_interval_s` on `subjects.telemetry(id)`; adapter sync from
`subjects.adapter_published_all()` plus a re-read of the store's pointers at start and every
`adapter_sync_interval_s` (events can be lost); a durable JetStream consumer of `subjects.samples(id)` that
persists samples (msgpack, or JSON when published with `Content-Type: application/json`) in `samples_dir`
(`<data_dir>/samples/`) before acking; round jobs that end in
`store.put_update` and a `LocalUpdate` on JetStream (`Nats-Msg-Id` dedupe). While Redis is unreachable
(a restart) the upload is retried with backoff until `UPDATE_SEND_MARGIN_S` before the round's deadline
(`UPDATE_RETRY_BOUND_S` for a round without one); an update that could not be stored or announced by
then is logged and counted as not sent (`collm_replica_round_updates_total{outcome}`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import redis.exceptions
import torch
from nats.micro.request import Request
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from collm_common import subjects, tracing
from collm_common.bus import ERROR_CODE_HEADER, ERROR_HEADER, Bus, ServiceFailure, respond_error
from collm_common.data import Example, LocalDataset, load_dataset, read_file
from collm_common.lora import decode_adapter, encode_adapter
from collm_common.service import ServiceContext
from collm_common.step_log import StepLog
from collm_common.store import (
    AdapterStore,
    Conflict,
    CorruptBlob,
    NotFound,
    StoreError,
    sha256_hex,
    version_id,
)
from collm_common.streams import ensure_streams
from collm_common.wire import WireError, decode, decode_payload, encode
from collm_common.wire.adapters import AdapterPublished, TrainingSample
from collm_common.wire.admin import StatusRequest
from collm_common.wire.control import (
    CONTROL_COMMAND,
    ControlReply,
    PauseTraining,
    PublishNow,
    ResumeTraining,
    SetFineTuneShare,
    StartTraining,
    StopTraining,
    SyncAdapter,
)
from collm_common.wire.inference import CancelRequest, GenerateError, GenerateRequest
from collm_common.wire.rounds import DomainLoss, EvalReport, EvaluateCandidate, LocalUpdate
from collm_common.wire.telemetry import ReplicaTelemetry
from collm_replica import __version__, metrics, observe
from collm_replica.engine import Engine, EngineConfig, EngineRefusal, EngineRequest, JobEvent, NotResident
from collm_replica.lora_bank import AdapterMismatch, LiveLora
from collm_replica.models import LoadedModel, load_model
from collm_replica.settings import ReplicaSettings
from collm_replica.training import JobSpec

log = logging.getLogger(__name__)
request_log = logging.getLogger("collm_replica.requests")  # one line per finished request

SAMPLES_FILE = "collm-samples.jsonl"
SAMPLES_SUBDIR = "samples"
# Redis unreachable (down or restarting): an update's upload waits for it (`_store_update`).
STORE_UNREACHABLE = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, ConnectionError)
# An update must be on JetStream this long before its round's deadline for the aggregator to read and
# validate it in time: retrying the upload stops here.
UPDATE_SEND_MARGIN_S = 0.5
# Retrying the upload of a round without a deadline (an operator's StartTraining) stops after this long.
UPDATE_RETRY_BOUND_S = 120.0
ROUND_DEADLINES_KEPT = 64


class Refusal(Exception):
    def __init__(
        self, code: int, message: str, type_: str = "invalid_request_error", param: str | None = None
    ):
        super().__init__(message)
        self.code = code
        self.message = message
        self.type = type_
        self.param = param


def samples_dir(settings: ReplicaSettings) -> Path:
    """Where samples received while running are persisted (`collm-samples.jsonl`): `<data_dir>/samples/`,
    or `.collm/replica-<id>/samples/` when the replica has no data directory. The one place: nothing else
    writes there, and `load_local_dataset` reads it exactly once."""
    if settings.data_dir is None:
        return Path(".collm") / f"replica-{settings.replica_id}" / SAMPLES_SUBDIR
    return Path(settings.data_dir) / SAMPLES_SUBDIR


def load_local_dataset(settings: ReplicaSettings) -> LocalDataset:
    """The replica's local dataset, each example loaded once, into its split:

    * the data directory: with `train/` (and `eval/`) sub-directories their files give the split as
      written; otherwise (a flat directory) the stable hash of each example's id decides it;
    * persisted samples (`samples_dir`): always the stable hash of the id, exactly as when they arrived
      (`Engine.add_examples`), so a restart never moves a sample from one split to the other.

    A repeated id (a sample redelivered and persisted twice) keeps its first occurrence."""
    ds = LocalDataset([], [])
    seen: set[str] = set()

    def put(e: Example, split: str | None) -> None:
        if e.id in seen:
            return
        seen.add(e.id)
        if split is None:
            ds.add(e, settings.eval_fraction)
        else:
            (ds.train if split == "train" else ds.eval).append(e)

    sdir = samples_dir(settings)
    d = settings.data_dir
    if d is not None and Path(d).is_dir():
        d = Path(d)
        if (d / "train").is_dir():
            part = load_dataset(d, settings.eval_fraction)  # reads train/ and eval/ only
            for e in part.train:
                put(e, "train")
            for e in part.eval:
                put(e, "eval")
        else:
            for path in sorted(d.rglob("*")):
                if path.suffix in (".jsonl", ".csv") and path.is_file() and sdir not in path.parents:
                    for e in read_file(path):
                        put(e, None)
    if sdir.is_dir():
        for path in sorted(sdir.glob("*.jsonl")):
            for e in read_file(path):
                put(e, None)
    return ds


class Replica:
    """Owns the engine, the NATS endpoints and the background loops of one replica."""

    def __init__(self, settings: ReplicaSettings, loaded: LoadedModel, bus: Bus, store: AdapterStore,
                 engine: Engine | None = None) -> None:  # fmt: skip
        self.s = settings
        self.rid = settings.replica_id
        self.loaded = loaded
        self.bus = bus
        self.store = store
        self.loop = asyncio.get_running_loop()
        self.engine = engine or Engine(
            loaded,
            EngineConfig.from_settings(settings),
            dataset=load_local_dataset(settings),
            on_job_event=self._on_job_event_threadsafe,
        )
        if engine is not None:
            engine.on_job_event = self._on_job_event_threadsafe
        self.step_log = StepLog(settings.step_log_path) if settings.step_log_path is not None else None
        if self.step_log is not None:
            self.engine.step_log = self.step_log.write
        self.tracer = tracing.tracer("collm.replica")
        self._tasks: set[asyncio.Task[Any]] = set()
        self._fetches: dict[str, asyncio.Future[str]] = {}
        self._known: set[str] = set()  # adapter names this replica serves or trains (kept in sync)
        self._last: dict[str, float] | None = None
        self._round_role = "idle"
        self._round_id: int | None = None
        self._round_deadlines: dict[int, float | None] = {}  # round id -> deadline (Unix s) of its job
        self._stopping = False

    # ================================================================================== lifecycle
    async def start(self) -> None:
        metrics.ENGINE_TOKENS.attach(self.rid, lambda: self.engine)
        self.engine.start()
        with contextlib.suppress(Exception):
            await ensure_streams(self.bus.js)
        svc = await self.bus.service(
            subjects.SERVICE_REPLICA,
            __version__,
            f"CoLLM replica {self.rid}: inference with co-executed LoRA fine-tuning",
            metadata={"replica_id": self.rid, "model": self.loaded.name},
        )
        self.micro = svc
        await svc.svc.add_endpoint(
            name="generate", subject=subjects.replica(self.rid, "generate"), handler=self._on_generate,
            metadata={"kind": "inference", "replica_id": self.rid},
        )  # fmt: skip
        await svc.svc.add_endpoint(
            name="cancel", subject=subjects.replica(self.rid, "cancel"), handler=self._on_cancel
        )
        await svc.endpoint("status", subjects.replica(self.rid, "status"), StatusRequest, self._on_status)
        await svc.endpoint(
            "control", subjects.replica(self.rid, "control"), CONTROL_COMMAND, self._on_control
        )
        await svc.svc.add_endpoint(
            name="evaluate", subject=subjects.replica(self.rid, "evaluate"), handler=self._on_evaluate_request
        )
        await self.bus.subscribe(subjects.adapter_published_all(), AdapterPublished, self._on_published)
        self._spawn(self._telemetry_loop())
        self._spawn(self._sync_loop())
        self._spawn(self._samples_loop())
        log.info("replica %s serving %s (%s)", self.rid, self.loaded.name, self.loaded.device)

    async def stop(self) -> None:
        self._stopping = True
        for t in list(self._tasks):
            t.cancel()
        for t in list(self._tasks):
            with contextlib.suppress(BaseException):
                await t
        await asyncio.to_thread(self.engine.stop)
        metrics.ENGINE_TOKENS.detach(self.rid)
        if self.step_log is not None:
            self.step_log.close()

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # ================================================================================== generate
    async def _on_generate(self, req: Request) -> None:
        try:
            gr = decode(GenerateRequest, req.data)
        except WireError as exc:
            await self._refuse(req, "", Refusal(exc.code, str(exc)))
            return
        ctx = tracing.extract(req.headers or {})
        self._spawn(self._generate(req, gr, ctx))

    async def _refuse(self, req: Request, request_id: str, r: Refusal, model: str = "unknown") -> None:
        observe.record_failed(self.rid, model, None, f"refused_{r.code}")
        body = encode(GenerateError(request_id=request_id or "?", code=r.code, type=r.type, message=r.message,
                                    param=r.param))  # fmt: skip
        headers = {ERROR_HEADER: r.message.replace("\n", " ")[:512], ERROR_CODE_HEADER: str(r.code)}
        with contextlib.suppress(Exception):
            await req.respond(body, headers=headers)

    def _tokenize(self, gr: GenerateRequest) -> list[int]:
        given = [x is not None for x in (gr.prompt, gr.messages, gr.prompt_token_ids)]
        if sum(given) != 1:
            raise Refusal(
                400, "exactly one of prompt, messages and prompt_token_ids must be set", param="messages"
            )
        tok = self.loaded.tokenizer
        if gr.prompt_token_ids is not None:
            vocab = int(self.loaded.config.vocab_size)
            if not gr.prompt_token_ids or any(t < 0 or t >= vocab for t in gr.prompt_token_ids):
                raise Refusal(400, f"prompt_token_ids must be non-empty ids in [0, {vocab})", param="prompt")
            return list(gr.prompt_token_ids)
        if gr.messages is not None:
            if not gr.messages:
                raise Refusal(400, "messages must not be empty", param="messages")
            try:
                text = tok.apply_chat_template(
                    [{"role": m.role, "content": m.content} for m in gr.messages],
                    add_generation_prompt=True,
                    tokenize=False,
                )
            except Exception as exc:  # noqa: BLE001 - a template that rejects these messages
                raise Refusal(
                    400, f"the chat template rejected the messages: {exc}", param="messages"
                ) from None
            return list(tok.encode(text, add_special_tokens=False))
        assert gr.prompt is not None
        return list(tok.encode(gr.prompt))

    async def _generate(self, req: Request, gr: GenerateRequest, ctx: Any) -> None:
        span = self.tracer.start_span(
            "generate",
            context=ctx,
            kind=SpanKind.SERVER,
            attributes={"collm.request_id": gr.request_id, "collm.replica_id": self.rid,
                        "collm.adapter": gr.adapter or "base",
                        **observe.request_attributes(gr, self.loaded.name)},
        )  # fmt: skip
        model = observe.model_label(gr, self.loaded.name)
        events: asyncio.Queue[Any] = asyncio.Queue()

        def sink(ev: Any) -> None:
            self.loop.call_soon_threadsafe(events.put_nowait, ev)

        try:
            ids = await asyncio.to_thread(self._tokenize, gr) if gr.messages else self._tokenize(gr)
            er = EngineRequest(
                request_id=gr.request_id,
                prompt_ids=ids,
                adapter=gr.adapter,
                version_id=version_id(gr.adapter, gr.adapter_version)
                if gr.adapter and gr.adapter_version
                else None,
                max_tokens=gr.sampling.max_tokens,
                temperature=gr.sampling.temperature,
                top_p=gr.sampling.top_p,
                seed=gr.sampling.seed,
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
                    raise Refusal(400, str(exc), param="model") from None
            for attempt in range(3):
                try:
                    self.engine.submit(er, sink)
                    break
                except NotResident:
                    if attempt == 2:
                        raise Refusal(
                            503, "adapter could not be kept resident", "service_unavailable"
                        ) from None
                    assert gr.adapter is not None
                    await self.ensure_adapter(gr.adapter, gr.adapter_version)
        except (Refusal, EngineRefusal) as r:
            refusal = r if isinstance(r, Refusal) else Refusal(r.code, r.message, r.type, r.param)
            span.set_status(Status(StatusCode.ERROR, refusal.message))
            span.set_attribute("collm.refused", refusal.code)
            span.end()
            await self._refuse(req, gr.request_id, refusal, model)
            return
        except Exception as exc:  # noqa: BLE001
            log.exception("generate %s failed before admission", gr.request_id)
            span.end()
            internal = Refusal(500, f"internal error: {type(exc).__name__}", "server_error")
            await self._refuse(req, gr.request_id, internal, model)
            return
        if gr.adapter:
            self._known.add(gr.adapter)
        version: str | None = None
        while True:
            ev = await events.get()
            with contextlib.suppress(Exception):
                await req.respond(encode(ev))
            if ev.kind == "accepted":
                version = ev.adapter_version_id
            elif ev.kind == "finished":
                observe.record_finished(self.rid, model, ev)
                # Written in the span's context: the line carries the request's trace id (the span has
                # ended in the engine by now; its context still names the trace).
                with trace.use_span(span, end_on_exit=False):
                    request_log.info(
                        "request %s %s", gr.request_id, ev.finish_reason,
                        extra=observe.finished_fields(ev, model),
                    )  # fmt: skip
                return
            elif ev.kind == "error":
                observe.record_failed(self.rid, model, version, "error")
                with trace.use_span(span, end_on_exit=False):
                    request_log.warning(
                        "request %s failed: %s %s", gr.request_id, ev.code, ev.message,
                        extra={"request_id": gr.request_id, "model": model, "adapter_version": version,
                               "code": ev.code},
                    )  # fmt: skip
                return

    # ================================================================================== adapters
    async def ensure_adapter(self, name: str, version: int | None = None) -> str:
        """Make `name@vN` (None: the store's current) resident; raises Refusal 404 if it does not exist."""
        try:
            current = await self.store.current(name)
        except StoreError as exc:
            raise Refusal(503, f"adapter store unavailable: {exc}", "service_unavailable") from None
        except Exception as exc:  # noqa: BLE001 - redis connection errors
            raise Refusal(
                503, f"adapter store unavailable: {type(exc).__name__}", "service_unavailable"
            ) from None
        if version is None:
            if current is None:
                raise Refusal(404, f"unknown adapter {name!r}", "not_found", param="model")
            version = current
        return await self._fetch_install(name, version, make_current=(version == current))

    async def _fetch_install(self, name: str, version: int, make_current: bool, source: str = "fetch") -> str:
        vid = version_id(name, version)
        if self.engine.is_resident(vid) and (not make_current or self.engine.current_version(name) == vid):
            return vid
        pending = self._fetches.get(vid)
        if pending is not None:
            return await asyncio.shield(pending)
        fut: asyncio.Future[str] = self.loop.create_future()
        self._fetches[vid] = fut
        try:
            try:
                blob = await self.store.get_blob(name, version)
            except NotFound as exc:
                raise Refusal(404, str(exc), "not_found", param="model") from None
            except CorruptBlob as exc:
                raise Refusal(500, str(exc), "server_error") from None
            try:
                weights = decode_adapter(blob)
                result = await asyncio.wrap_future(self.engine.install_version(vid, weights, make_current))
            except (ValueError, AdapterMismatch) as exc:
                raise Refusal(
                    422, f"{vid} cannot be served by this replica: {exc}", "invalid_adapter"
                ) from None
            except EngineRefusal as exc:
                raise Refusal(exc.code, exc.message, exc.type) from None
            metrics.SWAPS.labels(self.rid, source).inc()
            self._known.add(name)
            fut.set_result(result)
            return result
        except BaseException as exc:
            fut.set_exception(exc)
            fut.exception()  # retrieved: waiters re-raise it, nobody logs "never retrieved"
            raise
        finally:
            self._fetches.pop(vid, None)

    async def _install_quietly(self, name: str, version: int, make_current: bool) -> None:
        try:
            await self._fetch_install(name, version, make_current=make_current)
        except Refusal as exc:
            log.warning("%s not made resident: %s", version_id(name, version), exc.message)

    async def _on_published(self, ev: AdapterPublished, _msg: Any) -> None:
        """A new current version: swap it in if this replica serves or trains that adapter."""
        if ev.name not in self._known and self.engine.current_version(ev.name) is None:
            return
        newest = self.engine.global_version(ev.name)
        if newest is not None and ev.version <= newest:
            return
        try:
            await self._fetch_install(ev.name, ev.version, make_current=True, source="published")
            log.info("swapped in %s (published)", ev.version_id)
        except Refusal as exc:
            log.warning("could not swap in %s: %s", ev.version_id, exc.message)

    async def sync_once(self) -> None:
        """Re-read the store's pointers of every adapter this replica serves (lost events, reconnects)."""
        for name in sorted(self._known):
            try:
                cur = await self.store.current(name)
            except Exception as exc:  # noqa: BLE001
                log.warning("adapter sync: store unavailable: %s", exc)
                return
            newest = self.engine.global_version(name)
            if cur is not None and (newest is None or cur > newest):
                with contextlib.suppress(Refusal):
                    await self._fetch_install(name, cur, make_current=True, source="sync")

    async def _sync_loop(self) -> None:
        while True:
            await self.sync_once()
            await asyncio.sleep(self.s.adapter_sync_interval_s)

    # ================================================================================== control
    async def _on_cancel(self, req: Request) -> None:
        try:
            c = decode(CancelRequest, req.data)
        except WireError as exc:
            with contextlib.suppress(Exception):
                await req.respond_error(str(exc.code), str(exc))
            return
        found = self.engine.cancel(c.request_id)
        with contextlib.suppress(ValueError):  # a plain publish has no reply subject
            await req.respond(
                encode(ControlReply(ok=found, message="cancelled" if found else "not in flight"))
            )

    async def _on_control(self, cmd: Any, _headers: Mapping[str, str]) -> ControlReply:
        e = self.engine
        if isinstance(cmd, SetFineTuneShare):
            await asyncio.wrap_future(e.set_share(cmd.share, cmd.ttl_s))  # in force once we reply
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
            try:
                vid = await asyncio.wrap_future(e.publish_now(cmd.adapter))
            except EngineRefusal as exc:
                raise ServiceFailure(exc.code, exc.message, exc.type) from None
            if vid is None:
                return ControlReply(ok=False, message="no slot free for the refresh")
            return ControlReply(ok=True, message=f"published {vid}", detail={"version_id": vid})
        if isinstance(cmd, SyncAdapter):
            try:
                name = subjects.check_token(cmd.adapter, "adapter name")
            except ValueError as exc:
                raise ServiceFailure(400, str(exc), "invalid_request") from None
            try:
                if cmd.create and cmd.version is None and await self.store.current(name) is None:
                    await self._create_v1(name)
                vid = await self.ensure_adapter(name, cmd.version)
            except Refusal as exc:
                raise ServiceFailure(exc.code, exc.message, exc.type) from None
            return ControlReply(ok=True, message=f"{vid} resident", detail={"version_id": vid})
        if isinstance(cmd, StartTraining):
            try:
                return await self.start_training(cmd)
            except Refusal as exc:
                raise ServiceFailure(exc.code, exc.message, exc.type) from None
        raise ServiceFailure(400, f"unsupported control command {type(cmd).__name__}")

    async def _create_v1(self, name: str) -> int:
        """Create `name@v1` (zero-B LoRA: the base model's behaviour); if another replica won, use theirs."""
        ex = self.engine.executor
        live = LiveLora.init_new(self.s.lora_spec, ex.n_layers, ex.shapes, self.loaded.name)
        blob = encode_adapter(live.to_weights({"collm.created_by": self.rid}))
        try:
            rec = await self.store.publish(name, blob, expected_current=None, base_model=self.loaded.name,
                                           source="create")  # fmt: skip
        except Conflict:
            cur = await self.store.current(name)
            if cur is None:
                raise Refusal(409, f"could not create adapter {name!r}", "conflict") from None
            return cur
        await self.bus.publish(
            subjects.adapter_published(name),
            AdapterPublished(name=name, version=rec.version, version_id=rec.id, sha256=rec.sha256,
                             base_model=self.loaded.name, source="create", created_unix_s=rec.created_unix_s),
        )  # fmt: skip
        log.info("created %s", rec.id)
        return rec.version

    async def start_training(self, cmd: StartTraining) -> ControlReply:
        name = subjects.check_token(cmd.adapter, "adapter name")
        base = cmd.base_version
        if base is None:
            base = await self.store.current(name)
            if base is None:
                base = await self._create_v1(name)
        try:
            blob = await self.store.get_blob(name, base)
        except NotFound as exc:
            raise Refusal(404, str(exc), "not_found") from None
        weights = decode_adapter(blob)
        current = await self.store.current(name)
        # Serving the base version here is best effort and must never hold up the job (training needs no
        # slot) nor this control endpoint (its handler runs one request at a time): when every slot is
        # pinned by in-flight requests, the install waits in the background.
        self._spawn(self._install_quietly(name, base, base == current))
        ex = self.engine.executor
        try:
            live = LiveLora.from_weights(
                weights, ex.n_layers, ex.shapes, self.loaded.dtype, self.loaded.device
            )
        except AdapterMismatch as exc:
            raise Refusal(
                422, f"{version_id(name, base)} cannot be trained here: {exc}", "invalid_adapter"
            ) from None
        spec = JobSpec(
            adapter=name,
            base_version_id=version_id(name, base),
            base_version=base,
            live=live,
            token_budget=cmd.token_budget,
            learning_rate=cmd.learning_rate,
            round_id=cmd.round_id,
            deadline_unix_s=cmd.deadline_unix_s,
        )
        try:
            status = await asyncio.wrap_future(self.engine.start_job(spec))
        except EngineRefusal as exc:
            raise Refusal(exc.code, exc.message, exc.type) from None
        self._known.add(name)
        if cmd.round_id is not None:
            self._round_role, self._round_id = "participant", cmd.round_id
            self._round_deadlines[cmd.round_id] = cmd.deadline_unix_s
            while len(self._round_deadlines) > ROUND_DEADLINES_KEPT:  # jobs that failed never send
                del self._round_deadlines[next(iter(self._round_deadlines))]
        return ControlReply(
            ok=True,
            message=f"training {name} from {status.base_version_id} for {cmd.token_budget} tokens",
            detail={"base_version_id": status.base_version_id, "round_id": str(cmd.round_id or "")},
        )

    # ================================================================================== jobs
    def _on_job_event_threadsafe(self, ev: JobEvent) -> None:
        if not self._stopping:
            self.loop.call_soon_threadsafe(lambda: self._spawn(self._on_job_event(ev)))

    async def _on_job_event(self, ev: JobEvent) -> None:
        if ev.kind == "refresh":
            metrics.SWAPS.labels(self.rid, "local_refresh").inc()
            log.info(
                "local refresh of %s -> %s (eval loss %s)", ev.adapter, ev.version_id, ev.status.eval_loss
            )
        elif ev.kind == "failed":
            log.error("training job %s failed", ev.adapter)
        elif ev.kind == "round_update" and ev.round_id is not None and ev.weights is not None:
            await self.send_update(ev)

    async def send_update(self, ev: JobEvent) -> None:
        assert ev.round_id is not None and ev.weights is not None and ev.base_version is not None
        ev.weights.extra.update({"collm.replica_id": self.rid, "collm.round_id": str(ev.round_id)})
        blob = encode_adapter(ev.weights)
        deadline = self._round_deadlines.pop(ev.round_id, None)
        stored = await self._store_update(ev.round_id, blob, deadline)
        if stored is None:
            self._round_role = "done"
            return
        key, sha = stored
        upd = LocalUpdate(
            round_id=ev.round_id,
            adapter=ev.adapter,
            replica_id=self.rid,
            base_version=ev.base_version,
            blob_key=key,
            sha256=sha,
            num_samples=ev.num_samples,
            num_tokens=ev.num_tokens,
            train_loss=ev.train_loss,
            eval_loss_before=ev.eval_loss_before,
            eval_loss_after=ev.eval_loss_after,
            created_unix_s=time.time(),
        )
        headers = tracing.inject({"Nats-Msg-Id": f"update-{ev.round_id}-{self.rid}"})
        sent = False
        for attempt in range(5):
            try:
                await self.bus.js.publish(
                    subjects.update(ev.round_id, self.rid), encode(upd), headers=headers
                )
                sent = True
                break
            except Exception as exc:  # noqa: BLE001 - JetStream not ready: retry, dedupe makes it safe
                log.warning("publishing the update of round %d failed (%s); retrying", ev.round_id, exc)
                await asyncio.sleep(0.5 * (attempt + 1))
        self._round_role = "done"
        if not sent:
            metrics.ROUND_UPDATES.labels(self.rid, "not_sent_bus").inc()
            log.error(
                "round %d: update %s stored but not sent: JetStream refused it 5 times", ev.round_id, key
            )
            return
        metrics.ROUND_UPDATES.labels(self.rid, "sent").inc()
        log.info("round %d: update %s sent (%d tokens)", ev.round_id, key, ev.num_tokens)

    async def _store_update(
        self, round_id: int, blob: bytes, deadline_unix_s: float | None
    ) -> tuple[str, str] | None:
        """Store an update's blob: (key, sha256), or None (logged and counted) when it could not be.

        While Redis is unreachable (a restart) the upload is retried with backoff (0.1 s doubling to 1 s)
        until `UPDATE_SEND_MARGIN_S` before the round's deadline, after which the aggregator could not
        take the update anyway, or for `UPDATE_RETRY_BOUND_S` when the round has no deadline. The blob is
        written once (SET NX): an attempt whose reply was lost leaves it stored, and the retry then finds
        it and announces it."""
        give_up_s = (
            deadline_unix_s - UPDATE_SEND_MARGIN_S
            if deadline_unix_s is not None
            else time.time() + UPDATE_RETRY_BOUND_S
        )
        delay_s = 0.1
        while True:
            try:
                return await self.store.put_update(round_id, self.rid, blob)
            except Conflict:
                log.warning("update for round %d already stored; announcing it", round_id)
                return self.store.update_key(round_id, self.rid), sha256_hex(blob)
            except STORE_UNREACHABLE as exc:
                if time.time() + delay_s > give_up_s:
                    metrics.ROUND_UPDATES.labels(self.rid, "not_sent_store_unreachable").inc()
                    until = (
                        f"until {UPDATE_SEND_MARGIN_S:g} s before the round's deadline"
                        if deadline_unix_s is not None
                        else f"for {UPDATE_RETRY_BOUND_S:g} s"
                    )
                    log.error(
                        "round %d: update not sent: the adapter store stayed unreachable (%s) %s",
                        round_id, exc, until,
                    )  # fmt: skip
                    return None
                metrics.UPDATE_UPLOAD_RETRIES.labels(self.rid).inc()
                log.warning("round %d: adapter store unreachable (%s); retrying the upload", round_id, exc)
                await asyncio.sleep(delay_s)
                delay_s = min(2 * delay_s, 1.0)
            except Exception:
                metrics.ROUND_UPDATES.labels(self.rid, "not_sent_store_error").inc()
                log.exception("round %d: update not sent: the adapter store refused it", round_id)
                return None

    # ================================================================================== evaluate
    async def _read_candidate(self, key: str, sha: str) -> bytes:
        try:
            return await self.store.get_update(key, sha)
        except NotFound as exc:
            raise ServiceFailure(404, str(exc), "not_found") from None
        except CorruptBlob as exc:
            raise ServiceFailure(422, str(exc), "invalid_adapter") from None
        except StoreError:
            blob = await self.store.r.get(key)  # an aggregate written under another key of this store
            if blob is None:
                raise ServiceFailure(404, f"candidate blob {key} does not exist", "not_found") from None
            if sha256_hex(blob) != sha:
                raise ServiceFailure(
                    422, f"candidate blob {key} failed its sha256 check", "invalid_adapter"
                ) from None
            return bytes(blob)

    async def _on_evaluate_request(self, req: Request) -> None:
        """Hand each evaluation to a task: micro handlers run one at a time, and the engine orders
        evaluations itself (a candidate on a publication's critical path before background pre-scoring)."""
        try:
            ev = decode(EvaluateCandidate, req.data)
        except WireError as exc:
            with contextlib.suppress(Exception):
                await respond_error(req, exc.code, str(exc), "invalid_request_error")
            return
        ctx = tracing.extract(req.headers or {})
        self._spawn(self._evaluate_and_reply(req, ev, ctx))

    async def _evaluate_and_reply(self, req: Request, ev: EvaluateCandidate, ctx: Any) -> None:
        with self.tracer.start_as_current_span(
            "evaluate", context=ctx, kind=SpanKind.SERVER,
            attributes={"collm.adapter": ev.adapter, "collm.round_id": ev.round_id or 0},
        ) as span:  # fmt: skip
            try:
                report = await self.evaluate(ev)
            except ServiceFailure as exc:
                span.set_status(Status(StatusCode.ERROR, exc.message))
                with contextlib.suppress(Exception):
                    await respond_error(req, exc.code, exc.message, exc.type)
                return
            except Exception as exc:  # noqa: BLE001 - answered, never left hanging
                log.exception("evaluation of %s failed", ev.adapter)
                with contextlib.suppress(Exception):
                    await respond_error(req, 500, f"evaluation failed: {type(exc).__name__}")
                return
            with contextlib.suppress(Exception):
                await req.respond(encode(report))

    async def _stored_version(self, adapter: str, version: int) -> tuple[bytes, str]:
        try:
            rec = await self.store.get_version(adapter, version)
            return await self.store.get_blob(adapter, version), rec.sha256
        except NotFound as exc:
            raise ServiceFailure(404, str(exc), "not_found") from None
        except CorruptBlob as exc:
            raise ServiceFailure(422, str(exc), "invalid_adapter") from None

    async def evaluate(self, req: EvaluateCandidate) -> EvalReport:
        """Held-out losses of the candidate (and, with `score_current`, of `current_version`; None: the
        base model) on this replica's eval split, per domain, with the digest of the items scored.
        Scoring a stored version on its own (`candidate_version`) is background work of a round still
        collecting: it yields to candidates waiting on a publication."""
        if req.candidate_version is not None:
            cand_blob, cand_digest = await self._stored_version(req.adapter, req.candidate_version)
        else:
            cand_blob = await self._read_candidate(req.candidate_key, req.candidate_sha256)
            cand_digest = req.candidate_sha256
        try:
            cand = decode_adapter(cand_blob)
            scored: list[tuple[str, Any, str | None]] = [("candidate", cand, cand_digest)]
            if req.score_current:
                if req.current_version is None:
                    scored.append(("current", None, "base"))
                else:
                    blob, digest = await self._stored_version(req.adapter, req.current_version)
                    scored.append(("current", decode_adapter(blob), digest))
        except ValueError as exc:
            raise ServiceFailure(422, f"not an adapter blob: {exc}", "invalid_adapter") from None
        try:
            runs = await asyncio.wrap_future(
                self.engine.evaluate(
                    [(label, w) for label, w, _ in scored],
                    req.max_examples,
                    adapter=req.adapter,
                    max_tokens=req.max_tokens,
                    digests=[d for _, _, d in scored],
                    priority=0 if req.candidate_version is not None else 1,
                    deadline_unix_s=req.deadline_unix_s,
                )
            )
        except AdapterMismatch as exc:
            raise ServiceFailure(422, str(exc), "invalid_adapter") from None
        cand_run = runs["candidate"]
        cur_run = runs.get("current")
        cand_loss = cand_run.per_domain()
        cur_loss = cur_run.per_domain() if cur_run is not None else {}
        losses = []
        for d in sorted(cand_loss):
            cand_examples, tokens = cand_run.example_losses(d)
            cur_examples = cur_run.example_losses(d)[0] if cur_run is not None else []
            losses.append(
                DomainLoss(
                    domain=d,
                    num_examples=cand_run.examples.get(d, 0),
                    num_tokens=cand_run.tokens.get(d, 0),
                    current_loss=cur_loss.get(d),
                    candidate_loss=cand_loss[d],
                    eval_set=cand_run.eval_set.get(d, ""),
                    example_tokens=tokens,
                    candidate_example_loss=cand_examples,
                    current_example_loss=cur_examples,
                )
            )
        return EvalReport(replica_id=self.rid, adapter=req.adapter, losses=losses)

    # ================================================================================== telemetry
    def telemetry(self) -> ReplicaTelemetry:
        snap = self.engine.snapshot()
        now = time.monotonic()
        counters = {
            "gen": float(snap.generated_tokens_total),
            "pre": float(snap.prefill_tokens_total),
            "arr": float(snap.arrivals_total),
            "ft": float(snap.ft_tokens_total),
            "infer_ms": snap.infer_ms_total,
            "train_ms": snap.train_ms_total,
            "t": now,
        }
        last = self._last or {**counters, "t": now - self.s.telemetry_interval_s}
        dt = max(1e-6, now - last["t"])
        rate = {k: (counters[k] - last[k]) / dt for k in ("gen", "pre", "arr", "ft", "infer_ms", "train_ms")}
        self._last = counters
        lat = snap.latency
        metrics.QUEUE.labels(self.rid).set(snap.queue_len)
        metrics.RUNNING.labels(self.rid).set(snap.running)
        metrics.KV_USED.labels(self.rid).set(snap.kv_used_frac)
        metrics.FT_SHARE.labels(self.rid).set(snap.ft_share)
        metrics.ADAPTERS.labels(self.rid).set(len(snap.adapters))
        round_role = self._round_role
        if round_role == "participant" and not any(j.round_id == self._round_id for j in snap.jobs):
            round_role = "idle"
        return ReplicaTelemetry(
            replica_id=self.rid,
            ts_unix_s=time.time(),
            interval_s=self.s.telemetry_interval_s,
            model=self.loaded.name,
            queue_len=snap.queue_len,
            running=snap.running,
            max_batch=snap.max_batch,
            kv_used_frac=snap.kv_used_frac,
            tokens_per_s=rate["gen"],
            prefill_tokens_per_s=rate["pre"],
            arrivals_per_s=rate["arr"],
            ttft_ms_p50=lat["ttft_ms_p50"],
            ttft_ms_p99=lat["ttft_ms_p99"],
            tpot_ms_p50=lat["tpot_ms_p50"],
            tpot_ms_p99=lat["tpot_ms_p99"],
            finished=int(lat["finished"] or 0),
            good=int(lat["good"] or 0),
            slo_attainment=lat["slo_attainment"],
            decode_step_ms=snap.decode_step_ms,
            prefill_ms_per_token=snap.prefill_ms_per_token,
            train_step_ms=snap.train_step_ms,
            infer_busy_frac=min(1.0, rate["infer_ms"] / 1e3),
            train_busy_frac=min(1.0, rate["train_ms"] / 1e3),
            ft_share=snap.ft_share,
            ft_share_source=snap.ft_share_source,  # type: ignore[arg-type]
            ft_tokens_per_s=rate["ft"],
            ft_loss=snap.ft_loss,
            training_jobs=snap.jobs,
            adapters=snap.adapters,
            round_role=round_role,  # type: ignore[arg-type]
            round_id=self._round_id,
            local_samples=snap.local_samples,
            domains=snap.domains,
        )

    async def _telemetry_loop(self) -> None:
        subject = subjects.telemetry(self.rid)
        while True:
            try:
                await self.bus.publish(subject, self.telemetry())
            except Exception as exc:  # noqa: BLE001 - telemetry is best effort; the next one is a full snapshot
                log.debug("telemetry not sent: %s", exc)
            if self.step_log is not None:
                self.step_log.flush()
            await asyncio.sleep(self.s.telemetry_interval_s)

    async def _on_status(self, _req: StatusRequest, _headers: Mapping[str, str]) -> ReplicaTelemetry:
        return self.telemetry()

    # ================================================================================== samples
    async def _samples_loop(self) -> None:
        from nats.js.api import AckPolicy, ConsumerConfig

        path = samples_dir(self.s) / SAMPLES_FILE
        sub = None
        while sub is None:
            try:
                sub = await self.bus.js.pull_subscribe(
                    subjects.samples(self.rid),
                    durable=f"replica-{self.rid}",
                    stream=subjects.STREAM_SAMPLES,
                    config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, max_ack_pending=256),
                )
            except Exception as exc:  # noqa: BLE001 - JetStream not ready yet
                log.debug("samples consumer not ready: %s", exc)
                await asyncio.sleep(2.0)
        try:
            await self._consume_samples(sub, path)
        finally:
            # A pull subscription left behind by a cancelled fetch holds the connection's drain (the last
            # step of a stop) for its whole drain timeout (30 s): the process would outlive a SIGTERM.
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _consume_samples(self, sub: Any, path: Path) -> None:
        while True:
            try:
                msgs = await sub.fetch(64, timeout=1.0)
            except TimeoutError:
                continue
            except Exception as exc:  # noqa: BLE001 - reconnecting
                log.debug("samples fetch failed: %s", exc)
                await asyncio.sleep(1.0)
                continue
            examples = []
            for m in msgs:
                try:
                    s = decode_payload(TrainingSample, m.data, m.headers)
                except WireError as exc:
                    log.warning("dropping a malformed training sample: %s", exc)
                    await m.term()
                    continue
                examples.append(Example(s.sample_id, s.prompt, s.response, s.system, s.domain or s.adapter))
            if examples:
                await asyncio.to_thread(_append_samples, path, examples)
                await asyncio.wrap_future(self.engine.add_examples(examples))
            for m in msgs:
                with contextlib.suppress(Exception):
                    await m.ack()


def _append_samples(path: Path, examples: list[Example]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        for e in examples:
            row = {"id": e.id, "prompt": e.prompt, "response": e.response}
            if e.system:
                row["system"] = e.system
            if e.domain:
                row["domain"] = e.domain
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
        f.flush()


async def serve(ctx: ServiceContext[ReplicaSettings]) -> None:
    """Enter model, bus, store and replica in order (unwound in reverse on stop)."""
    s = ctx.settings
    torch.set_num_threads(s.torch_threads)
    loaded = await asyncio.to_thread(
        load_model, s.model, device=s.device, cache_dir=s.model_cache_dir, tiny_seed=s.tiny_seed,
        max_model_len=s.max_model_len, matmul_dtype=s.matmul_dtype,
    )  # fmt: skip
    bus = await ctx.stack.enter_async_context(await Bus.connect(s, f"collm-replica-{s.replica_id}"))
    store = AdapterStore.from_url(s.redis_url, s.redis_prefix)
    ctx.stack.push_async_callback(store.close)
    replica = Replica(s, loaded, bus, store)
    await replica.start()
    ctx.stack.push_async_callback(replica.stop)
    await ctx.stopping.wait()
