"""A round's collection of updates (step 2 of the `runner` timeline): the participants started, their
updates validated and entered in the round machine until it decides to close.

`UpdateCollection` holds what the collection needs beside the machine: the round's base version (read
once by `start`; every update is checked against it with `validation.check_tensors`, a stale update
against the version it was trained from), the tensors of the accepted updates (`weighted`: the
aggregation's input), the digest first seen from each replica (a redelivery is not processed twice), and
the lock and wake-up that order `deliver` and `refuse` (the intake's consumer) and the refusals of
`start_participants` against the machine's poll in `wait_for_close`.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from collm_aggregator import metrics
from collm_aggregator.machine import Abort, Admitted, Close, Entry, Late, Phase, RoundMachine
from collm_aggregator.strategies import WeightedUpdate
from collm_aggregator.validation import (
    DIGEST,
    MISSING_BLOB,
    SENDER_MISMATCH,
    UNDECODABLE,
    Expected,
    Rejection,
    check_tensors,
)
from collm_common import subjects
from collm_common.bus import BusError
from collm_common.lora import AdapterWeights, decode_adapter
from collm_common.store import CorruptBlob, NotFound, StoreError, version_id
from collm_common.wire.admin import UpdateRecord
from collm_common.wire.control import ControlReply, StartTraining
from collm_common.wire.rounds import ParticipantPlan, RoundPlan

if TYPE_CHECKING:
    from collm_aggregator.runner import RoundDeps

log = logging.getLogger(__name__)
NOT_STARTED = "not_started"
Validated = tuple[dict[str, np.ndarray], Rejection | None, float]  # (tensors, refusal, change norm)


def to_numpy(weights: AdapterWeights) -> dict[str, np.ndarray]:
    """The adapter's tensors as float32 numpy arrays on the CPU, by name."""
    return {k: v.detach().to("cpu").float().numpy() for k, v in weights.tensors.items()}


@dataclass
class _Accepted:
    tensors: dict[str, np.ndarray]
    sha256: str


