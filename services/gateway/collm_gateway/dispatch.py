"""Sending one request to a replica over NATS and following its stream (the request path's I/O shell).

`Dispatcher.start` ranks the replicas (pure policy in `routing.py`), publishes the `GenerateRequest` to
the first one with `Bus.stream`, and waits for its first answer. A refusal before acceptance (no
responders, 429, 503, or silence past `first_event_timeout_s`, after which a cancel is sent so a late
acceptance cannot run twice) moves on to the next ranked replica, at most `max_retries` times.

Once a replica has accepted, `Generation.events` yields its token chunks, checks that `seq` runs 0, 1,
2, ... without a gap (a gap is a lost chunk: the stream fails with a clear error rather than return text
with a hole), enforces the first-token, inter-token and overall deadlines, and `Generation.aclose`
cancels the generation on the replica unless it already ended. The request stays on that replica once
it has produced a token. Before that, losing the replica is not the client's problem: when the replica
is gone (its telemetry stale and nobody answering its status subject) or answers 429/503 after
accepting (a replica shutting down fails its queue with 503), the same request (same id, same
deadline) is placed again on the other replicas, ranked afresh without the ones already lost, at most
`max_retries` times (counted in `collm_gateway_retries_total` as `lost_before_first_token` or
`refused_<code>_after_accept`). The events continue as if nothing happened, except that `replica_id`,
`adapter_version_id` and `attempts` now describe the new placement. A replica lost after its first token
fails the request with 503 `replica_lost`: the text already sent cannot be taken back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass

from nats.aio.msg import Msg
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from collm_common import subjects
from collm_common.bus import Bus, BusError, NoResponders, PayloadTooLarge, StreamReplies
from collm_common.clock import Clock
from collm_common.tracing import tracer
from collm_common.wire import WireError, decode
from collm_common.wire.admin import StatusRequest
from collm_common.wire.inference import (
    GENERATE_EVENT,
    Accepted,
    CancelRequest,
    Finished,
    GenerateError,
    GenerateRequest,
    TokenChunk,
)
from collm_common.wire.telemetry import ReplicaTelemetry
from collm_gateway import errors, metrics
from collm_gateway.cluster import ClusterView
from collm_gateway.errors import APIError
from collm_gateway.observe import GEN_AI_PROVIDER, response_attributes
from collm_gateway.routing import Choice, RoutingConfig, rank_replicas
from collm_gateway.settings import GatewaySettings

log = logging.getLogger(__name__)

# `StreamReplies.next` gets this as its own timeout; the real limits are enforced around it.
_NO_LIMIT_S = 1e9
# While a stream is silent, how often the replica's liveness (fresh telemetry) is checked.
LIVENESS_CHECK_S = 0.5
# A replica with stale telemetry is asked for its status; this long for an answer (see `replica_gone`).
LIVENESS_PROBE_S = 0.5


@dataclass(frozen=True)
class Refusal:
    """A replica said no (or nothing) before accepting: try the next one."""

    reason: str
    error: APIError


@dataclass
class _Leg:
    """One replica's part of a request: the stream it accepted, and what closes it (span, accounting)."""

    choice: Choice
    accepted: Accepted
    replies: StreamReplies
    stack: contextlib.AsyncExitStack
    span: trace.Span
    released: bool = False  # its stream closed and its span ended: the replica was lost

    @property
    def replica_id(self) -> str:
        return self.accepted.replica_id or self.choice.replica_id


