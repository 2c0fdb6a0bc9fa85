"""Training samples uploaded over HTTP (`POST /v1/samples`), published durably to JetStream.

Each sample goes to one replica's subject, `subjects.samples(replica_id)` in stream `COLLM_SAMPLES`,
where the replica's durable consumer writes it to its local data before acknowledging. The endpoint
answers only after JetStream acknowledged every sample of the batch, so a sample the client saw
accepted is never lost. A sample without `replica_id` goes to a replica that reports local data for
its `domain` (the fresh one holding the fewest samples, `choose_replica`); with neither, or no such
replica, the batch is refused with 422 before anything is published.

Every sample is published with `Nats-Msg-Id` = its `sample_id` (made up when the client sends none),
so a client that retries a batch after a failure does not add a sample twice within the stream's
duplicate window (an hour). The gateway itself retries a publish that failed transiently (`transient`:
no JetStream responder while a replicated stream elects a new leader after losing a NATS node, no
acknowledgement in time, the connection moving to another node) until `samples_ack_timeout_s` has
passed for that sample, and an upload that finds the connection down waits `RECONNECT_GRACE_S` for it
before the 503; an acknowledgement then reads `duplicate: true` when an earlier attempt (its
own, or an earlier upload's) had already stored the sample.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from nats.errors import Error as NatsError
from nats.js.api import PubAck
from nats.js.errors import APIError as JetStreamAPIError
from pydantic import ConfigDict, Field

from collm_common import subjects, tracing
from collm_common.bus import Bus
from collm_common.clock import Clock
from collm_common.streams import STREAMS, ensure_streams
from collm_common.wire import encode
from collm_common.wire.adapters import TrainingSample
from collm_gateway.cluster import ClusterView
from collm_gateway.errors import APIError
from collm_gateway.protocol import EdgeModel
from collm_gateway.settings import GatewaySettings

TOKEN_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
MSG_ID_HEADER = "Nats-Msg-Id"
# One attempt waits at most this long for its acknowledgement (less when the sample's time is nearly up),
# then the next attempt goes out this long after a failure.
ATTEMPT_TIMEOUT_S = 1.0
RETRY_PAUSE_S = 0.1
# An upload that finds the NATS connection down waits this long for it to come back (nats-py reconnects
# to another cluster node within about a second) before it is refused with 503.
RECONNECT_GRACE_S = 2.0
CONNECT_POLL_S = 0.05


def transient(exc: BaseException) -> bool:
    """Whether another attempt at the same publish may succeed: no responder (a stream without a leader
    while its replicas elect one), no acknowledgement in time, JetStream unavailable (a 5xx reply), the
    connection lost or moving to another server. A JetStream refusal (a 4xx reply) is final."""
    if isinstance(exc, JetStreamAPIError):
        return exc.code is None or exc.code >= 500
    return isinstance(exc, NatsError | TimeoutError | OSError)


class SampleIn(EdgeModel):
    model_config = ConfigDict(extra="forbid")

    replica_id: str | None = Field(None, pattern=TOKEN_PATTERN, description="Replica that keeps it.")
    domain: str | None = Field(None, min_length=1, max_length=64, description="Its domain (routing).")
    adapter: str | None = Field(None, pattern=TOKEN_PATTERN)
    prompt: str = Field(min_length=1)
    response: str = Field(min_length=1)
    system: str | None = None
    sample_id: str | None = Field(None, min_length=1, max_length=128, description="Idempotency key.")


class SamplesIn(EdgeModel):
    model_config = ConfigDict(extra="forbid")

    samples: list[SampleIn] = Field(min_length=1)


@dataclass(frozen=True)
class ReplicaData:
    """What routing a sample needs to know of one replica."""

    replica_id: str
    fresh: bool
    domains: tuple[str, ...]
    local_samples: int


def choose_replica(domain: str, replicas: Sequence[ReplicaData], pending: dict[str, int]) -> str | None:
    """The fresh replica with data for `domain` holding the fewest samples (counting `pending`, this
    batch's samples already sent there, so a batch spreads); ties by id. None when there is none."""
    fits = [r for r in replicas if r.fresh and domain in r.domains]
    if not fits:
        return None
    best = min(fits, key=lambda r: (r.local_samples + pending.get(r.replica_id, 0), r.replica_id))
    return best.replica_id


def replica_data(cluster: ClusterView) -> list[ReplicaData]:
    fresh = set(cluster.fresh_replicas())
    out = []
    for snap in cluster.snapshots():
        t = cluster.telemetry(snap.replica_id)
        if t is not None:
            out.append(ReplicaData(t.replica_id, t.replica_id in fresh, tuple(t.domains), t.local_samples))
    return out


class SampleIntake:
    def __init__(self, settings: GatewaySettings, bus: Bus, cluster: ClusterView, clock: Clock) -> None:
        self.settings = settings
        self.bus = bus
        self.cluster = cluster
        self.clock = clock
        self._streams_ready = False
        self._lock = asyncio.Lock()

    def plan(self, batch: SamplesIn) -> list[TrainingSample]:
        """Validate and route the whole batch (APIError 4xx) before anything is published."""
        s = self.settings
        if len(batch.samples) > s.max_samples_per_request:
            raise APIError(
                413,
                f"{len(batch.samples)} samples in one request; at most {s.max_samples_per_request}",
                param="samples",
                code="too_many_samples",
            )
        replicas = replica_data(self.cluster)
        pending: dict[str, int] = {}
        max_bytes = STREAMS[subjects.STREAM_SAMPLES].max_msg_size or 0
        now = self.clock.now()
        out = []
        for i, item in enumerate(batch.samples):
            rid = item.replica_id
            if rid is None:
                if item.domain is None:
                    raise APIError(
                        422,
                        f"sample {i} names neither replica_id nor domain: say which replica keeps it, or "
                        "its domain to send it to a replica with local data for that domain",
                        param=f"samples.{i}.replica_id",
                        code="no_replica_for_sample",
                    )
                rid = choose_replica(item.domain, replicas, pending)
                if rid is None:
                    known = sorted({d for r in replicas if r.fresh for d in r.domains})
                    raise APIError(
                        422,
                        f"sample {i}: no live replica reports local data for domain {item.domain!r} "
                        f"(domains with data: {known or 'none'}); name a replica_id instead",
                        param=f"samples.{i}.domain",
                        code="no_replica_for_sample",
                    )
            pending[rid] = pending.get(rid, 0) + 1
            sample = TrainingSample(
                sample_id=item.sample_id or f"smp-{uuid.uuid4().hex}",
                replica_id=rid,
                adapter=item.adapter,
                domain=item.domain,
                prompt=item.prompt,
                response=item.response,
                system=item.system,
                received_unix_s=now,
            )
            size = len(encode(sample))
            if max_bytes > 0 and size > max_bytes:
                raise APIError(
                    413,
                    f"sample {i} is {size} bytes encoded; the samples stream takes at most {max_bytes}",
                    param=f"samples.{i}",
                    code="sample_too_large",
                )
            out.append(sample)
        return out

    async def _ensure_streams(self) -> None:
        if self._streams_ready:
            return
        async with self._lock:
            if not self._streams_ready:
                await ensure_streams(self.bus.js, self.settings.nats_stream_replicas)
                self._streams_ready = True

    async def publish(self, samples: list[TrainingSample]) -> list[dict[str, Any]]:
        """Publish every sample and wait for each acknowledgement; APIError 503 names what was stored."""
        if not await self._connected_within(min(RECONNECT_GRACE_S, self.settings.samples_ack_timeout_s)):
            raise self._failed([], samples, "NATS is unreachable")
        try:
            await self._ensure_streams()
        except (NatsError, TimeoutError, OSError) as exc:
            raise self._failed(
                [], samples, f"JetStream is unavailable ({type(exc).__name__}: {exc})"
            ) from None
        acked: list[dict[str, Any]] = []
        for sample in samples:
            try:
                ack = await self._publish_one(sample)
            except (NatsError, TimeoutError, OSError) as exc:
                raise self._failed(acked, samples, f"{type(exc).__name__}: {exc}") from None
            acked.append(
                {
                    "sample_id": sample.sample_id,
                    "replica_id": sample.replica_id,
                    "stream": ack.stream,
                    "seq": ack.seq,
                    "duplicate": bool(ack.duplicate),
                }
            )
        return acked

    async def _connected_within(self, grace_s: float) -> bool:
        """Whether the NATS connection is up, or comes up within `grace_s` (it is moving to another node)."""
        deadline = self.clock.monotonic() + grace_s
        while not self.bus.connected:
            if self.clock.monotonic() >= deadline:
                return False
            await self.clock.sleep(CONNECT_POLL_S)
        return True

    async def _publish_one(self, sample: TrainingSample) -> PubAck:
        """Publish `sample` until JetStream acknowledges it, retrying transient failures until
        `samples_ack_timeout_s` has passed; raises the last failure."""
        headers = tracing.inject({MSG_ID_HEADER: sample.sample_id})
        deadline = self.clock.monotonic() + self.settings.samples_ack_timeout_s
        while True:
            remaining_s = deadline - self.clock.monotonic()
            try:
                return await self.bus.js.publish(
                    subjects.samples(sample.replica_id),
                    encode(sample),
                    timeout=max(0.001, min(ATTEMPT_TIMEOUT_S, remaining_s)),
                    stream=subjects.STREAM_SAMPLES,
                    headers=headers,
                )
            except (NatsError, TimeoutError, OSError) as exc:
                if not transient(exc) or self.clock.monotonic() + RETRY_PAUSE_S >= deadline:
                    raise
            await self.clock.sleep(RETRY_PAUSE_S)

    def _failed(self, acked: list[dict[str, Any]], samples: list[TrainingSample], why: str) -> APIError:
        stored = [a["sample_id"] for a in acked]
        more = f" (stored: {stored[:20]}{' ...' if len(stored) > 20 else ''})" if stored else ""
        return APIError(
            503,
            f"JetStream did not acknowledge sample {len(acked)} of {len(samples)}: {why}; "
            f"{len(acked)} were stored{more}. Retry the batch with the same sample_ids: duplicates are "
            "dropped.",
            code="samples_not_stored",
            headers={"Retry-After": str(self.settings.retry_after_s)},
        )
