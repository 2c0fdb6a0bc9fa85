"""`ReplicaDouble`: a process-free stand-in for a replica, for gateway tests only.

It speaks the replica's wire protocol over a real NATS server (libs/collm_common/wire/inference.py):
a `collm-replica` micro service whose metadata carries `replica_id`, a `generate` endpoint that answers
on the request's inbox with `Accepted` (or `GenerateError`, or a micro error reply), then `TokenChunk`s
numbered from 0, then `Finished` whose `seq` continues the numbering; a `cancel` endpoint that stops a
generation; and `ReplicaTelemetry` on `subjects.telemetry(id)`. There is no model: the answer is the
scripted `tokens`, one chunk each. Knobs in `ReplicaBehaviour` script refusals, silence, lost chunks and
mid-stream failures, and everything received (requests, their headers, cancels) is recorded for asserts.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from nats.micro.request import Request

from collm_common import subjects
from collm_common.bus import Bus, MicroService, respond_error
from collm_common.wire import WireError, decode, encode
from collm_common.wire.inference import (
    Accepted,
    CancelRequest,
    Finished,
    GenerateError,
    GenerateRequest,
    TokenChunk,
)
from collm_common.wire.telemetry import ReplicaTelemetry, ResidentAdapter


@dataclass
class ReplicaBehaviour:
    tokens: list[str] = field(default_factory=lambda: ["Hello", ",", " world", "!"])
    token_delay_s: float = 0.0
    accept_delay_s: float = 0.0
    # Refuse every request with a GenerateError of this code (429 queue full, 503, 404, ...).
    refuse_code: int | None = None
    refuse_message: str = "refused by the replica double"
    # Refuse with a micro error reply (Nats-Service-Error-Code header) instead.
    error_reply_code: int | None = None
    # Never answer at all.
    silent: bool = False
    # Skip this seq number (a lost chunk).
    skip_seq: int | None = None
    # Send a GenerateError after this many chunks (0: right after Accepted), with this code.
    fail_after_chunks: int | None = None
    fail_code: int = 500
    fail_message: str = "double failed mid-stream"
    # Refuse prompts longer than this many characters with 400 and the limits (like a context limit).
    max_prompt_chars: int | None = None
    prompt_tokens: int = 7


class ReplicaDouble:
    def __init__(
        self,
        bus: Bus,
        replica_id: str,
        behaviour: ReplicaBehaviour | None = None,
        *,
        adapters: Mapping[str, int] | None = None,
        model: str = "double",
        max_batch: int = 8,
        queue_len: int = 0,
        running: int = 0,
        telemetry_interval_s: float = 0.2,
    ) -> None:
        self.bus = bus
        self.replica_id = replica_id
        self.behaviour = behaviour or ReplicaBehaviour()
        self.adapters: dict[str, int] = dict(adapters or {})
        self.model = model
        self.max_batch = max_batch
        self.queue_len = queue_len
        self.running = running
        self.telemetry_interval_s = telemetry_interval_s
        self.requests: list[GenerateRequest] = []
        self.headers: list[dict[str, str]] = []
        self.cancels: list[CancelRequest] = []
        self.finished: list[Finished] = []
        self._cancelled: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._svc: MicroService | None = None
        self._telemetry_task: asyncio.Task[None] | None = None

    # --- lifecycle -----------------------------------------------------------------------------------------
    async def start(self, publish_telemetry: bool = True) -> ReplicaDouble:
        svc = await self.bus.service(
            subjects.SERVICE_REPLICA, "0.1.0", "replica test double", {"replica_id": self.replica_id}
        )
        self._svc = svc
        await svc.svc.add_endpoint(
            name="generate", subject=subjects.replica(self.replica_id, "generate"), handler=self._on_generate
        )
        await svc.endpoint(
            "cancel", subjects.replica(self.replica_id, "cancel"), CancelRequest, self._on_cancel
        )
        # `status` answers any body with the current telemetry, as the real replica does (the gateway asks
        # it when telemetry goes stale, to tell a slow replica from a dead one).
        await svc.svc.add_endpoint(
            name="status", subject=subjects.replica(self.replica_id, "status"), handler=self._on_status
        )
        if publish_telemetry:
            await self.publish_telemetry()
            self._telemetry_task = asyncio.create_task(self._telemetry_loop())
        return self

    async def stop(self) -> None:
        if self._telemetry_task is not None:
            self._telemetry_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._telemetry_task
            self._telemetry_task = None
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._svc is not None:
            with contextlib.suppress(Exception):
                await self._svc.stop()
            self._svc = None

    async def stop_telemetry(self) -> None:
        if self._telemetry_task is not None:
            self._telemetry_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._telemetry_task
            self._telemetry_task = None

    # --- telemetry ---------------------------------------------------------------------------------------
    def telemetry(self) -> ReplicaTelemetry:
        return ReplicaTelemetry(
            replica_id=self.replica_id,
            ts_unix_s=time.time(),
            interval_s=self.telemetry_interval_s,
            model=self.model,
            queue_len=self.queue_len,
            running=self.running,
            max_batch=self.max_batch,
            adapters=[
                ResidentAdapter(name=n, version_id=f"{n}@v{v}", version=v)
                for n, v in sorted(self.adapters.items())
            ],
        )

    async def _on_status(self, req: Request) -> None:
        await req.respond(encode(self.telemetry()))

    async def publish_telemetry(self) -> None:
        await self.bus.publish(subjects.telemetry(self.replica_id), self.telemetry())
        await self.bus.nc.flush()

    async def _telemetry_loop(self) -> None:
        while True:
            await asyncio.sleep(self.telemetry_interval_s)
            with contextlib.suppress(Exception):
                await self.publish_telemetry()

    # --- the protocol ------------------------------------------------------------------------------------
    async def _on_cancel(self, msg: CancelRequest, _headers: Mapping[str, str]) -> None:
        self.cancels.append(msg)
        self._cancelled.add(msg.request_id)

    async def _on_generate(self, req: Request) -> None:
        # Like the real replica, hand the work off: micro handlers run one at a time per subscription.
        task = asyncio.create_task(self._generate(req))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, req: Request, event: Any) -> None:
        await req.respond(encode(event))

    async def _generate(self, req: Request) -> None:
        b = self.behaviour
        try:
            msg = decode(GenerateRequest, req.data)
        except WireError as exc:
            await respond_error(req, exc.code, str(exc), "invalid_request_error")
            return
        self.requests.append(msg)
        self.headers.append(dict(req.headers or {}))
        rid = msg.request_id
        if b.silent:
            return
        if b.accept_delay_s:
            await asyncio.sleep(b.accept_delay_s)
        if b.error_reply_code is not None:
            await respond_error(req, b.error_reply_code, b.refuse_message, "service_unavailable")
            return
        if b.refuse_code is not None:
            await self._send(req, GenerateError(request_id=rid, code=b.refuse_code, message=b.refuse_message))
            return
        prompt_chars = sum(len(m.content) for m in msg.messages or []) + len(msg.prompt or "")
        if b.max_prompt_chars is not None and prompt_chars > b.max_prompt_chars:
            await self._send(
                req,
                GenerateError(
                    request_id=rid,
                    code=400,
                    type="invalid_request_error",
                    param="messages",
                    message=f"prompt is {prompt_chars} tokens, the limit is {b.max_prompt_chars}",
                ),
            )
            return
        if msg.adapter is not None and msg.adapter not in self.adapters:
            await self._send(
                req, GenerateError(request_id=rid, code=404, message=f"unknown adapter {msg.adapter}")
            )
            return
        version_id = "base"
        if msg.adapter is not None:
            version_id = f"{msg.adapter}@v{msg.adapter_version or self.adapters[msg.adapter]}"
        await self._send(
            req,
            Accepted(
                request_id=rid,
                replica_id=self.replica_id,
                adapter_version_id=version_id,
                prompt_tokens=b.prompt_tokens,
            ),
        )
        tokens = b.tokens[: msg.sampling.max_tokens]
        seq = 0
        sent = 0
        reason = "length" if len(b.tokens) >= msg.sampling.max_tokens else "stop"
        for i, text in enumerate(tokens):
            if rid in self._cancelled:
                reason = "cancelled"
                break
            if b.fail_after_chunks is not None and i == b.fail_after_chunks:
                await self._send(req, GenerateError(request_id=rid, code=b.fail_code, message=b.fail_message))
                return
            if b.token_delay_s:
                await asyncio.sleep(b.token_delay_s)
                if rid in self._cancelled:
                    reason = "cancelled"
                    break
            if b.skip_seq is not None and seq == b.skip_seq:
                seq += 1  # the chunk is "lost": never sent
            await self._send(req, TokenChunk(request_id=rid, seq=seq, token_ids=[100 + i], text=text))
            seq += 1
            sent += 1
        done = Finished(
            request_id=rid,
            seq=seq,
            finish_reason=reason,  # type: ignore[arg-type]
            prompt_tokens=b.prompt_tokens,
            completion_tokens=sent,
            adapter_version_id=version_id,
            replica_id=self.replica_id,
        )
        self.finished.append(done)
        await self._send(req, done)