class UpdateCollection:
    """See module docstring. `deps`: the round's `RoundDeps`; `machine`: the round's machine, which this
    collection moves through collecting to its close (or abort)."""

    def __init__(self, deps: RoundDeps, plan: RoundPlan, machine: RoundMachine) -> None:
        self.deps = deps
        self.plan = plan
        self.machine = machine
        self.base: AdapterWeights | None = None  # the round's base version, once `start` has read it
        self.expected: Expected | None = None  # what an update trained from the base version must match
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._ready = asyncio.Event()
        self._tensors: dict[str, _Accepted] = {}
        self._seen: dict[str, str] = {}
        self._older: dict[int, dict[str, np.ndarray]] = {}

    @property
    def round_id(self) -> int:
        return self.plan.round_id

    # --- the phase ---------------------------------------------------------------------------------------
    async def start(self) -> bool:
        """Move the machine to collecting and read the base version; False when it is unusable (the
        machine is then aborted). `deliver` waits for this to have finished either way."""
        async with self._lock:
            self.machine.start_collecting(self.deps.clock.now())
        try:
            return await self._load_base()
        finally:
            self._ready.set()

    async def replay(self) -> None:
        """Enter the round's recorded updates again (a round resumed after a restart), late ones aside."""
        for rec in await self.deps.records.updates(self.round_id):
            if not rec.late:
                await self.deliver(rec)

    async def wait_for_close(self) -> Close | Abort:
        """Poll the machine whenever an update or refusal wakes it, or its next deadline passes, until it
        decides to close or abort."""
        clock = self.deps.clock
        while True:
            async with self._lock:
                decision = self.machine.poll(clock.now())
            if not isinstance(decision, Close | Abort):
                self._wake.clear()
                delay = max(0.0, decision.until_unix_s - clock.now())
                sleeper = asyncio.ensure_future(clock.sleep(delay))
                waker = asyncio.ensure_future(self._wake.wait())
                try:
                    await asyncio.wait({sleeper, waker}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    sleeper.cancel()
                    waker.cancel()
                continue
            return decision

    async def close(self, decision: Close | Abort) -> list[Entry]:
        """Apply the machine's decision: abort it, or close the collection; returns the accepted updates
        (none when aborted)."""
        async with self._lock:
            if isinstance(decision, Abort):
                self.machine.abort(decision.reason, self.deps.clock.now())
                return []
            return self.machine.close(self.deps.clock.now())

    def weighted(self, accepted: Sequence[Entry]) -> list[WeightedUpdate]:
        """The accepted updates' tensors with their weights (samples, staleness), in replica order, not
        arrival order: a round resumed after a restart replays its updates in another order, and must
        compute the same candidate (float sums depend on the order)."""
        staleness_weight = self.machine.rules.staleness_weight
        return [
            WeightedUpdate(e.replica_id, self._tensors[e.replica_id].tensors, e.weight(staleness_weight))
            for e in sorted(accepted, key=lambda e: e.replica_id)
        ]

    async def _load_base(self) -> bool:
        m, store = self.machine, self.deps.store
        try:
            rec = await store.get_version(m.adapter, m.base_version)
            base = decode_adapter(await store.get_blob(m.adapter, m.base_version))
        except (NotFound, CorruptBlob, ValueError) as exc:
            m.abort(
                f"base version {version_id(m.adapter, m.base_version)} is unusable: {exc}",
                self.deps.clock.now(),
            )
            return False
        self.base = base
        self.expected = Expected(
            tensors=to_numpy(base),
            spec_json=base.spec.to_json(),
            base_model=base.base_model or rec.base_model,
            max_delta_norm=self.deps.settings.max_delta_norm,
        )
        return True

    # --- participants ------------------------------------------------------------------------------------
    async def start_participants(self) -> None:
        """Send `StartTraining` to every participant, with the deadline less the adapter's publish lead; a
        participant that cannot be reached or refuses is rejected (`not_started`), so the round need not
        wait for it."""
        deadline = self.plan.deadline_unix_s
        lead_s = self.deps.lead.lead_s(self.plan.adapter, deadline - self.machine.opened_unix_s)
        if lead_s > 0:
            log.info("round %s: participants send %.1f s before the deadline", self.round_id, lead_s)
        await asyncio.gather(*(self._start_participant(p, deadline - lead_s) for p in self.plan.participants))

    async def _start_participant(self, p: ParticipantPlan, send_by_unix_s: float) -> None:
        cmd = StartTraining(
            adapter=self.plan.adapter,
            token_budget=p.token_budget,
            learning_rate=p.learning_rate,
            base_version=self.plan.base_version,
            round_id=self.round_id,
            deadline_unix_s=send_by_unix_s,  # the rest of the round: aggregate, evaluate, publish
        )
        subject = subjects.replica(p.replica_id, "control")
        try:
            reply = await self.deps.bus.request(
                subject, cmd, ControlReply, timeout_s=self.deps.settings.control_timeout_s
            )
            problem = None if reply.ok else f"refused StartTraining: {reply.message}"
        except BusError as exc:
            problem = f"StartTraining failed ({exc.code}): {exc.message}"
        if problem is None:
            return
        async with self._lock:
            if p.replica_id not in self.machine.entries and self.machine.phase is Phase.COLLECTING:
                self.machine.reject(p.replica_id, Rejection(NOT_STARTED, problem), self.deps.clock.now())
                metrics.REJECTED.labels(NOT_STARTED).inc()
        self._wake.set()

    async def take_carried(self) -> None:
        """Under the `staleness` late policy: enter the late updates carried over from the adapter's
        earlier rounds that the machine still admits and that pass validation."""
        if self.deps.settings.late_policy != "staleness":
            return
        for rec in await self.deps.records.take_carry(self.plan.adapter):
            u = rec.update
            verdict = self.machine._base_check(u.base_version)
            if not isinstance(verdict, Admitted):
                continue
            tensors, rejection, norm = await self._validate(rec)
            if rejection is not None:
                continue
            entry = Entry(
                u.replica_id,
                u.base_version,
                u.num_samples,
                rec.received_unix_s,
                delta_norm=norm,
                carried_from=u.round_id,
            )
            async with self._lock:
                if isinstance(self.machine.carry(entry), Admitted):
                    self._tensors[f"{u.replica_id}@r{u.round_id}"] = _Accepted(tensors, u.sha256)

    # --- updates -----------------------------------------------------------------------------------------
    async def deliver(self, rec: UpdateRecord) -> str:
        """An update durably recorded for this round: validate it and enter it in the machine.

        Returns "accepted", "rejected", "late" or "seen" (a redelivery already processed)."""
        u = rec.update
        await self._ready.wait()
        async with self._lock:
            if self._seen.get(u.replica_id) == u.sha256:
                return "seen"
            self._seen.setdefault(u.replica_id, u.sha256)
            m = self.machine
            verdict = m.admit(u.replica_id, u.adapter, u.base_version)
            now = self.deps.clock.now()
            if isinstance(verdict, Late):
                m.mark_late(u.replica_id, now)
                metrics.LATE.inc()
                metrics.UPDATES.labels("late").inc()
                return "late"
            if isinstance(verdict, Rejection):
                m.reject(u.replica_id, verdict, now, u.base_version)
                self._count_reject(verdict)
                self._wake.set()
                return "rejected"
            tensors, rejection, norm = await self._validate(rec)
            status = "rejected"
            now = self.deps.clock.now()
            if rejection is not None:
                m.reject(u.replica_id, rejection, now, u.base_version)
                self._count_reject(rejection)
            else:
                entry = m.record(
                    u.replica_id,
                    u.base_version,
                    u.num_samples,
                    now,
                    staleness=verdict.staleness,
                    delta_norm=norm,
                )
                if entry.rejection is None:
                    self._tensors[u.replica_id] = _Accepted(tensors, u.sha256)
                    metrics.UPDATES.labels("accepted").inc()
                    status = "accepted"
                else:
                    self._count_reject(entry.rejection)
            self._wake.set()
            return status

    def refuse(self, replica_id: str, rejection: Rejection) -> None:
        """Record an update refused before it reached `deliver` (e.g. subject and sender disagree)."""
        self.machine.reject(replica_id, rejection, self.deps.clock.now())
        self._count_reject(rejection)
        self._wake.set()  # a participant refused this way counts as heard from: the round may close

    @staticmethod
    def _count_reject(rejection: Rejection) -> None:
        metrics.REJECTED.labels(rejection.code).inc()
        metrics.UPDATES.labels("rejected").inc()

    async def _validate(self, rec: UpdateRecord) -> Validated:
        u = rec.update
        assert self.expected is not None
        try:
            blob = await self.deps.store.get_update(u.blob_key, u.sha256)
        except CorruptBlob as exc:
            return {}, Rejection(DIGEST, str(exc)), math.nan
        except (NotFound, StoreError) as exc:
            return {}, Rejection(MISSING_BLOB, str(exc)), math.nan
        if u.blob_key != self.deps.store.update_key(u.round_id, u.replica_id):
            return (
                {},
                Rejection(SENDER_MISMATCH, f"blob {u.blob_key} is not {u.replica_id}'s update key"),
                math.nan,
            )
        metrics.BYTES_RECEIVED.inc(len(blob))
        expected = self.expected
        if u.base_version != self.machine.base_version:
            # A stale update (late_policy=staleness): its change is measured from the version it was
            # trained from, so the norm checks judge the local training step, not how far behind it is.
            try:
                older = await self._older_base(u.base_version)
            except (NotFound, CorruptBlob, ValueError) as exc:
                return (
                    {},
                    Rejection(MISSING_BLOB, f"base version v{u.base_version} is unusable: {exc}"),
                    math.nan,
                )
            expected = Expected(older, expected.spec_json, expected.base_model, expected.max_delta_norm)
        return await asyncio.to_thread(_check_blob, blob, expected)

    async def _older_base(self, version: int) -> dict[str, np.ndarray]:
        if version not in self._older:
            blob = await self.deps.store.get_blob(self.plan.adapter, version)
            self._older[version] = to_numpy(decode_adapter(blob))
        return self._older[version]


def _check_blob(blob: bytes, expected: Expected) -> Validated:
    """Decode an update blob and check its tensors against `expected` (CPU work: run in a thread)."""
    try:
        w = decode_adapter(blob)
        tensors = to_numpy(w)
    except Exception as exc:  # safetensors raises several types for garbage
        return {}, Rejection(UNDECODABLE, f"blob is not an adapter: {type(exc).__name__}: {exc}"), math.nan
    rejection, norm = check_tensors(tensors, w.spec.to_json(), w.base_model, expected)
    return tensors, rejection, norm
