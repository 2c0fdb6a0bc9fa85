"""The NATS layer every service talks through.

`Bus` owns one nats-py connection and gives services four things, each carrying W3C trace context
in headers and msgpack wire messages in payloads:

* `publish` / `subscribe` for events (telemetry, routing weights, publications);
* `request` for one reply (control commands), raising `BusError` on an error reply;
* `stream` for a request answered by many messages on an inbox (token streaming);
* `service` to register a NATS micro service (`$SRV.PING|INFO|STATS`, so `nats micro ls` sees it)
  whose endpoints decode their request, answer with wire messages (one: `MicroService.endpoint`; a
  stream, each request in its own task: `MicroService.stream_endpoint`), and turn refusals into error
  replies (micro's `Nats-Service-Error` and `Nats-Service-Error-Code` headers) instead of crashing.

Every endpoint registered through `MicroService.endpoint` also speaks JSON unless registered with
`json=False`: a request with the header `Content-Type: application/json` (`nats req SUBJECT '{...}' -H
Content-Type:application/json`) is validated against the same schema, refused with the same error reply,
and answered in JSON with that header (`collm_common.wire.decode_payload` / `encode_reply`). An empty
request body is the empty message. Streaming endpoints (a replica's token stream `generate`, `evaluate`)
and `json=False` ones (a replica's `cancel`) are msgpack only.

Every message `publish`, `request` and `stream` send is measured first, payload and headers together
(`message_size`), against the server's `max_payload`: one that does not fit raises `PayloadTooLarge`
(a `BusError` with code 413) and nothing is sent. (A message over the limit would otherwise make the
server close the whole connection.)

The first connection is retried until `nats_connect_timeout_s` (nats-py does not retry it), later
disconnects reconnect forever. Credentials (`nats_user`/`nats_password`, a token, a creds file, or
`nats://user:pass@host` in the URL) go to the server as they are; replies to this connection's requests
arrive under `inbox_prefix(...)`, per user, which is what a secured server (deploy/nats/auth.conf) allows.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlparse

import nats
import nats.micro
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.micro.request import Request, ServiceError
from nats.micro.service import Service
from opentelemetry import context as otel_context
from opentelemetry.trace import SpanKind, Status, StatusCode
from pydantic import BaseModel, TypeAdapter

from collm_common import tracing
from collm_common.settings import CommonSettings
from collm_common.wire import WireError, decode, decode_payload, encode, encode_reply
from collm_common.wire.base import WIRE_REJECTED, WireModel
from collm_common.wire.control import ErrorReply

log = logging.getLogger(__name__)

ERROR_HEADER = "Nats-Service-Error"
ERROR_CODE_HEADER = "Nats-Service-Error-Code"
STATUS_HEADER = "Status"

T = TypeVar("T")

DEFAULT_INBOX_PREFIX = "_INBOX"
_INBOX_USER = re.compile(r"[^\s.*>]+(?:\.[^\s.*>]+)*")
_URL_PASSWORD = re.compile(r"(//[^/:@]*):[^/@]*@")


def inbox_prefix(user: str | None, servers: Sequence[str] = ()) -> str:
    """Prefix of a connection's reply inboxes: `_INBOX.<user>` for a user that logs in by name (`user`,
    else the user of the first server URL `nats://user:pass@host`), else NATS's default `_INBOX`.

    A secured server (deploy/nats/auth.conf) lets each user subscribe only under its own prefix, so no
    service can read the replies (token streams, evaluation reports) meant for another; an open server
    accepts any prefix under `_INBOX`, so the per-user prefix changes nothing there.
    """
    name = user
    if name is None and servers:
        url = urlparse(servers[0].strip())
        if url.password is not None:  # `nats://token@host` names no user
            name = url.username
    if name and _INBOX_USER.fullmatch(name):
        return f"{DEFAULT_INBOX_PREFIX}.{name}"
    return DEFAULT_INBOX_PREFIX


def redact_url(url: str) -> str:
    """`url` with any password replaced by `***` (for logs and error messages)."""
    return _URL_PASSWORD.sub(r"\1:***@", url)


class ReplyError(Exception):
    """An error with an HTTP-like `code`, an OpenAI error `type`, a `message`, and where the request's body
    names them, the field at fault (`param`) and the OpenAI error code (`error_code`)."""

    default_type = "server_error"

    def __init__(
        self,
        code: int,
        message: str,
        type_: str | None = None,
        param: str | None = None,
        error_code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.type = type_ or self.default_type
        self.param = param
        self.error_code = error_code


class BusError(ReplyError):
    """An error reply, a missing responder (503) or a timeout (504), as a caller of `request` sees it."""


class PayloadTooLarge(BusError):
    """A message larger than the server's `max_payload` (payload and headers): it was not sent."""

    def __init__(self, subject: str, size: int, max_payload: int) -> None:
        super().__init__(
            413,
            f"a message of {size} bytes (payload and headers) does not fit in one NATS message "
            f"(at most {max_payload} bytes) for {subject}",
            "invalid_request_error",
        )
        self.size = size
        self.max_payload = max_payload


