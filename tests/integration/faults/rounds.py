"""Federated rounds driven by the fault scenarios: adapters to train, rounds opened on the aggregator,
their events watched on the bus, and the store's versions verified afterwards."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from collm_common import subjects
from collm_common.bus import Bus, BusError
from collm_common.lora import decode_adapter
from collm_common.store import AdapterStore, StoreError, sha256_hex
from collm_common.wire.control import ControlReply, StartTraining, SyncAdapter
from collm_common.wire.rounds import ParticipantPlan, RoundOutcome, RoundPlan

from .harness import SHARE_TTL_S, FaultStack, replica_status, wait_for

FINAL_STATES = ("published", "held_back", "aborted")


async def ensure_adapter(fs: FaultStack, bus: Bus, store: AdapterStore, name: str) -> int:
    """`name` exists and its current version is resident on every replica; returns that version."""
    if await store.current(name) is None:
        # A replica creates v1 itself (zero-B LoRA of its base model) on StartTraining without a base.
        reply = await bus.request(
            subjects.replica(fs.replicas[0], "control"),
            StartTraining(adapter=name, token_budget=1),
            ControlReply,
            timeout_s=30,
        )
        assert reply.ok, reply.message
        await wait_for(lambda: store.current(name), 20, f"{name}@v1")
    version = await store.current(name)
    assert version is not None
    for rid in fs.replicas:
        reply = await bus.request(
            subjects.replica(rid, "control"), SyncAdapter(adapter=name, version=version), ControlReply, 30
        )
        assert reply.ok, reply.message
    return version


async def verify_versions(store: AdapterStore, name: str) -> dict[str, Any]:
    """Every version of `name`: its record, and its blob read back through the store (which checks the
    sha256 against the record) and decoded as an adapter. A pruned blob counts as pruned, not broken."""
    found: dict[int, str] = {}
    broken: list[str] = []
    pruned: list[int] = []
    for rec in await store.list_versions(name):
        found[rec.version] = rec.sha256
        if rec.pruned:
            pruned.append(rec.version)
            continue
        try:
            blob = await store.get_blob(name, rec.version)
            if sha256_hex(blob) != rec.sha256 or len(blob) != rec.size_bytes:
                broken.append(f"v{rec.version}: digest or size differs from its record")
            decode_adapter(blob)
        except (StoreError, ValueError) as exc:
            broken.append(f"v{rec.version}: {type(exc).__name__}: {exc}")
    return {"versions": found, "broken": broken, "pruned": pruned, "current": await store.current(name)}


class RoundWatch:
    """Round events and local updates seen on the bus (the test client's own subscriptions)."""

    def __init__(self) -> None:
        self.events: list[tuple[float, RoundOutcome]] = []
        self.updates: list[tuple[float, str]] = []
        # Called with each event as it arrives (to act at an exact moment of the round, e.g. a kill).
        self.hooks: list[Callable[[RoundOutcome], None]] = []

    async def attach(self, bus: Bus) -> RoundWatch:
        async def on_event(o: RoundOutcome, _m: object) -> None:
            self.events.append((time.monotonic(), o))
            for hook in self.hooks:
                hook(o)

        async def on_update(raw: Any) -> None:
            self.updates.append((time.monotonic(), raw.subject))

        await bus.subscribe(subjects.round_events_all(), RoundOutcome, on_event)
        await bus.nc.subscribe(subjects.updates_all(), cb=on_update)
        return self

    def state(self, round_id: int, state: str) -> tuple[float, RoundOutcome] | None:
        return next(((t, o) for t, o in self.events if o.round_id == round_id and o.state == state), None)

    def final(self, round_id: int) -> tuple[float, RoundOutcome] | None:
        return next(
            ((t, o) for t, o in self.events if o.round_id == round_id and o.state in FINAL_STATES), None
        )

    def last_state(self, round_id: int) -> str | None:
        states = [o.state for _, o in self.events if o.round_id == round_id]
        return states[-1] if states else None

    def updates_of(self, round_id: int) -> list[float]:
        token = f".updates.{round_id}."
        return [t for t, s in self.updates if token in s]


async def answers(fs: FaultStack, bus: Bus, name: str) -> bool:
    return (await fs.answering(bus, 1.0)).get(name, False)


async def open_round(
    bus: Bus,
    adapter: str,
    base_version: int,
    participants: dict[str, int],
    quorum: int,
    deadline_s: float,
    learning_rate: float = 5e-3,
) -> RoundOutcome:
    now = time.time()
    plan = RoundPlan(
        adapter=adapter,
        base_version=base_version,
        participants=[
            ParticipantPlan(replica_id=r, token_budget=b, learning_rate=learning_rate)
            for r, b in participants.items()
        ],
        quorum=quorum,
        opened_unix_s=now,
        deadline_unix_s=now + deadline_s,
        policy="faults",
    )
    # Retried: right after an aggregator restart its endpoint may not be registered yet.
    end = time.monotonic() + 30
    while True:
        try:
            return await bus.request(subjects.aggregator("open_round"), plan, RoundOutcome, timeout_s=10)
        except BusError as exc:
            if exc.code != 503 or time.monotonic() > end:
                raise
            await asyncio.sleep(0.2)


@contextlib.asynccontextmanager
async def coordinator_stopped(fs: FaultStack, bus: Bus) -> AsyncIterator[None]:
    """Rounds opened here (directly on the aggregator, as an operator or the aggregator's built-in planner
    does) train only without the coordinator: it grants fine-tuning shares only to rounds it planned
    itself, and gives share 0 to a replica in none of them. So the coordinator is stopped (SIGTERM) and
    the rounds run once every replica is back on its local default share; it is restarted afterwards."""
    if not fs.with_coordinator:
        yield
        return
    await asyncio.to_thread(fs.s.kill, "coordinator", signal.SIGTERM)

    async def local_shares() -> bool:
        states = [await replica_status(bus, r) for r in fs.replicas]
        return all(st is not None and st.ft_share_source == "local_default" for st in states)

    try:
        await wait_for(local_shares, SHARE_TTL_S + 10, "replicas on their local share")
        yield
    finally:
        await asyncio.to_thread(fs.s.restart, "coordinator")