class Generation:
    """One request accepted by a replica (by another one if the first is lost before the first token):
    its events, its timing, and its cancellation."""

    def __init__(
        self, dispatcher: Dispatcher, request: GenerateRequest, leg: _Leg, deadline_s: float, attempts: int
    ) -> None:
        self._d = dispatcher
        self.request = request
        self._leg = leg
        self.deadline_s = deadline_s
        self.attempts = attempts
        # Replicas this request was placed on and lost before its first token (in order).
        self.lost_replicas: list[str] = []
        self.first_token_s: float | None = None
        self.end_s: float | None = None
        self.finished: Finished | None = None
        self.completion_tokens = 0
        self._chunks = 0  # token chunks yielded, on every replica: once there is one, no failover
        self._next_seq = 0
        self._last_event_s = dispatcher.clock.monotonic()
        self._replica_done = False  # finished or failed on the replica's side: no cancel needed
        self._closed = False

    @property
    def choice(self) -> Choice:
        return self._leg.choice

    @property
    def accepted(self) -> Accepted:
        return self._leg.accepted

    @property
    def span(self) -> trace.Span:
        return self._leg.span

    @property
    def replica_id(self) -> str:
        return self._leg.replica_id

    @property
    def adapter_version_id(self) -> str:
        return self.finished.adapter_version_id if self.finished else self.accepted.adapter_version_id

    @property
    def prompt_tokens(self) -> int:
        return self.finished.prompt_tokens if self.finished else self.accepted.prompt_tokens

    async def events(self, heartbeat_s: float | None = None) -> AsyncIterator[TokenChunk | Finished | None]:
        """Token chunks then one `Finished`; `None` every `heartbeat_s` of silence (for SSE pings).

        Before the first chunk, a lost replica (or a 429/503 after acceptance) moves the request to
        another one (module docstring) and the events go on from there. Raises APIError on a timeout
        (504), a lost chunk or a malformed event (502), a replica gone mid-request (stale telemetry and
        no responders: 503 `replica_lost`; this gateway's NATS connection down: 503
        `nats_unavailable`), or the replica's own error (`errors.from_replica`).
        """
        clock = self._d.clock
        s = self._d.settings
        last_beat_s = clock.monotonic()
        while self.finished is None:
            now = clock.monotonic()
            waiting_first = self.first_token_s is None
            stage_s = s.first_token_timeout_s if waiting_first else s.inter_token_timeout_s
            limit_s = min(self._last_event_s + stage_s, self.deadline_s)
            wait_s = limit_s - now
            if wait_s <= 0:
                raise self._fail(self._timeout_error(waiting_first, stage_s))
            # Wake up at least every LIVENESS_CHECK_S (and every heartbeat) while waiting.
            step_s = min(wait_s, LIVENESS_CHECK_S, heartbeat_s or LIVENESS_CHECK_S)
            raw = await self._next_reply(step_s)
            if raw is None:
                if step_s >= wait_s:
                    raise self._fail(self._timeout_error(waiting_first, stage_s))
                if await self._moved_off_lost_replica():
                    continue
                if heartbeat_s and clock.monotonic() - last_beat_s >= heartbeat_s:
                    last_beat_s = clock.monotonic()
                    yield None
                continue
            event = await self._on_reply(raw)
            if event is not None:
                yield event

    async def _next_reply(self, step_s: float) -> Msg | None:
        """The replica's next reply, or None when `step_s` passes without one. Raises the APIError of an
        error reply on the stream."""
        try:
            async with asyncio.timeout(step_s):
                return await self._leg.replies.next(_NO_LIMIT_S)
        except TimeoutError:
            return None
        except BusError as exc:
            self._replica_done = True
            raise self._fail(
                errors.from_replica(exc.code, exc.message, exc.type, exc.param, error_code=exc.error_code)
            ) from None

    async def _moved_off_lost_replica(self) -> bool:
        """During a silence: whether the replica is gone and the request was moved to another one (True).
        False while it is alive; raises the 503 of a replica lost when the request cannot move (or of
        this gateway's NATS connection down)."""
        if self._d.cluster.is_fresh(self.replica_id) or not await self._d.replica_gone(self.replica_id):
            return False
        # A replica that died mid-request stops publishing telemetry: fail now rather than wait out the
        # token timeouts (its in-flight work is gone with it). Telemetry also stops arriving when this
        # gateway lost NATS itself: say which it was.
        if self._d.bus.connected and self._can_fail_over():
            await self._fail_over(
                f"replica {self.replica_id} was lost before the first token", "lost_before_first_token"
            )
            return True
        why = (
            f"replica {self.replica_id} stopped reporting telemetry while generating"
            if self._d.bus.connected
            else f"NATS connection lost while replica {self.replica_id} was generating"
        )
        raise self._fail(
            errors.APIError(
                503,
                why,
                code="replica_lost" if self._d.bus.connected else "nats_unavailable",
                headers={"Retry-After": str(self._d.settings.retry_after_s)},
            )
        )

    async def _on_reply(self, raw: Msg) -> TokenChunk | Finished | None:
        """Check and account one reply of the stream: the event to yield, or None when a refusal after
        acceptance moved the request to another replica. Raises APIError when the stream fails."""
        try:
            event = decode(GENERATE_EVENT, raw.data)
        except WireError as exc:
            raise self._fail(
                errors.protocol_error(f"replica {self.replica_id} sent a bad event: {exc}")
            ) from None
        self._last_event_s = self._d.clock.monotonic()
        if isinstance(event, TokenChunk):
            self._check_seq(event.seq)
            if event.token_ids and self.first_token_s is None:
                self.first_token_s = self._last_event_s
            self.completion_tokens += len(event.token_ids)
            self._chunks += 1
            return event
        if isinstance(event, Finished):
            return self._on_finished(event)
        if isinstance(event, GenerateError):
            self._replica_done = True
            if event.code in errors.RETRYABLE_REFUSALS and self._can_fail_over():
                await self._fail_over(
                    f"replica {self.replica_id} answered {event.code} after accepting: {event.message}",
                    f"refused_{event.code}_after_accept",
                )
                return None
            raise self._fail(
                errors.from_replica(
                    event.code,
                    event.message,
                    event.type,
                    event.param,
                    self._d.settings.retry_after_s,
                    event.error_code,
                )
            )
        raise self._fail(errors.protocol_error(f"replica {self.replica_id} sent a second Accepted"))

    def _on_finished(self, event: Finished) -> Finished:
        """The replica's end of the generation: the event when it completed, the APIError raised when it
        ended at its deadline or was cancelled."""
        self._check_seq(event.seq)
        self._replica_done = True
        self.end_s = self._last_event_s
        if event.finish_reason == "deadline":
            raise self._fail(errors.timeout("the replica dropped the request at its deadline"))
        if event.finish_reason == "cancelled":
            raise self._fail(
                errors.APIError(503, "the replica cancelled the generation", code="generation_cancelled")
            )
        self.finished = event
        self.completion_tokens = event.completion_tokens
        return event

    def _can_fail_over(self) -> bool:
        return self._chunks == 0 and len(self.lost_replicas) < self._d.settings.max_retries

    async def _fail_over(self, why: str, reason: str) -> None:
        """Release the lost replica's stream and place the request on another replica (or raise the
        APIError that says none could take it)."""
        s = self._d.settings
        lost = self.replica_id
        self.lost_replicas.append(lost)
        old = self._leg
        old.span.set_status(Status(StatusCode.ERROR, why))
        if not self._replica_done:  # cut off rather than dead: it must not go on generating
            await self._d.cancel(lost, self.request.request_id, "failover")
        old.released = True
        await old.stack.aclose()
        metrics.RETRIES.labels(reason).inc()
        log.warning(
            "request moved to another replica before its first token",
            extra={"request_id": self.request.request_id, "replica": lost, "reason": reason},
        )
        try:
            leg, tried = await self._d.place(self.request, self.deadline_s, frozenset(self.lost_replicas))
        except APIError as err:
            self._replica_done = True
            self.end_s = self._d.clock.monotonic()
            raise APIError(
                503,
                f"{why}, and no other replica could take the request: {err.message}",
                code="replica_lost",
                headers={"Retry-After": str(s.retry_after_s)},
            ) from None
        self._leg = leg
        self.attempts += tried
        self._next_seq = 0
        self._replica_done = False
        self._last_event_s = self._d.clock.monotonic()

    def _check_seq(self, seq: int) -> None:
        if seq != self._next_seq:
            lost = "lost" if seq > self._next_seq else "repeated"
            raise self._fail(
                errors.protocol_error(
                    f"token stream from replica {self.replica_id} broke: expected chunk seq {self._next_seq},"
                    f" got {seq} ({lost} chunk); the answer would have a hole, so it is not returned"
                )
            )
        self._next_seq += 1

    def _timeout_error(self, waiting_first: bool, stage_s: float) -> APIError:
        now = self._d.clock.monotonic()
        if now >= self.deadline_s:
            return errors.timeout(f"request deadline of {self._d.settings.request_deadline_s:.0f} s exceeded")
        if waiting_first:
            return errors.timeout(f"replica {self.replica_id} produced no token within {stage_s:.1f} s")
        return errors.timeout(f"replica {self.replica_id} went silent for {stage_s:.1f} s mid-stream")

    def _fail(self, err: APIError) -> APIError:
        self.end_s = self._d.clock.monotonic()
        if not self._leg.released:
            self.span.set_status(Status(StatusCode.ERROR, err.message))
        return err

    async def aclose(self, reason: str = "client_disconnected") -> None:
        """Release the stream; cancel on the replica if it is still generating. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if not self._replica_done:
                await self._d.cancel(self.replica_id, self.request.request_id, reason)
        finally:
            if self.end_s is None:
                self.end_s = self._d.clock.monotonic()
            if not self._leg.released:
                self.span.set_attribute("collm.adapter_version", self.adapter_version_id)
                self.span.set_attributes(
                    response_attributes(
                        self.adapter_version_id,
                        self._d.settings.base_model,
                        self.prompt_tokens,
                        self.completion_tokens,
                        self.finished.finish_reason if self.finished else None,
                    )
                )
                await self._leg.stack.aclose()


def exhausted(refusals: list[Refusal], retry_after_s: int, timeout_s: float) -> APIError:
    """The error of a request every replica tried refused: 429 when all queues were full, 504 when none
    answered within `timeout_s`, else 503 listing each refusal."""
    statuses = {r.error.status for r in refusals}
    if statuses == {429}:
        return errors.queues_full(retry_after_s, len(refusals))
    if statuses == {504}:
        return errors.timeout(f"no replica answered within {timeout_s:.1f} s ({len(refusals)} tried)")
    detail = "; ".join(f"{r.reason}: {r.error.message}" for r in refusals)
    return errors.no_replica(retry_after_s, f"no replica could take the request ({detail})")


def routing_config(settings: GatewaySettings) -> RoutingConfig:
    return RoutingConfig(
        telemetry_stale_s=settings.telemetry_stale_s,
        telemetry_stale_intervals=settings.telemetry_stale_intervals,
        weights_hold_frac=settings.weights_hold_frac,
        adapter_miss_penalty=settings.adapter_miss_penalty,
    )


class Dispatcher:
    def __init__(
        self,
        settings: GatewaySettings,
        bus: Bus,
        cluster: ClusterView,
        clock: Clock,
        rng: random.Random | None = None,
    ) -> None:
        self.settings = settings
        self.bus = bus
        self.cluster = cluster
        self.clock = clock
        self.rng = rng or random.Random()
        self.routing = cluster.routing
        self._tracer = tracer("collm.gateway")
        self._probes: dict[str, tuple[float, asyncio.Future[bool]]] = {}

    async def replica_gone(self, replica_id: str) -> bool:
        """Whether a replica whose telemetry went stale is really gone, so that its streams can fail now.

        Stale telemetry alone is not proof: a replica starved of CPU publishes it late. So the replica is
        asked for its status: "no responders" (no process subscribed: dead, or cut off from NATS) or this
        gateway's own NATS connection being down means gone; an answer, or no answer within
        `LIVENESS_PROBE_S` (busy), means alive, and its streams keep waiting, bounded by the token
        timeouts. One probe per replica per `LIVENESS_CHECK_S` serves every stream waiting on it."""
        if not self.bus.connected:
            return True
        now = self.clock.monotonic()
        probe = self._probes.get(replica_id)
        if probe is None or (probe[1].done() and now - probe[0] >= LIVENESS_CHECK_S):
            probe = (now, asyncio.ensure_future(self._probe(replica_id)))
            self._probes[replica_id] = probe
        return await asyncio.shield(probe[1])

    async def _probe(self, replica_id: str) -> bool:
        try:
            await self.bus.request(
                subjects.replica(replica_id, "status"), StatusRequest(), ReplicaTelemetry, LIVENESS_PROBE_S
            )
        except NoResponders:
            return True
        except BusError:  # busy (timeout) or an error reply: it is there
            return False
        return False

    async def start(self, req: GenerateRequest, deadline_s: float) -> Generation:
        """Get `req` accepted by a replica (retrying refusals), or raise APIError."""
        leg, attempts = await self.place(req, deadline_s)
        return Generation(self, req, leg, deadline_s, attempts)

    async def place(
        self, req: GenerateRequest, deadline_s: float, exclude: frozenset[str] = frozenset()
    ) -> tuple[_Leg, int]:
        """The accepted stream of `req` on the best-ranked replica not in `exclude` that takes it, and
        how many replicas were tried; APIError when none does."""
        s = self.settings
        if not self.bus.connected:
            raise errors.no_replica(s.retry_after_s, "NATS is unreachable")
        # Only the head of the ranking is tried: `max_retries + 1` replicas that are not excluded.
        decision = rank_replicas(
            self.cluster.snapshots(), self.cluster.weights(), req.adapter, self.rng.random(), self.routing,
            req.adapter_version, limit=s.max_retries + 1 + len(exclude),
        )  # fmt: skip
        metrics.WEIGHTS_FACTOR.set(decision.weights_factor)
        ranked = [c for c in decision.ranked if c.replica_id not in exclude]
        if not ranked:
            other = " other" if exclude else ""
            raise errors.no_replica(s.retry_after_s, f"no{other} replica has reported fresh telemetry")
        refusals: list[Refusal] = []
        for attempt, choice in enumerate(ranked[: s.max_retries + 1]):
            if attempt > 0:
                metrics.RETRIES.labels(refusals[-1].reason).inc()
            remaining_s = deadline_s - self.clock.monotonic()
            if remaining_s <= 0:
                raise errors.timeout("request deadline passed while looking for a replica")
            outcome = await self._attempt(
                req, choice, min(s.first_event_timeout_s, remaining_s), attempt + len(exclude)
            )
            if isinstance(outcome, _Leg):
                metrics.REPLICA_CHOICE.labels(outcome.replica_id, outcome.choice.source).inc()
                return outcome, attempt + 1
            log.info(
                "replica refused before accepting",
                extra={"request_id": req.request_id, "replica": choice.replica_id, "reason": outcome.reason},
            )
            refusals.append(outcome)
        raise exhausted(refusals, s.retry_after_s, s.first_event_timeout_s)

    async def _attempt(
        self, req: GenerateRequest, choice: Choice, timeout_s: float, attempt: int
    ) -> _Leg | Refusal:
        """Send `req` to `choice`'s replica and wait up to `timeout_s` for its first answer: the accepted
        leg, or the refusal to try the next replica with. Raises APIError when no replica could take it."""
        rid = choice.replica_id
        subject = subjects.replica(rid, "generate")
        stack = contextlib.AsyncExitStack()
        span = self._attempt_span(req, choice, subject, attempt)
        stack.callback(span.end)
        self.cluster.begin(rid)
        stack.callback(self.cluster.end, rid)
        try:
            try:
                with trace.use_span(span, end_on_exit=False):
                    replies = await stack.enter_async_context(self.bus.stream(subject, req))
                async with asyncio.timeout(timeout_s):
                    raw = await replies.next(_NO_LIMIT_S)
            except TimeoutError:
                await self.cancel(rid, req.request_id, "accept_timeout")
                return await self._refused(
                    stack,
                    span,
                    "accept_timeout",
                    errors.timeout(f"replica {rid} did not answer within {timeout_s:.1f} s"),
                )
            except PayloadTooLarge as exc:  # nothing was sent; no replica can take it
                raise errors.too_large_to_send(exc.size, exc.max_payload) from None
            except NoResponders as exc:
                return await self._refused(
                    stack, span, "no_responders", errors.from_replica(503, exc.message)
                )
            except BusError as exc:
                err = errors.from_replica(
                    exc.code, exc.message, exc.type, exc.param, self.settings.retry_after_s, exc.error_code
                )
                if exc.code in errors.RETRYABLE_REFUSALS:
                    return await self._refused(stack, span, f"refused_{exc.code}", err)
                raise err from None
            return await self._first_event(req, choice, raw, replies, stack, span)
        except BaseException as exc:
            if isinstance(exc, APIError):
                span.set_status(Status(StatusCode.ERROR, exc.message))
            await stack.aclose()
            raise

    def _attempt_span(self, req: GenerateRequest, choice: Choice, subject: str, attempt: int) -> trace.Span:
        """The client span of one attempt to place `req` on `choice`'s replica (started, not current)."""
        rid = choice.replica_id
        return self._tracer.start_span(
            f"generate {rid}",
            kind=SpanKind.CLIENT,
            attributes={
                "messaging.system": "nats",
                "messaging.destination.name": subject,
                "collm.request_id": req.request_id,
                "collm.replica": rid,
                "collm.adapter": req.adapter or "",
                "collm.attempt": attempt,
                "collm.routing_source": choice.source,
                "gen_ai.provider.name": GEN_AI_PROVIDER,
                "gen_ai.request.model": req.adapter or self.settings.base_model,
            },
        )

    async def _first_event(
        self,
        req: GenerateRequest,
        choice: Choice,
        raw: Msg,
        replies: StreamReplies,
        stack: contextlib.AsyncExitStack,
        span: trace.Span,
    ) -> _Leg | Refusal:
        """The replica's first answer on the stream: the accepted leg, a refusal (429/503) to try the next
        replica with; raises APIError on its other errors or a protocol error."""
        rid = choice.replica_id
        try:
            event = decode(GENERATE_EVENT, raw.data)
        except WireError as exc:
            await self.cancel(rid, req.request_id, "protocol_error")
            raise errors.protocol_error(f"replica {rid} sent a bad first event: {exc}") from None
        if isinstance(event, GenerateError):
            err = errors.from_replica(
                event.code,
                event.message,
                event.type,
                event.param,
                self.settings.retry_after_s,
                event.error_code,
            )
            if event.code in errors.RETRYABLE_REFUSALS:
                return await self._refused(stack, span, f"refused_{event.code}", err)
            raise err
        if not isinstance(event, Accepted):
            await self.cancel(rid, req.request_id, "protocol_error")
            raise errors.protocol_error(f"replica {rid} streamed {event.kind!r} before accepting the request")
        span.set_attribute("collm.adapter_version", event.adapter_version_id)
        span.set_attribute("collm.queue_position", event.queue_position)
        return _Leg(choice, event, replies, stack, span)

    async def _refused(
        self, stack: contextlib.AsyncExitStack, span: trace.Span, reason: str, err: APIError
    ) -> Refusal:
        span.set_status(Status(StatusCode.ERROR, f"{reason}: {err.message}"))
        await stack.aclose()
        return Refusal(reason, err)

    async def cancel(self, replica_id: str, request_id: str, reason: str) -> None:
        """Tell a replica to stop `request_id` (best effort: a lost cancel only wastes its time)."""
        metrics.CANCELS.labels(reason).inc()
        try:
            await self.bus.publish(
                subjects.replica(replica_id, "cancel"), CancelRequest(request_id=request_id, reason=reason)
            )
        except Exception as exc:  # NATS down: the replica's own deadline still bounds the work
            log.warning("cancel of %s on %s not sent: %s", request_id, replica_id, exc)
