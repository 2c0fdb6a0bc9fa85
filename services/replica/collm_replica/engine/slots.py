"""The adapter slot table: which versions are resident in which LoRA-bank slot, the current version of
each adapter, installs into the bank and the LRU eviction of idle versions.

The table is shared with the service threads: its records are read and changed under the engine's lock
(`lock`); installs (copies into the bank) run in the engine thread, at an iteration boundary.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future

from collm_common.lora import AdapterWeights
from collm_common.wire.telemetry import ResidentAdapter
from collm_replica.engine.types import BASE, EngineConfig, EngineRefusal, parse_version_id
from collm_replica.lora_bank import LoraBank, parse_adapter
from collm_replica.lru import VersionLru

log = logging.getLogger(__name__)


class NoSlot(Exception):
    """Every slot holds a version pinned by in-flight requests."""


class Slots:
    """Resident adapter versions and their LoRA-bank slots (`cfg.max_resident_adapters` of them)."""

    def __init__(
        self,
        cfg: EngineConfig,
        bank: LoraBank,
        n_layers: int,
        shapes: dict,
        lock: threading.Lock,
        clock: Callable[[], float],
    ) -> None:
        self.cfg = cfg
        self.bank = bank
        self.n_layers = n_layers
        self.shapes = shapes
        self._lock = lock
        self.clock = clock
        self._lru = VersionLru(cfg.max_resident_adapters)
        self._global_current: dict[str, int] = {}  # newest store version installed, by adapter
        self._refresh_counter: dict[str, int] = {}  # local refreshes made, by base version id
        # Each resident version's installation (a number no other installation had): the prefix cache's
        # salt, so KV computed with one installation's weights is never read with another's.
        self._installs: dict[str, int] = {}
        self._install_serial = itertools.count(1)
        # Installs waiting for a free slot: (deadline on the engine's clock, attempt -> finished).
        self.pending: list[tuple[float, Callable[[], bool]]] = []

    # --- read from any thread -------------------------------------------------------------------------
    def current_version(self, name: str) -> str | None:
        with self._lock:
            return self._lru.current_of(name)

    def is_resident(self, version_id: str) -> bool:
        with self._lock:
            return version_id in self._lru

    def global_version(self, name: str) -> int | None:
        """The newest store version of `name` installed here (local refreshes not counted)."""
        with self._lock:
            return self._global_current.get(name)

    def forget_current(self, name: str) -> None:
        """`name` has no current version any more (unloaded): a request that names no version finds none
        resident; versions stay resident for requests pinned to them until evicted."""
        with self._lock:
            self._lru.clear_current(name)
            self._global_current.pop(name, None)

    def resident(self, training: Callable[[str], bool]) -> list[ResidentAdapter]:
        """The resident versions, by version id (caller holds the lock); `training(name)`: a job trains it."""
        return [
            ResidentAdapter(
                name=r.name,
                version_id=r.version_id,
                version=parse_version_id(r.version_id)[1],
                in_flight=r.refs,
                training=training(r.name),
            )
            for r in sorted(self._lru.by_id.values(), key=lambda r: r.version_id)
        ]

    # --- request binding (caller holds the lock) ------------------------------------------------------
    def resolve(self, adapter: str, version_id: str | None) -> str | None:
        """The version a request for `adapter` binds to (`version_id`, else the current one), if resident."""
        vid = version_id or self._lru.current_of(adapter) or ""
        return vid if vid in self._lru else None

    def cache_salt(self, version_id: str) -> str:
        """What names the weights of a resident version (`BASE`: the base model's) in the prefix cache's
        keys: the version id and its installation, so a version offloaded and installed again, or a new
        version or local refresh, never reads KV blocks another installation computed."""
        if version_id == BASE:
            return BASE
        return f"{version_id}#{self._installs[version_id]}"

    def acquire(self, version_id: str) -> int:
        """Pin `version_id` for a request; its slot."""
        return self._lru.acquire(version_id).slot

    def release(self, version_id: str) -> None:
        """Unpin a request's version (the base model holds no slot)."""
        if version_id != BASE and version_id in self._lru:
            self._lru.release(version_id)

    # --- installs (engine thread) ---------------------------------------------------------------------
    def prepare_install(
        self, version_id: str, weights: AdapterWeights, make_current: bool, timeout_s: float
    ) -> tuple[Future[str], float, Callable[[], bool]]:
        """Check a store version and make its install: (the future of its version id, the deadline, the
        attempt the engine thread runs at iteration boundaries until it returns True). The future fails
        with EngineRefusal 503 if no slot frees up by the deadline (all in use)."""
        name, number, local = parse_version_id(version_id)
        parsed = parse_adapter(weights, self.n_layers, self.shapes, self.cfg.lora_targets)
        if weights.spec.r > self.cfg.lora_max_rank:
            raise EngineRefusal(
                400, f"adapter rank {weights.spec.r} exceeds the replica's max {self.cfg.lora_max_rank}"
            )
        fut: Future[str] = Future()
        deadline = self.clock() + timeout_s

        def attempt() -> bool:
            try:
                self.install(version_id, name, parsed, weights.spec.scaling, make_current)
            except NoSlot:
                if self.clock() < deadline:
                    return False
                fut.set_exception(EngineRefusal(503, "every adapter slot is in use", "service_unavailable"))
                return True
            except Exception as exc:  # noqa: BLE001 - report to the caller
                fut.set_exception(exc)
                return True
            if local is None and make_current:
                with self._lock:
                    self._global_current[name] = max(number, self._global_current.get(name, 0))
            fut.set_result(version_id)
            return True

        return fut, deadline, attempt

    def run_pending(self) -> None:
        """Attempt the waiting installs; keep those still waiting for a slot."""
        if self.pending:
            self.pending = [(d, a) for d, a in self.pending if not a()]

    def install(self, version_id: str, name: str, parsed: dict, scaling: float, make_current: bool) -> None:
        """Copy parsed weights into a free slot (evicting the least recently used idle version); NoSlot."""
        with self._lock:
            if version_id in self._lru:
                if make_current:
                    self._lru.make_current(version_id)
                return
            choice = self._lru.slot_for_new()
            if choice is None:
                raise NoSlot()
            slot, victim = choice
            if victim is not None:
                self._lru.evict(victim.version_id)
                self._installs.pop(victim.version_id, None)
        # Outside the lock: nobody can acquire this slot (it is in no version's record now).
        self.bank.write_parsed(slot, parsed, scaling)
        with self._lock:
            self._lru.add(version_id, name, slot, current=make_current)
            self._installs[version_id] = next(self._install_serial)
        log.info("adapter %s resident in slot %d%s", version_id, slot, " (current)" if make_current else "")

    def offload(self, version_id: str) -> bool:
        """Free the slot of `version_id`: True once it is gone, False if it was not resident; EngineRefusal
        409 while requests are bound to it."""
        with self._lock:
            res = self._lru.by_id.get(version_id)
            if res is None:
                return False
            if res.refs:
                raise EngineRefusal(409, f"{version_id} is in use by {res.refs} request(s)", "conflict")
            self._lru.evict(version_id)
            self._installs.pop(version_id, None)
        log.info("adapter %s offloaded from slot %d", version_id, res.slot)
        return True

    def install_refresh(
        self, name: str, base_version_id: str, weights: Callable[[], dict], scaling: float
    ) -> str | None:
        """Install a local refresh `<base_version_id>+<replica>.<k>` of `name` (its parsed weights taken by
        `weights()` once a slot is free) as the current version; its version id, or None when no slot is
        free."""
        with self._lock:
            has_slot = self._lru.slot_for_new() is not None
        if not has_slot:
            return None
        k = self._refresh_counter.get(base_version_id, 0) + 1
        version_id = f"{base_version_id}+{self.cfg.replica_id}.{k}"
        try:
            self.install(version_id, name, weights(), scaling, make_current=True)
        except NoSlot:
            return None
        self._refresh_counter[base_version_id] = k
        return version_id
