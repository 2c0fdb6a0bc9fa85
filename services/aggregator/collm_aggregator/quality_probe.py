"""Task metrics of published versions: the adapter's evaluators answer their first held-out examples.

`QualityProbe.published(adapter, version, parent)` is told of every publication from a round. At most
once per `eval_task_interval_s` per adapter (and never two at once for one adapter) it asks the
adapter's evaluators (`RoundDeps.eval_replicas`, no participant preferred) to score the new version with
`task_examples` (`EvaluateCandidate.task_examples`): each generates greedy answers to its first
`eval_task_examples` held-out examples per domain that has a task metric and scores them. `name@v1` (the
base model's behaviour: the start of every curve) and the parent are probed first when they have no task
record yet (an earlier probe may have been cut short by a restart). Results go to the store as
`record_task_quality` (`quality_ledger.task_summary`: the example-weighted mean over the sites that
answered). A probe that fails is logged; it never touches a round.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Awaitable, Callable, Collection, Coroutine, Sequence
from typing import Any

from collm_aggregator.quality_ledger import SiteTask, task_summary
from collm_aggregator.settings import AggregatorSettings
from collm_common import subjects
from collm_common.bus import Bus, BusError
from collm_common.clock import Clock
from collm_common.store import AdapterStore, NotFound
from collm_common.wire.rounds import EvalReport, EvaluateCandidate

log = logging.getLogger(__name__)


class QualityProbe:
    """See module docstring."""

    def __init__(
        self,
        bus: Bus,
        store: AdapterStore,
        settings: AggregatorSettings,
        clock: Clock,
        eval_replicas: Callable[[str, Sequence[str], Collection[str]], Awaitable[list[str]]],
        spawn: Callable[[Coroutine[Any, Any, None]], Any],
    ) -> None:
        self.bus = bus
        self.store = store
        self.s = settings
        self.clock = clock
        self.eval_replicas = eval_replicas
        self.spawn = spawn
        self._last_s: dict[str, float] = {}
        self._running: set[str] = set()

    def published(self, adapter: str, version: int, parent: int | None) -> None:
        if self.s.eval_task_examples <= 0 or adapter in self._running:
            return
        now = self.clock.now()
        if now - self._last_s.get(adapter, -math.inf) < self.s.eval_task_interval_s:
            return
        self._last_s[adapter] = now
        self._running.add(adapter)
        self.spawn(self._probe(adapter, version, parent))

    async def _probe(self, adapter: str, version: int, parent: int | None) -> None:
        try:
            versions = []
            for v in dict.fromkeys((1, parent)):  # v1 (the base model's behaviour) and the parent, unscored
                if v is not None and v != version and not await self.store.task_quality(adapter, v):
                    with contextlib.suppress(NotFound):
                        await self.store.get_version(adapter, v)
                        versions.append(v)
            versions.append(version)
            who = await self.eval_replicas(adapter, (), ())
            for v in versions:
                summary = await self.probe(adapter, v, who)
                if summary:
                    await self.store.record_task_quality(adapter, v, summary)
                    log.info(
                        "%s@v%d task metrics: %s", adapter, v,
                        ", ".join(f"{d} {t['metric']} {t['score']:.3f} ({t['examples']} examples)"
                                  for d, t in summary.items()),
                    )  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - a probe is best effort; rounds go on without it
            log.warning("task-metric probe of %s@v%d failed: %s", adapter, version, exc)
        finally:
            self._running.discard(adapter)

    async def probe(self, adapter: str, version: int, replicas: Sequence[str]) -> dict[str, dict[str, Any]]:
        """`adapter@v{version}`'s task metric per domain over `replicas` (those that answer in time)."""
        req = EvaluateCandidate(
            adapter=adapter,
            candidate_key="",
            candidate_sha256="",
            candidate_version=version,
            score_current=False,
            max_examples=self.s.eval_max_examples,
            max_tokens=self.s.eval_max_tokens,
            task_examples=self.s.eval_task_examples,
        )

        async def ask(rid: str) -> EvalReport | None:
            try:
                return await self.bus.request(
                    subjects.replica(rid, "evaluate"), req, EvalReport, timeout_s=self.s.eval_task_timeout_s
                )
            except BusError as exc:
                log.warning("%s could not score the task metrics of %s@v%d: %s", rid, adapter, version, exc)
                return None

        reports = [r for r in await asyncio.gather(*(ask(r) for r in replicas)) if r is not None]
        return task_summary(
            SiteTask(d.domain, r.replica_id, d.task_metric, d.task_score, d.task_examples)
            for r in reports
            for d in r.losses
            if d.task_metric and d.task_score is not None
        )
