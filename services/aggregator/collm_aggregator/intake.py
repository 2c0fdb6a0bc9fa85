"""The aggregator's durable intake of participants' updates (JetStream consumer on `subjects.updates_all()`).

Each `LocalUpdate` is recorded in Redis for its round (HSETNX) and only then acknowledged, then handed to
the round's runner; a message that cannot be recorded (Redis down) is nak'ed and comes back; a malformed
one is terminated and counted. An update for a round that ended is kept on its record as late (and
carried into the adapter's next round under the `staleness` late policy); refusals are counted and
reported in the round's record.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import nats.errors
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from collm_aggregator import metrics
from collm_aggregator.records import RoundRecords
from collm_aggregator.runner import RoundRunner
from collm_aggregator.settings import AggregatorSettings
from collm_aggregator.validation import NOT_PARTICIPANT, SENDER_MISMATCH, UNKNOWN_ROUND, Rejection
from collm_common import subjects
from collm_common.bus import Bus
from collm_common.clock import Clock
from collm_common.store import AdapterStore, StoreError
from collm_common.wire import WireError, decode
from collm_common.wire.admin import UpdateRecord
from collm_common.wire.rounds import LocalUpdate, RejectedUpdate

log = logging.getLogger(__name__)


def count_rejection(why: Rejection) -> None:
    metrics.REJECTED.labels(why.code).inc()
    metrics.UPDATES.labels("rejected").inc()


class UpdateIntake:
    """See module docstring. `runners`: the service's running rounds by id (shared, not copied)."""

    def __init__(
        self,
        settings: AggregatorSettings,
        bus: Bus,
        store: AdapterStore,
        records: RoundRecords,
        clock: Clock,
        runners: Mapping[int, RoundRunner],
    ) -> None:
        self.settings = settings
        self.bus = bus
        self.store = store
        self.records = records
        self.clock = clock
        self.runners = runners
        self._psub: Any = None

    async def close(self) -> None:
        """Drop the pull subscription: one left behind by a cancelled fetch would hold the connection's
        drain for its full timeout."""
        if self._psub is not None:
            with contextlib.suppress(Exception):
                await self._psub.unsubscribe()
            self._psub = None

    async def run(self) -> None:
        """Fetch and handle updates until cancelled (a lost subscription is made again after 1 s)."""
        s = self.settings
        config = ConsumerConfig(
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.ALL,
            ack_wait=30,
            max_ack_pending=256,
            max_deliver=-1,
        )
        while True:
            try:
                if self._psub is None:
                    self._psub = await self.bus.js.pull_subscribe(
                        subjects.updates_all(), durable=s.consumer_name, config=config
                    )
                msgs = await self._psub.fetch(16, timeout=1.0)
            except asyncio.CancelledError:
                raise
            except (nats.errors.TimeoutError, TimeoutError):
                continue
            except Exception as exc:
                log.warning("update consumer: %s; retrying", exc)
                with contextlib.suppress(Exception):
                    await self._psub.unsubscribe()
                self._psub = None
                await self.clock.sleep(1.0)
                continue
            for msg in msgs:
                await self.handle(msg)

    async def handle(self, msg: Msg) -> None:
        try:
            update = decode(LocalUpdate, msg.data)
        except WireError as exc:
            log.warning("dropped malformed update on %s: %s", msg.subject, exc)
            metrics.REJECTED.labels("undecodable").inc()
            with contextlib.suppress(Exception):
                await msg.term()
            return
        tokens = msg.subject.split(".")
        sender = tokens[-1] if len(tokens) >= 2 else ""
        round_token = tokens[-2] if len(tokens) >= 2 else ""
        size = 0
        if update.blob_key.startswith(f"{self.store.prefix}:update:"):
            with contextlib.suppress(Exception):
                size = int(await self.store.r.strlen(update.blob_key))
        record = UpdateRecord(update=update, received_unix_s=self.clock.now(), size_bytes=size)

        async def ack() -> None:
            with contextlib.suppress(Exception):  # a lost ack means a redelivery, which is idempotent
                await msg.ack()

        try:
            status = await self.record_and_route(update, record, sender, round_token, ack)
        except (StoreError, ConnectionError, OSError, TimeoutError) as exc:
            log.warning(
                "could not record update %s/%s (%s); will be redelivered",
                update.round_id,
                update.replica_id,
                exc,
            )
            with contextlib.suppress(Exception):
                await msg.nak(delay=1.0)
            return
        except Exception as exc:  # a Redis client error or a bug: keep the message for redelivery
            log.exception("update %s/%s: %s", update.round_id, update.replica_id, exc)
            with contextlib.suppress(Exception):
                await msg.nak(delay=2.0)
            return
        log.info("update %s from %s: %s", update.round_id, update.replica_id, status)

    async def record_and_route(
        self,
        update: LocalUpdate,
        record: UpdateRecord,
        sender: str,
        round_token: str,
        ack: Callable[[], Awaitable[None]],
    ) -> str:
        """Record the update durably for its round, acknowledge it, then hand it to the round.

        Identity: the subject's replica token is the sender (on a secured server only that replica may
        publish it, deploy/nats/auth.conf), so an update is taken only when the payload names the same
        replica and round as its subject, and only from a participant of that round's plan (the round
        machine checks the latter while the round runs; here after it ended). Refusals are counted and
        reported in the round's record (`rejected`, with the reason), and acked: redelivering them could
        never change the verdict."""
        runner = self.runners.get(update.round_id)
        if sender != update.replica_id or round_token != str(update.round_id):
            why = Rejection(
                SENDER_MISMATCH,
                f"message on the subject of {sender!r}/round {round_token} "
                f"claims {update.replica_id!r}/round {update.round_id}",
            )
            if runner is not None and not runner.machine.final:
                runner.refuse(sender or update.replica_id, why)
            else:
                count_rejection(why)
                await self.report_refusal(update.round_id, sender or update.replica_id, why)
            await ack()
            return "rejected: sender mismatch"
        if not await self.records.exists(update.round_id):
            metrics.REJECTED.labels(UNKNOWN_ROUND).inc()
            log.warning("update for unknown round %s from %s refused", update.round_id, update.replica_id)
            await ack()
            return "rejected: unknown round"
        if runner is not None and not runner.machine.final:
            late = runner.machine.phase.value not in ("opened", "collecting")
            rec = record.model_copy(update={"late": late})
            await self.records.add_update(update.round_id, rec)
            if late:
                await self.carry(rec)
            await ack()  # durably recorded: a restart resumes the round from this record
            status = await runner.deliver(rec)
            if status == "late":
                await self.carry(rec)
            return status
        # The round is over: the update is late; keep it on the record (and carry it, by policy).
        rec = record.model_copy(update={"late": True})
        added = await self.records.add_update(update.round_id, rec)
        plan = await self.records.plan(update.round_id)
        if plan is not None and update.replica_id not in {p.replica_id for p in plan.participants}:
            why = Rejection(
                NOT_PARTICIPANT, f"{update.replica_id} is not a participant of round {plan.round_id}"
            )
            if added:
                count_rejection(why)
                await self.report_refusal(update.round_id, update.replica_id, why)
            await ack()
            return "rejected: not a participant"
        if added:
            outcome = await self.records.outcome(update.round_id)
            if outcome is not None and update.replica_id in outcome.participants:
                if update.replica_id not in outcome.late:
                    await self.records.save_outcome(
                        outcome.model_copy(update={"late": [*outcome.late, update.replica_id]})
                    )
                await self.carry(rec)
            metrics.LATE.inc()
            metrics.UPDATES.labels("late").inc()
        await ack()
        return "late"

    async def report_refusal(self, round_id: int, replica_id: str, why: Rejection) -> None:
        """Add a refused update to the record of a round that is not running here (it ended)."""
        outcome = await self.records.outcome(round_id)
        if outcome is None:
            return
        entry = RejectedUpdate(replica_id=replica_id, reason=why.reason, code=why.code)
        if entry not in outcome.rejected:
            await self.records.save_outcome(
                outcome.model_copy(update={"rejected": [*outcome.rejected, entry]})
            )
        log.warning("round %s: refused an update from %s: %s", round_id, replica_id, why.reason)

    async def carry(self, rec: UpdateRecord) -> None:
        if self.settings.late_policy == "staleness":
            await self.records.add_carry(rec.update.adapter, rec)
