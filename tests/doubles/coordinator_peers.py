"""Test doubles of the coordinator's peers, for the coordinator's integration tests only.

* `TelemetryReplica`: publishes scripted `ReplicaTelemetry` on `subjects.telemetry(id)` every
  `interval_s` (its load is whatever the test sets in `load`), and answers control commands on
  `subjects.replica(id, "control")`, recording every `SetFineTuneShare` with its arrival time. A
  `control_delay_s` makes it a slow replica; a `hold` event makes it answer no command until the event is
  set (`held` counts the commands it has received and not yet answered). There is no engine behind it.
* `AggregatorDouble`: answers `open_round` with `RoundOutcome(state="opened")` and a fresh round id,
  recording every plan.

Both speak the real wire schemas over a real NATS server.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from collm_common import subjects
from collm_common.bus import Bus
from collm_common.wire.control import CONTROL_COMMAND, ControlReply, SetFineTuneShare
from collm_common.wire.rounds import RoundOutcome, RoundPlan
from collm_common.wire.telemetry import ReplicaTelemetry, ResidentAdapter


@dataclass
class Load:
    util: float = 0.2
    queue_len: int = 0
    arrivals_per_s: float = 2.0
    slo_attainment: float = 1.0


@dataclass
class ShareRecord:
    t_s: float
    share: float
    ttl_s: float
    reason: str
    spend: float = 0.0


@dataclass
class TelemetryReplica:
    bus: Bus
    replica_id: str
    interval_s: float = 0.1
    domain: str = "med"
    load: Load = field(default_factory=Load)
    control_delay_s: float = 0.0
    hold: asyncio.Event | None = None
    held: int = 0
    publishing: bool = True
    shares: list[ShareRecord] = field(default_factory=list)
    _task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        svc = await self.bus.service(
            subjects.SERVICE_REPLICA, "0.0.1", "test double", {"replica_id": self.replica_id}
        )
        await svc.endpoint(
            "control", subjects.replica(self.replica_id, "control"), CONTROL_COMMAND, self._control
        )
        self._task = asyncio.create_task(self._publish_loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def telemetry(self) -> ReplicaTelemetry:
        ld = self.load
        return ReplicaTelemetry(
            replica_id=self.replica_id,
            ts_unix_s=time.time(),
            interval_s=self.interval_s,
            model="double",
            queue_len=ld.queue_len,
            running=4,
            max_batch=16,
            arrivals_per_s=ld.arrivals_per_s,
            finished=20,
            good=round(20 * ld.slo_attainment),
            slo_attainment=ld.slo_attainment,
            # Serving load as a fraction of capacity: decode tokens/s at 40 ms per full batch of 16.
            tokens_per_s=ld.util * 16 * 1000.0 / 40.0,
            decode_step_ms=40.0,
            prefill_ms_per_token=0.5,
            ft_share=self.shares[-1].share if self.shares else 0.0,
            adapters=[ResidentAdapter(name=self.domain, version_id=f"{self.domain}@v1", version=1)],
            local_samples=200,
            domains=[self.domain],
        )

    async def publish_now(self) -> float:
        await self.bus.publish(subjects.telemetry(self.replica_id), self.telemetry())
        await self.bus.nc.flush()
        return time.monotonic()

    async def _publish_loop(self) -> None:
        while True:
            if self.publishing:
                await self.bus.publish(subjects.telemetry(self.replica_id), self.telemetry())
            await asyncio.sleep(self.interval_s)

    async def _control(self, cmd: object, _headers: Mapping[str, str]) -> ControlReply:
        if self.hold is not None:
            self.held += 1
            try:
                await self.hold.wait()
            finally:
                self.held -= 1
        if self.control_delay_s:
            await asyncio.sleep(self.control_delay_s)
        if isinstance(cmd, SetFineTuneShare):
            self.shares.append(ShareRecord(time.monotonic(), cmd.share, cmd.ttl_s, cmd.reason, cmd.spend))
        return ControlReply(ok=True)


@dataclass
class AggregatorDouble:
    bus: Bus
    plans: list[RoundPlan] = field(default_factory=list)
    _next_id: int = 1

    async def start(self) -> None:
        svc = await self.bus.service(subjects.SERVICE_AGGREGATOR, "0.0.1", "test double", {})
        await svc.endpoint("open_round", subjects.aggregator("open_round"), RoundPlan, self._open)

    async def _open(self, plan: RoundPlan, _headers: Mapping[str, str]) -> RoundOutcome:
        self.plans.append(plan)
        rid = self._next_id
        self._next_id += 1
        return RoundOutcome(
            round_id=rid, adapter=plan.adapter, state="opened", base_version=plan.base_version
        )
