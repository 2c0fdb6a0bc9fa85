"""Built-in round plans (`default_plan`): rounds the aggregator opens itself when no coordinator plans.

`BuiltinPlans.run` ticks `plan_once` until cancelled. A tick does nothing while a coordinator is heard
from (it planned or decided within `default_plan_idle_s`); otherwise every adapter due (its last
built-in round at least `default_plan_period_s` ago) among the configured ones and those that opted in
(a `domains` entry in their meta) gets a plan from `planner.default_plans`, opened as a coordinator's
would be. A plan that cannot be made is skipped, its reason logged and counted once
(`collm_aggregator_plans_skipped_total`); an adapter without any version yet may be bootstrapped
(`default_plan_bootstrap`: a replica with data is asked to create v1).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Mapping

from collm_aggregator import metrics
from collm_aggregator.planner import PlanConfig, PlanDraft, ReplicaView, Skip, default_plans, eligible
from collm_aggregator.runner import RoundRunner
from collm_aggregator.settings import AggregatorSettings
from collm_common import subjects
from collm_common.bus import Bus, BusError, ServiceFailure
from collm_common.clock import Clock
from collm_common.store import AdapterStore
from collm_common.wire.control import ControlReply, StartTraining
from collm_common.wire.rounds import ParticipantPlan, RoundOutcome, RoundPlan

log = logging.getLogger(__name__)


class BuiltinPlans:
    """See module docstring. `replicas`, `runners`: the service's live views (read only);
    `coordinator_heard()`: when a coordinator last planned or decided (the service's start if never);
    `open_round(plan)`: the service's opening of a round."""

    def __init__(
        self,
        settings: AggregatorSettings,
        bus: Bus,
        store: AdapterStore,
        clock: Clock,
        replicas: Mapping[str, ReplicaView],
        runners: Mapping[int, RoundRunner],
        coordinator_heard: Callable[[], float],
        open_round: Callable[[RoundPlan], Awaitable[RoundOutcome]],
    ) -> None:
        self.settings = settings
        self.bus = bus
        self.store = store
        self.clock = clock
        self.replicas = replicas
        self.runners = runners
        self.coordinator_heard = coordinator_heard
        self.open_round = open_round
        self._last_builtin: dict[str, float] = {}
        self._skip_reasons: dict[str, str] = {}

    async def run(self) -> None:
        tick_s = min(1.0, self.settings.default_plan_period_s / 4)
        while True:
            try:
                await self.plan_once()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("built-in planning failed")
            await self.clock.sleep(tick_s)

    async def plan_once(self) -> None:
        s = self.settings
        now = self.clock.now()
        # Built-in plans stand in for a coordinator that is not there: not for one that decides not to
        # plan (every data holder at SLO risk) nor one starting beside the aggregator, which is given
        # default_plan_idle_s for its first decision.
        if now - self.coordinator_heard() < s.default_plan_idle_s:
            return
        adapters = {a: list(d) for a, d in s.default_plan_adapters.items()}
        for name in await self.store.list_adapters():
            if name not in adapters:
                meta = await self.store.meta(name)
                if meta.get("domains"):  # opted in: `import` with domains, or set by an operator
                    adapters[name] = [d for d in meta["domains"].split(",") if d]
        due = {
            a: d
            for a, d in adapters.items()
            if now - self._last_builtin.get(a, -math.inf) >= s.default_plan_period_s
        }
        if not due:
            return
        currents = {a: await self.store.current(a) for a in due}
        busy = {r.plan.adapter for r in self.runners.values() if not r.machine.final}
        cfg = PlanConfig(
            token_budget=s.default_token_budget,
            learning_rate=s.default_learning_rate,
            deadline_s=s.round_deadline_s,
            quorum_fraction=s.quorum_fraction,
            telemetry_stale_s=s.telemetry_stale_s,
        )
        for item in default_plans(list(self.replicas.values()), due, currents, busy, cfg, now):
            if isinstance(item, Skip):
                if self._skip_reasons.get(item.adapter) != item.reason:  # log and count each new reason once
                    log.info("built-in plan for %s skipped: %s", item.adapter, item.reason)
                    self._skip_reasons[item.adapter] = item.reason
                    metrics.PLANS_SKIPPED.labels(item.adapter).inc()
                if currents.get(item.adapter) is None and s.default_plan_bootstrap:
                    if await self._bootstrap(item.adapter, due[item.adapter], now):
                        self._last_builtin[item.adapter] = now
                continue
            self._skip_reasons.pop(item.adapter, None)
            self._last_builtin[item.adapter] = now
            await self._open_draft(item)

    async def _bootstrap(self, adapter: str, domains: list[str], now: float) -> bool:
        """Ask one replica with data to create `adapter@v1` (replicas create v1 on StartTraining without
        a base version); the adapter's first round follows at the next period."""
        s = self.settings
        who = eligible(list(self.replicas.values()), domains, now, s.telemetry_stale_s)
        if not who:
            return False
        cmd = StartTraining(
            adapter=adapter, token_budget=s.default_token_budget, learning_rate=s.default_learning_rate
        )
        try:
            reply = await self.bus.request(
                subjects.replica(who[0], "control"), cmd, ControlReply, s.control_timeout_s
            )
            log.info("asked %s to create %s@v1: %s", who[0], adapter, reply.message)
            return True
        except BusError as exc:
            log.warning("could not ask %s to create %s@v1: %s", who[0], adapter, exc.message)
            return False

    async def _open_draft(self, d: PlanDraft) -> None:
        plan = RoundPlan(
            adapter=d.adapter,
            base_version=d.base_version,
            participants=[
                ParticipantPlan(replica_id=r, token_budget=d.token_budget, learning_rate=d.learning_rate)
                for r in d.participants
            ],
            quorum=d.quorum,
            opened_unix_s=d.opened_unix_s,
            deadline_unix_s=d.deadline_unix_s,
            policy="builtin",
            reason=d.reason,
        )
        try:
            await self.open_round(plan)
        except ServiceFailure as exc:
            log.info("built-in round for %s not opened: %s", d.adapter, exc.message)