NATS_HEADER_LINE = b"NATS/1.0\r\n"


def message_size(payload: bytes, headers: Mapping[str, str] | None) -> int:
    """Bytes a message counts against the server's `max_payload`: its payload plus its header block
    (`NATS/1.0`, one `key: value` line per header, a blank line), as nats-py writes it; a message sent
    with headers `{}` still carries the block's first and last lines."""
    if headers is None:
        return len(payload)
    lines = sum(len(k.strip().encode()) + 2 + len(v.strip().encode()) + 2 for k, v in headers.items())
    return len(payload) + len(NATS_HEADER_LINE) + lines + 2


class NoResponders(BusError):
    def __init__(self, subject: str) -> None:
        super().__init__(503, f"no service is listening on {subject}", "service_unavailable")


class ServiceFailure(ReplyError):
    """Raise inside an endpoint handler to answer with an error reply (type `invalid_request_error`
    unless given)."""

    default_type = "invalid_request_error"


def error_of(msg: Msg, subject: str) -> BusError | None:
    """The error a reply message carries, if any (micro error headers or a 503 status)."""
    headers = msg.headers or {}
    if headers.get(STATUS_HEADER) == "503" and not msg.data:
        return NoResponders(subject)
    if ERROR_CODE_HEADER in headers:
        code_s = headers.get(ERROR_CODE_HEADER, "500")
        code = int(code_s) if code_s.isdigit() else 500
        text = headers.get(ERROR_HEADER, "error")
        type_, param, error_code = "server_error", None, None
        if msg.data:
            with contextlib.suppress(WireError):
                body = decode_payload(ErrorReply, msg.data, headers)
                text, type_, param, error_code = body.message, body.type, body.param, body.error_code
        return BusError(code, text, type_, param, error_code)
    return None


Handler = Callable[[Any, Mapping[str, str]], Awaitable[BaseModel | None]]
# A streaming endpoint's handler: the replies to one request, in order.
StreamHandler = Callable[[Any, Mapping[str, str]], AsyncIterator[BaseModel]]
# The body of an endpoint's error reply for a request (None: it did not decode) and the failure.
ErrorBody = Callable[[Any, "ServiceFailure"], BaseModel]
# Runs a coroutine in a task its caller owns (and cancels on stop).
Spawn = Callable[[Coroutine[Any, Any, None]], object]


