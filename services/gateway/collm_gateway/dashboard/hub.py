"""The dashboard's I/O shell: NATS subscriptions, reads of the store and of other services, event streams.

* `start()` subscribes to replica telemetry (`subjects.telemetry_all()`), coordinator decisions
  (`subjects.coordinator_decisions()`), round events (`subjects.round_events_all()`) and adapter
  publications (`subjects.adapter_published_all()`); each message is folded into `DashboardState` and
  the updates it causes go to the connected streams that may see them.
* Reads run as background tasks, at most one per kind at a time (asked again while one runs, it runs
  once more afterwards): one adapter's record from the store (after its publication, a finished round,
  or a round of an adapter not seen yet), the store's adapter listing, the aggregator's round records
  (`subjects.aggregator("rounds")`) and the coordinator's status (`subjects.coordinator("status")`:
  its planned rounds, after each slow-loop decision and each round that opens or ends). With no client
  connected nothing is read; what would have been read is read for the next client's snapshot.
* `connect(viewer)`: before the snapshot, the listing, the round records and (for a viewer of the
  cluster) the coordinator's status are read again when older than `refresh_s`, waiting at most
  `read_timeout_s` (a part that does not answer is left out of the snapshot and arrives as updates).
  While clients are connected the listing and the coordinator's status are read every `refresh_s`.
* Each client has a queue of at most `queue_events` framed events; a client that falls that far behind
  is closed (its browser reconnects and starts again from a snapshot). `close_streams()` ends every
  stream (the server calls it when it shuts down: the streams never end on their own).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import RedisError

from collm_common import subjects
from collm_common.bus import Bus, BusError
from collm_common.clock import Clock
from collm_common.store import AdapterStore, NotFound, StoreError
from collm_common.wire.adapters import AdapterPublished
from collm_common.wire.admin import ListRounds, RoundList
from collm_common.wire.control import CoordinatorDecisions, CoordinatorStatus, CoordinatorStatusRequest
from collm_common.wire.rounds import RoundOutcome
from collm_common.wire.telemetry import ReplicaTelemetry
from collm_gateway import metrics
from collm_gateway.catalog import OWNER_FIELD
from collm_gateway.dashboard.state import (
    FINAL_ROUND_STATES,
    AdapterInfo,
    DashboardLimits,
    DashboardState,
    Update,
    VersionInfo,
    Viewer,
    num,
    sse_message,
)

log = logging.getLogger(__name__)

MAINTAIN_EVERY_S = 1.0
RETRY_MS = 2000
READ_ERRORS = (BusError, StoreError, RedisError, OSError, asyncio.TimeoutError)


@dataclass(eq=False)
class DashboardClient:
    viewer: Viewer
    queue: asyncio.Queue[str | None]
    closed: bool = False


@dataclass
class _Reads:
    """Background reads by key: the running task, whether to run again, when each last succeeded."""

    tasks: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    again: dict[str, Callable[[], Awaitable[None]]] = field(default_factory=dict)
    done_at: dict[str, float] = field(default_factory=dict)


async def load_adapter(store: AdapterStore, name: str, max_versions: int) -> AdapterInfo | None:
    """An adapter's owner, current version and newest versions with their quality; None if unlisted."""
    if name not in await store.list_adapters():
        return None
    current = await store.current(name)
    owner = (await store.meta(name)).get(OWNER_FIELD) or None
    versions = []
    for n in (await store.version_numbers(name))[-max_versions:]:
        try:
            rec = await store.get_version(name, n)
        except NotFound:
            continue
        versions.append(
            VersionInfo(
                version=n,
                created_unix_s=rec.created_unix_s,
                source=rec.source,
                round_id=rec.round_id,
                parent=rec.parent,
                pruned=rec.pruned,
                quality=await store.quality(name, n),
                task=await store.task_quality(name, n),
            )
        )
    return AdapterInfo(name, owner, current, tuple(versions))


