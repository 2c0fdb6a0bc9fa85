"""The replica's adapter manager: the one way an adapter version becomes resident in the engine or leaves.

Verbs (all async, on the service's event loop; the engine's slot table stays inside the engine):

* `fetch(name, version)`: the version's blob from the Redis store (`AdapterStore`);
* `load(name, version, make_current=..., source=...)`: fetch it and install it into a free engine slot
  (`Engine.install_version`, a shadow swap at the next iteration boundary); concurrent loads of one
  version share one fetch; counted in `collm_replica_adapter_swaps_total{source}`;
* `ensure(name, version=None)`: `name@vN` resident (None: the store's current version, made current);
* `submit(request, sink, version)`: the request into the engine, its adapter version loaded when it is
  not resident (503 when it cannot be kept resident);
* `prefetch(name, version, make_current)`: `load` in the background, a failure only logged;
* `on_published(event)`: a newer current version of an adapter this replica serves or trains is loaded;
* `sync()` / `run_sync(interval_s)`: the store's current pointers re-read (lost events, reconnects; an
  adapter whose pointer is gone, unloaded, has no current version here any more);
* `create_initial(name)`: `name@v1` (a zero-B LoRA: the base model's behaviour) in the store, announced
  (on a closed bus adapter events are the aggregator's authority: the server refuses the announcement
  and the replica logs the violation; the others find v1 at their next `sync` or when it is named);
* `offload(version_id)`: the version's slot freed (`Engine.offload_version`).

Adapters "known" here (`track`) are the ones this replica serves or trains: the only ones that follow
publications. Every refusal is a `ReplicaError`: 404 unknown adapter or version, 409 creation conflict,
422 a blob this replica cannot serve, 500 a corrupt blob, 503 store unavailable or no slot free.
(Local refreshes of a training job's shadow happen inside the engine.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from collm_common import subjects
from collm_common.bus import Bus
from collm_common.clock import Clock, WallClock
from collm_common.lora import decode_adapter, encode_adapter
from collm_common.store import AdapterStore, Conflict, CorruptBlob, NotFound, StoreError, version_id
from collm_common.wire.adapters import AdapterPublished
from collm_replica import metrics
from collm_replica.engine import Engine, EngineRequest
from collm_replica.errors import NotResident, ReplicaError
from collm_replica.lora_bank import AdapterMismatch, LiveLora
from collm_replica.models import LoadedModel
from collm_replica.settings import ReplicaSettings
from collm_replica.tasks import Tasks

log = logging.getLogger(__name__)
ADMISSION_ATTEMPTS = 3  # submissions of a request whose adapter version had to be loaded first


class AdapterManager:
    """See module docstring."""

    def __init__(
        self,
        settings: ReplicaSettings,
        loaded: LoadedModel,
        engine: Engine,
        store: AdapterStore,
        bus: Bus,
        tasks: Tasks,
        clock: Clock | None = None,
    ) -> None:
        self.s = settings
        self.clock = clock or WallClock()
        self.rid = settings.replica_id
        self.loaded = loaded
        self.engine = engine
        self.store = store
        self.bus = bus
        self.known: set[str] = set()  # adapter names this replica serves or trains (kept in sync)
        # Adapters whose store pointer was last seen behind the served version: that pointer value.
        self.behind: dict[str, int] = {}
        self._loads: dict[str, asyncio.Future[str]] = {}
        self.tasks = tasks

    def track(self, name: str) -> None:
        """Follow `name`'s publications from now on (it is served or trained here)."""
        self.known.add(name)

    # ------------------------------------------------------------------------------- fetch / load
    async def fetch(self, name: str, version: int) -> bytes:
        """The blob of `name@v<version>` from the store (404 not stored, 500 corrupt)."""
        try:
            return await self.store.get_blob(name, version)
        except NotFound as exc:
            raise ReplicaError(404, str(exc), "not_found", param="model") from None
        except CorruptBlob as exc:
            raise ReplicaError(500, str(exc), "server_error") from None

    async def load(self, name: str, version: int, make_current: bool, source: str = "fetch") -> str:
        """Make `name@v<version>` resident (and, with `make_current`, the one its new requests get);
        returns its version id. Already so: returns at once; being loaded: waits for that load."""
        vid = version_id(name, version)
        if self.engine.is_resident(vid) and (not make_current or self.engine.current_version(name) == vid):
            return vid
        pending = self._loads.get(vid)
        if pending is not None:
            return await asyncio.shield(pending)
        fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._loads[vid] = fut
        try:
            blob = await self.fetch(name, version)
            try:
                weights = decode_adapter(blob)
                result = await asyncio.wrap_future(self.engine.install_version(vid, weights, make_current))
            except (ValueError, AdapterMismatch) as exc:
                raise ReplicaError(
                    422, f"{vid} cannot be served by this replica: {exc}", "invalid_adapter"
                ) from None
            metrics.SWAPS.labels(self.rid, source).inc()
            self.track(name)
            fut.set_result(result)
            return result
        except BaseException as exc:
            fut.set_exception(exc)
            fut.exception()  # retrieved: waiters re-raise it, nobody logs "never retrieved"
            raise
        finally:
            self._loads.pop(vid, None)

    async def submit(self, req: EngineRequest, sink: Any, version: int | None = None) -> None:
        """Submit `req` to the engine; while its adapter version (`version`, None: the current) is not
        resident, load it and try again, at most `ADMISSION_ATTEMPTS` times (then 503)."""
        for attempt in range(ADMISSION_ATTEMPTS):
            try:
                self.engine.submit(req, sink)
                return
            except NotResident:
                if attempt == ADMISSION_ATTEMPTS - 1:
                    msg = "adapter could not be kept resident"
                    raise ReplicaError(503, msg, "service_unavailable") from None
                assert req.adapter is not None
                await self.ensure(req.adapter, version)

    async def ensure(self, name: str, version: int | None = None) -> str:
        """Make `name@vN` (None: the store's current) resident; returns its version id."""
        try:
            current = await self.store.current(name)
        except StoreError as exc:
            raise ReplicaError(503, f"adapter store unavailable: {exc}", "service_unavailable") from None
        except Exception as exc:  # noqa: BLE001 - redis connection errors
            raise ReplicaError(
                503, f"adapter store unavailable: {type(exc).__name__}", "service_unavailable"
            ) from None
        if version is None:
            if current is None:
                raise ReplicaError(404, f"unknown adapter {name!r}", "not_found", param="model")
            version = current
        return await self.load(name, version, make_current=(version == current))

    def prefetch(self, name: str, version: int, make_current: bool) -> None:
        """`load` in a background task (one of `tasks`); a refusal is logged, never raised."""

        async def run() -> None:
            try:
                await self.load(name, version, make_current=make_current)
            except ReplicaError as exc:
                log.warning("%s not made resident: %s", version_id(name, version), exc.message)

        self.tasks.spawn(run())

    async def offload(self, vid: str) -> bool:
        """Free the engine slot of version `vid`: True once gone, False if it was not resident (409 while
        requests are bound to it)."""
        return await asyncio.wrap_future(self.engine.offload_version(vid))

    # ------------------------------------------------------------------------------- keeping up
    async def on_published(self, ev: AdapterPublished, _msg: Any = None) -> None:
        """A new current version: load it if this replica serves or trains that adapter."""
        if ev.name not in self.known and self.engine.current_version(ev.name) is None:
            return
        newest = self.engine.global_version(ev.name)
        if newest is not None and ev.version <= newest:
            return
        try:
            await self.load(ev.name, ev.version, make_current=True, source="published")
            log.info("swapped in %s (published)", ev.version_id)
        except ReplicaError as exc:
            log.warning("could not swap in %s: %s", ev.version_id, exc.message)

    async def sync(self) -> None:
        """Re-read the store's current pointer of every known adapter; load any newer version. An adapter
        whose pointer is gone (unloaded through the gateway) has no current version here any more, so a
        request that still reaches this replica for it, naming no version, is refused with 404. A pointer
        behind the newest version served here (moved outside a publication) is logged and counted
        (`collm_replica_catalog_behind_total`) once per pointer value, and the newer version kept."""
        for name in sorted(self.known):
            try:
                cur = await self.store.current(name)
            except Exception as exc:  # noqa: BLE001
                log.warning("adapter sync: store unavailable: %s", exc)
                return
            if cur is None:
                if self.engine.current_version(name) is not None:
                    self.engine.forget_current(name)
                    log.info("adapter %s has no current version in the store (unloaded): forgotten", name)
                continue
            newest = self.engine.global_version(name)
            if newest is None or cur > newest:
                self.behind.pop(name, None)
                with contextlib.suppress(ReplicaError):
                    await self.load(name, cur, make_current=True, source="sync")
            elif cur < newest and self.behind.get(name) != cur:
                # Versions only grow (a rollback publishes a new version), so a pointer behind what this
                # replica serves was moved outside a publication: keep serving, and say so once.
                self.behind[name] = cur
                metrics.CATALOG_BEHIND.labels(self.rid, name).inc()
                log.warning(
                    "adapter %s: the store's current pointer says v%d, behind v%d that this replica serves; "
                    "versions only grow, so the pointer was moved outside a publication: still serving v%d",
                    name, cur, newest, newest,
                )  # fmt: skip
            elif cur == newest:
                self.behind.pop(name, None)

    async def run_sync(self, interval_s: float) -> None:
        """`sync` now and every `interval_s` until cancelled."""
        while True:
            await self.sync()
            await self.clock.sleep(interval_s)

    async def create_initial(self, name: str) -> int:
        """Create `name@v1` (zero-B LoRA: the base model's behaviour) and announce it; returns its version
        number, or the store's current one if another replica created it first (409 if neither)."""
        ex = self.engine.executor
        live = LiveLora.init_new(self.s.lora_spec, ex.n_layers, ex.shapes, self.loaded.name)
        blob = encode_adapter(live.to_weights({"collm.created_by": self.rid}))
        try:
            rec = await self.store.publish(name, blob, expected_current=None, base_model=self.loaded.name,
                                           source="create")  # fmt: skip
        except Conflict:
            cur = await self.store.current(name)
            if cur is None:
                raise ReplicaError(409, f"could not create adapter {name!r}", "conflict") from None
            return cur
        await self.bus.publish(
            subjects.adapter_published(name),
            AdapterPublished(name=name, version=rec.version, version_id=rec.id, sha256=rec.sha256,
                             base_model=self.loaded.name, source="create", created_unix_s=rec.created_unix_s),
        )  # fmt: skip
        log.info("created %s", rec.id)
        return rec.version