class MicroService:
    """A NATS micro service; endpoints decode their request type and reply with wire messages.

    Every endpoint answers a request that does not decode (`WireError`) or a handler's `ServiceFailure`
    with an error reply (`_reply_error`): micro's error headers and, where the endpoint names one
    (`error_body`), a body; a request without a reply subject (a plain publish) gets no answer."""

    def __init__(self, bus: Bus, svc: Service) -> None:
        self.bus = bus
        self.svc = svc

    @property
    def id(self) -> str:
        return self.svc.id

    async def endpoint(
        self,
        name: str,
        subject: str,
        request_type: type[Any] | TypeAdapter[Any],
        handler: Handler,
        metadata: dict[str, str] | None = None,
        queue_group: str | None = None,
        json: bool = True,
        error_body: ErrorBody | None = None,
    ) -> None:
        """Serve `subject`, one request at a time. `handler(request, headers)` returns the reply.

        The request is decoded as `request_type` from msgpack, or (with `json`) from JSON when its headers
        say `Content-Type: application/json`; the reply goes back in the same format. Errors: see the
        class docstring (without `error_body`, micro's headers and an empty body)."""
        tracer = tracing.tracer("collm.bus")

        async def on_request(req: Request) -> None:
            headers = req.headers or {}
            with tracer.start_as_current_span(
                f"{name} process",
                context=tracing.extract(headers),
                kind=SpanKind.SERVER,
                attributes={"messaging.system": "nats", "messaging.destination.name": req.subject},
            ) as span:
                parsed = None
                try:
                    parsed = _decode_request(request_type, req, json)
                    reply = await handler(parsed, headers)
                except ServiceFailure as exc:
                    span.set_status(Status(StatusCode.ERROR, str(exc)))
                    await _reply_error(req, parsed, exc, error_body, json)
                    return
                if reply is not None and req._msg.reply:
                    body, reply_headers = encode_reply(reply, headers if json else None)
                    await req.respond(body, headers=reply_headers)

        await self._add(name, subject, on_request, metadata, queue_group)

    async def stream_endpoint(
        self,
        name: str,
        subject: str,
        request_type: type[Any] | TypeAdapter[Any],
        handler: StreamHandler,
        spawn: Spawn,
        error_body: ErrorBody,
        metadata: dict[str, str] | None = None,
    ) -> None:
        """Serve `subject` with a stream of replies per request (msgpack only), many requests at once.

        Each request is decoded as `request_type`, then `spawn` runs `handler(request, headers)` in a
        task; every message it yields goes to the request's reply inbox, in order (a reply that cannot be
        sent, the requester gone, is dropped). A `ServiceFailure` the handler raises is answered with an
        error reply whose body is `error_body(request, failure)`; any other exception with a 500."""

        async def run(req: Request, parsed: Any) -> None:
            try:
                async for msg in handler(parsed, req.headers or {}):
                    with contextlib.suppress(Exception):
                        await req.respond(encode(msg))
            except ServiceFailure as exc:
                await _reply_error(req, parsed, exc, error_body, False)
            except Exception as exc:  # noqa: BLE001 - answered, never left hanging
                log.exception("%s failed", name)
                failure = ServiceFailure(500, f"internal error: {type(exc).__name__}", "server_error")
                await _reply_error(req, parsed, failure, error_body, False)

        async def on_request(req: Request) -> None:
            try:
                parsed = _decode_request(request_type, req, False)
            except ServiceFailure as exc:
                await _reply_error(req, None, exc, error_body, False)
                return
            spawn(run(req, parsed))

        await self._add(name, subject, on_request, metadata, None)

    async def _add(
        self,
        name: str,
        subject: str,
        on_request: Callable[[Request], Awaitable[None]],
        metadata: dict[str, str] | None,
        queue_group: str | None,
    ) -> None:
        await self.svc.add_endpoint(
            name=name, subject=subject, handler=on_request, metadata=metadata, queue_group=queue_group
        )
        # The subscription is only buffered so far: a round trip makes the server hold it. (A request
        # from another connection can still meet "no responders" until that connection, too, has
        # round-tripped since: `Bus.sync`.)
        await self.bus.nc.flush()

    async def stop(self) -> None:
        await self.svc.stop()


def _decode_request(request_type: type[Any] | TypeAdapter[Any], req: Request, json: bool) -> Any:
    """The request as `request_type`; a `WireError` becomes a `ServiceFailure` of its code."""
    try:
        if json:
            return decode_payload(request_type, req.data, req.headers)
        return decode(request_type, req.data)
    except WireError as exc:
        raise ServiceFailure(exc.code, str(exc)) from None


async def _reply_error(
    req: Request, parsed: Any, exc: ServiceFailure, error_body: ErrorBody | None, json: bool
) -> None:
    """Answer `req` with the error reply of `exc` (see `MicroService`); counted in micro's `num_errors`
    when the endpoint has no body of its own (micro then writes the reply)."""
    if not req._msg.reply:
        return
    if error_body is None:
        # Raised as micro's ServiceError so that `nats micro stats` counts it in num_errors.
        raise ServiceError(str(exc.code), _header_safe(str(exc))) from None
    body_msg = error_body(parsed, exc)
    if json:
        body, body_headers = encode_reply(body_msg, req.headers)
    else:
        body, body_headers = encode(body_msg), None
    headers = {
        **(body_headers or {}),
        ERROR_HEADER: _header_safe(exc.message),
        ERROR_CODE_HEADER: str(exc.code),
    }
    with contextlib.suppress(Exception):
        await req.respond(body, headers=headers)