class DashboardHub:
    def __init__(
        self,
        bus: Bus,
        store: AdapterStore,
        clock: Clock,
        *,
        limits: DashboardLimits | None = None,
        refresh_s: float = 10.0,
        read_timeout_s: float = 2.0,
        queue_events: int = 1000,
        ping_s: float = 15.0,
    ) -> None:
        self.bus = bus
        self.store = store
        self.clock = clock
        self.state = DashboardState(clock, limits)
        self.refresh_s = refresh_s
        self.read_timeout_s = read_timeout_s
        self.queue_events = queue_events
        self.ping_s = ping_s
        self._clients: set[DashboardClient] = set()
        self._subs: list[Any] = []
        self._reads = _Reads()
        self._maintainer: asyncio.Task[None] | None = None

    @property
    def clients(self) -> int:
        return len(self._clients)

    # --- lifecycle ------------------------------------------------------------------------------------------
    async def start(self) -> None:
        bus = self.bus
        self._subs += [
            await bus.subscribe(subjects.telemetry_all(), ReplicaTelemetry, self._on_telemetry),
            await bus.subscribe(subjects.coordinator_decisions(), CoordinatorDecisions, self._on_decisions),
            await bus.subscribe(subjects.round_events_all(), RoundOutcome, self._on_round),
            await bus.subscribe(subjects.adapter_published_all(), AdapterPublished, self._on_published),
        ]
        self._maintainer = asyncio.create_task(self._maintain(), name="dashboard-maintain")

    async def stop(self) -> None:
        self.close_streams()
        tasks = [t for t in (self._maintainer, *self._reads.tasks.values()) if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._maintainer = None
        self._reads = _Reads()
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._subs.clear()

    def close_streams(self) -> None:
        """End every open event stream now."""
        for c in list(self._clients):
            self._close(c, "shutdown")

    # --- inputs ---------------------------------------------------------------------------------------------
    async def _on_telemetry(self, t: ReplicaTelemetry, _raw: Any) -> None:
        self._send(self.state.on_telemetry(t))

    async def _on_decisions(self, d: CoordinatorDecisions, _raw: Any) -> None:
        self._send(self.state.on_decisions(d))
        if d.loop == "slow":
            self._read("coordinator", self._read_coordinator)

    async def _on_round(self, o: RoundOutcome, _raw: Any) -> None:
        if not self.state.knows_adapter(o.adapter):
            self._read_adapter(o.adapter)
        self._send(self.state.on_round(o))
        if o.state in FINAL_ROUND_STATES:
            self._read_adapter(o.adapter)
        if o.state == "opened" or o.state in FINAL_ROUND_STATES:
            self._read("coordinator", self._read_coordinator)

    async def _on_published(self, p: AdapterPublished, _raw: Any) -> None:
        self._read_adapter(p.name)

    # --- reads ----------------------------------------------------------------------------------------------
    def _read(
        self, key: str, fn: Callable[[], Awaitable[None]], force: bool = False
    ) -> asyncio.Task[None] | None:
        """Run `fn` in the background (once more afterwards if one is running). With no client
        connected (and not `force`), only note that it is due, for the next snapshot."""
        reads = self._reads
        if not force and not self._clients:
            reads.done_at.pop(key, None)
            return None
        running = reads.tasks.get(key)
        if running is not None and not running.done():
            reads.again[key] = fn
            return running
        task = asyncio.create_task(self._run_read(key, fn), name=f"dashboard-read-{key}")
        reads.tasks[key] = task
        task.add_done_callback(lambda t: reads.tasks.pop(key, None) if reads.tasks.get(key) is t else None)
        return task

    async def _run_read(self, key: str, fn: Callable[[], Awaitable[None]]) -> None:
        reads = self._reads
        while True:
            try:
                await fn()
                reads.done_at[key] = self.clock.monotonic()
            except READ_ERRORS as exc:
                log.debug("dashboard read %s failed: %s", key, exc)
            except Exception:
                log.exception("dashboard read %s failed", key)
            nxt = reads.again.pop(key, None)
            if nxt is None:
                return
            fn = nxt

    def _read_adapter(self, name: str) -> None:
        async def read() -> None:
            info = await load_adapter(self.store, name, self.state.limits.versions_per_adapter)
            self._send(self.state.on_adapter(info) if info is not None else self.state.remove_adapter(name))

        if self._clients:
            self._read(f"adapter:{name}", read)
        else:
            self._reads.done_at.pop("adapters", None)  # the next snapshot reads the listing again

    async def _read_listing(self) -> None:
        """The store's adapter listing; an adapter is read in full when it is new or its current
        version or owner changed."""
        infos = []
        for name in (await self.store.list_adapters())[: self.state.limits.adapters]:
            known = self.state.adapter(name)
            if known is not None:
                current = await self.store.current(name)
                owner = (await self.store.meta(name)).get(OWNER_FIELD) or None
                if known.current == current and known.owner == owner:
                    infos.append(known)
                    continue
            info = await load_adapter(self.store, name, self.state.limits.versions_per_adapter)
            if info is not None:
                infos.append(info)
        self._send(self.state.on_adapters(infos))

    async def _read_rounds(self) -> None:
        got = await self.bus.request(
            subjects.aggregator("rounds"),
            ListRounds(limit=self.state.limits.rounds),
            RoundList,
            timeout_s=self.read_timeout_s,
        )
        self._send(self.state.on_rounds(got.rounds))

    async def _read_coordinator(self) -> None:
        status = await self.bus.request(
            subjects.coordinator("status"),
            CoordinatorStatusRequest(),
            CoordinatorStatus,
            timeout_s=self.read_timeout_s,
        )
        self._send(self.state.on_coordinator_status(status))

    def _due(self, key: str) -> bool:
        done = self._reads.done_at.get(key)
        return done is None or self.clock.monotonic() - done >= self.refresh_s

    async def _maintain(self) -> None:
        while True:
            await self.clock.sleep(MAINTAIN_EVERY_S)
            self._send(self.state.expire())
            if not self._clients:
                continue
            if self._due("adapters"):
                self._read("adapters", self._read_listing)
            if self._due("coordinator") and any(c.viewer.cluster for c in self._clients):
                self._read("coordinator", self._read_coordinator)

    # --- clients --------------------------------------------------------------------------------------------
    async def snapshot(self, viewer: Viewer) -> dict[str, Any]:
        """What `viewer` may see now, after reading again what is older than `refresh_s`."""
        due = [("adapters", self._read_listing), ("rounds", self._read_rounds)]
        if viewer.cluster:
            due.append(("coordinator", self._read_coordinator))
        tasks = [t for key, fn in due if self._due(key) and (t := self._read(key, fn, force=True))]
        if tasks:
            await asyncio.wait(tasks, timeout=self.read_timeout_s)
        return self.state.snapshot(viewer)

    async def connect(self, viewer: Viewer) -> DashboardClient:
        """A new stream for `viewer`: its snapshot is the first event, updates follow."""
        snap = await self.snapshot(viewer)
        client = DashboardClient(viewer, asyncio.Queue(self.queue_events))
        client.queue.put_nowait(sse_message("snapshot", snap))
        self._clients.add(client)  # no await since the snapshot: every later update reaches the queue
        metrics.DASHBOARD_STREAMS.labels("opened").inc()
        return client

    def disconnect(self, client: DashboardClient) -> None:
        if client in self._clients:
            self._clients.discard(client)
            metrics.DASHBOARD_STREAMS.labels("client_gone").inc()

    async def events(self, client: DashboardClient) -> AsyncIterator[str]:
        """The framed events of one stream, with a keep-alive comment after `ping_s` of silence."""
        yield f"retry: {RETRY_MS}\n\n"
        try:
            while True:
                try:
                    item = await asyncio.wait_for(client.queue.get(), self.ping_s)
                except TimeoutError:
                    yield ": ping\n\n"
                    continue
                if item is None:
                    return
                yield item
        finally:
            self.disconnect(client)

    def _close(self, client: DashboardClient, why: str) -> None:
        client.closed = True
        self._clients.discard(client)
        while not client.queue.empty():
            client.queue.get_nowait()
        client.queue.put_nowait(None)
        metrics.DASHBOARD_STREAMS.labels(why).inc()

    def _send(self, updates: list[Update]) -> None:
        if not updates or not self._clients:
            return
        now = num(self.clock.now(), 3)
        for u in updates:
            text: str | None = None
            for c in list(self._clients):
                if c.closed or not u.visible_to(c.viewer):
                    continue
                if text is None:
                    text = sse_message(u.topic, {"now_unix_s": now, **u.payload})
                try:
                    c.queue.put_nowait(text)
                except asyncio.QueueFull:
                    log.info("dashboard stream fell %d events behind; closed", self.queue_events)
                    self._close(c, "overflow")