def _header_safe(text: str) -> str:
    return text.replace("\r", " ").replace("\n", " ")[:512]


async def respond_error(req: Request | Msg, code: int, message: str, type_: str = "server_error") -> None:
    """Answer a request with an error reply: micro's error headers plus an `ErrorReply` body, in JSON
    (with its `Content-Type`) when the request was JSON."""
    body, body_headers = encode_reply(ErrorReply(code=code, type=type_, message=message), req.headers)
    headers = {**(body_headers or {}), ERROR_HEADER: _header_safe(message), ERROR_CODE_HEADER: str(code)}
    if isinstance(req, Request):
        await req.respond(body, headers=headers)
    elif req.reply:
        await req._client.publish(req.reply, body, headers=headers)


@dataclass
class _Shared:
    """The handlers of one NATS subscription (`Bus.subscribe`)."""

    handlers: list[Any]
    sub: Any = None


class Subscription:
    """One handler's part of a shared NATS subscription (`Bus.subscribe`): `unsubscribe()` removes the
    handler, and the NATS subscription with its last handler."""

    def __init__(self, bus: Bus, key: tuple[str, str, Any], handler: Any) -> None:
        self._bus = bus
        self._key = key
        self._handler = handler

    @property
    def subject(self) -> str:
        return self._key[0]

    async def unsubscribe(self) -> None:
        await self._bus._drop_handler(self._key, self._handler)


class Bus:
    """One NATS connection with CoLLM's conventions (see module docstring)."""

    def __init__(self, nc: Client, name: str) -> None:
        self.nc = nc
        self.name = name
        self._js: JetStreamContext | None = None
        self._services: list[MicroService] = []
        self._subs: list[Any] = []
        # One NATS subscription per (subject, queue group, message type), shared by its handlers.
        self._shared: dict[tuple[str, str, Any], _Shared] = {}

    @classmethod
    async def connect(cls, settings: CommonSettings, name: str) -> Bus:
        """Connect, retrying the first connection for `nats_connect_timeout_s` (then ConnectionError)."""
        servers = [s.strip() for s in settings.nats_url.split(",")]

        last_error: list[str] = []  # why the first connection fails, a refused login first

        async def on_error(exc: Exception) -> None:
            text = str(exc)
            refused = "authorization violation" in text.lower()
            if refused or not (last_error and "authorization violation" in last_error[0].lower()):
                last_error[:] = [text]
            # A refused login, publish or subscription is a deployment error (or an attack): never quiet.
            if refused or "permissions violation" in text.lower():
                log.warning("nats: %s", text)
            else:
                log.info("nats: %s", exc)

        async def on_disconnect() -> None:
            log.warning("nats disconnected")

        async def on_reconnect() -> None:
            log.info("nats reconnected")

        # With max_reconnect_attempts=-1 nats-py also retries the *first* connection forever
        # (every reconnect_time_wait), so the deadline is what bounds it.
        try:
            nc = await asyncio.wait_for(
                nats.connect(
                    servers=servers,
                    name=name,
                    user=settings.nats_user,
                    password=settings.nats_password,
                    token=settings.nats_token,
                    user_credentials=settings.nats_creds_file,
                    inbox_prefix=inbox_prefix(settings.nats_user, servers),
                    allow_reconnect=True,
                    max_reconnect_attempts=-1,
                    reconnect_time_wait=0.5,
                    connect_timeout=2,
                    ping_interval=5,
                    max_outstanding_pings=2,
                    error_cb=on_error,
                    disconnected_cb=on_disconnect,
                    reconnected_cb=on_reconnect,
                ),
                timeout=settings.nats_connect_timeout_s,
            )
        except TimeoutError:
            why = f" (last error: {last_error[0]})" if last_error else ""
            raise ConnectionError(
                f"cannot reach NATS at {redact_url(settings.nats_url)} "
                f"within {settings.nats_connect_timeout_s:.0f}s{why}"
            ) from None
        return cls(nc, name)

    @property
    def connected(self) -> bool:
        return self.nc.is_connected

    @property
    def js(self) -> JetStreamContext:
        if self._js is None:
            self._js = self.nc.jetstream()
        return self._js

    async def close(self, drain_timeout_s: float | None = None) -> None:
        """Stop services, then drain (flushes pending publishes). With `drain_timeout_s`, a drain that
        takes longer (a subscription whose handler was cancelled mid-message, e.g. by Ctrl-C) gives way
        to closing the connection at once."""
        for svc in reversed(self._services):
            with contextlib.suppress(Exception):
                await svc.stop()
        self._services.clear()
        if self.nc.is_closed:
            return
        try:
            async with asyncio.timeout(drain_timeout_s):
                await self.nc.drain()
        except Exception:  # noqa: BLE001 - closing anyway
            with contextlib.suppress(Exception):
                await self.nc.close()

    async def __aenter__(self) -> Bus:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- events ------------------------------------------------------------------------------------
    async def sync(self) -> None:
        """Round-trip to the server. A service that has just started (its endpoints are in the server)
        can still be invisible to a request from this connection until it has round-tripped once since
        (seen against nats-server: 2-7 "no responders" in 30 requests without, none in 90 with)."""
        await self.nc.flush()

    def _packed(
        self, subject: str, msg: BaseModel, headers: dict[str, str] | None
    ) -> tuple[bytes, dict[str, str]]:
        """`msg` encoded and the headers it travels with (trace context added); PayloadTooLarge if the
        two do not fit in one message of this server."""
        payload, carrier = encode(msg), tracing.inject(headers)
        size = message_size(payload, carrier)
        if size > self.nc.max_payload:
            raise PayloadTooLarge(subject, size, self.nc.max_payload)
        return payload, carrier

    async def publish(self, subject: str, msg: BaseModel, headers: dict[str, str] | None = None) -> None:
        payload, carrier = self._packed(subject, msg, headers)
        await self.nc.publish(subject, payload, headers=carrier)

    async def subscribe(
        self,
        subject: str,
        message_type: type[T] | TypeAdapter[T],
        handler: Callable[[T, Msg], Awaitable[None]],
        queue: str = "",
    ) -> Subscription:
        """Subscribe; malformed messages, and messages on a subject their sender may not use
        (`WireModel.subject_error`), are counted (wire metrics) and dropped, never raised. Handlers of the
        same subject, queue group and message type share one NATS subscription: each message is decoded,
        checked and (when refused) counted once per connection, then handed to each handler in turn."""
        key = (subject, queue, message_type)
        shared = self._shared.get(key)
        if shared is not None:
            shared.handlers.append(handler)
            return Subscription(self, key, handler)
        shared = _Shared([handler])

        async def on_msg(raw: Msg) -> None:
            try:
                parsed = decode(message_type, raw.data)
            except WireError as exc:
                log.warning("dropped malformed message on %s: %s", raw.subject, exc)
                if raw.reply:
                    await respond_error(raw, exc.code, str(exc), "invalid_request_error")
                return
            wrong_subject = parsed.subject_error(raw.subject) if isinstance(parsed, WireModel) else None
            if wrong_subject is not None:
                WIRE_REJECTED.labels(parsed.schema_name, "subject").inc()
                log.warning("dropped message on %s: %s", raw.subject, wrong_subject)
                return
            for each in list(shared.handlers):
                token = otel_context.attach(tracing.extract(raw.headers))
                try:
                    await each(parsed, raw)
                except Exception:
                    log.exception("handler failed for %s", raw.subject)
                finally:
                    otel_context.detach(token)

        shared.sub = await self.nc.subscribe(subject, queue=queue, cb=on_msg)
        self._shared[key] = shared
        self._subs.append(shared.sub)
        return Subscription(self, key, handler)

    async def _drop_handler(self, key: tuple[str, str, Any], handler: Any) -> None:
        shared = self._shared.get(key)
        if shared is None or handler not in shared.handlers:
            return
        shared.handlers.remove(handler)
        if not shared.handlers:
            del self._shared[key]
            with contextlib.suppress(ValueError):
                self._subs.remove(shared.sub)
            await shared.sub.unsubscribe()

    # --- request / reply ---------------------------------------------------------------------------
    async def request(
        self,
        subject: str,
        msg: BaseModel,
        reply_type: type[T] | TypeAdapter[T],
        timeout_s: float = 5.0,
        headers: dict[str, str] | None = None,
    ) -> T:
        """One request, one reply. Raises BusError (error reply), NoResponders (503) or BusError 504.

        "No responders" is asked once more after a round trip (`sync`) before it is believed: a service
        that has just added its endpoint can be invisible to this connection for that long (seen in a
        fresh-clone test run, after both connections had round-tripped). The first request reached
        nobody, so sending it again cannot run it twice."""
        span_name = f"{subject} request"
        with tracing.tracer("collm.bus").start_as_current_span(
            span_name,
            kind=SpanKind.CLIENT,
            attributes={"messaging.system": "nats", "messaging.destination.name": subject},
        ):
            payload, carrier = self._packed(subject, msg, headers)
            try:
                try:
                    raw = await self.nc.request(subject, payload, timeout=timeout_s, headers=carrier)
                except nats.errors.NoRespondersError:
                    await self.sync()
                    raw = await self.nc.request(subject, payload, timeout=timeout_s, headers=carrier)
            except nats.errors.NoRespondersError:
                raise NoResponders(subject) from None
            except nats.errors.TimeoutError:
                raise BusError(504, f"no reply from {subject} within {timeout_s:.1f}s", "timeout") from None
            except (nats.errors.ConnectionClosedError, nats.errors.ConnectionReconnectingError) as exc:
                raise BusError(
                    503, f"NATS unavailable: {type(exc).__name__}", "service_unavailable"
                ) from None
            err = error_of(raw, subject)
            if err is not None:
                raise err
            try:
                return decode(reply_type, raw.data)
            except WireError as exc:
                raise BusError(502, f"bad reply from {subject}: {exc}", "bad_gateway") from None

    @contextlib.asynccontextmanager
    async def stream(
        self,
        subject: str,
        msg: BaseModel,
        headers: dict[str, str] | None = None,
        max_pending: int = 4096,
    ) -> AsyncIterator[StreamReplies]:
        """Send `msg` with a fresh inbox as reply subject and receive the replies until closed."""
        payload, carrier = self._packed(subject, msg, headers)
        inbox = self.nc.new_inbox()
        queue: asyncio.Queue[Msg] = asyncio.Queue(maxsize=max_pending)

        async def on_msg(raw: Msg) -> None:
            try:
                queue.put_nowait(raw)
            except asyncio.QueueFull:
                log.warning("stream %s overflowed; dropping a reply", inbox)

        try:
            sub = await self.nc.subscribe(inbox, cb=on_msg)
        except (nats.errors.ConnectionClosedError, nats.errors.ConnectionReconnectingError) as exc:
            raise BusError(503, f"NATS unavailable: {type(exc).__name__}", "service_unavailable") from None
        try:
            try:
                await self.nc.publish(subject, payload, reply=inbox, headers=carrier)
            except (nats.errors.ConnectionClosedError, nats.errors.ConnectionReconnectingError) as exc:
                raise BusError(
                    503, f"NATS unavailable: {type(exc).__name__}", "service_unavailable"
                ) from None
            yield StreamReplies(subject, queue)
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    # --- micro services ----------------------------------------------------------------------------
    async def service(
        self, name: str, version: str, description: str, metadata: dict[str, str] | None = None
    ) -> MicroService:
        svc = await nats.micro.add_service(
            self.nc, name=name, version=version, description=description, metadata=metadata or {}
        )
        micro = MicroService(self, svc)
        self._services.append(micro)
        return micro


class StreamReplies:
    """Replies of one `Bus.stream` call, in arrival order."""

    def __init__(self, subject: str, queue: asyncio.Queue[Msg]) -> None:
        self.subject = subject
        self._queue = queue

    async def next(self, timeout_s: float) -> Msg:
        """The next reply; raises NoResponders, BusError (error reply) or BusError 504 on timeout."""
        # Not `asyncio.wait_for`: on Python 3.11 it returns the item and drops a cancellation that arrives
        # as the item does, so a caller that cancels a stream consumer (a client gone) could keep reading.
        try:
            async with asyncio.timeout(timeout_s):
                raw = await self._queue.get()
        except TimeoutError:
            raise BusError(504, f"{self.subject} did not answer within {timeout_s:.1f}s", "timeout") from None
        err = error_of(raw, self.subject)
        if err is not None:
            raise err
        return raw
