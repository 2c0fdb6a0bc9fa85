"""A round's candidate (step 3 of the `runner` timeline): the strategy over the accepted updates.

`CandidateAggregation.rebase` moves an async round onto the version an earlier round of the adapter
published from its base while it collected; `aggregate` runs the strategy in a worker thread (its change
applied to that version when rebased) and encodes the candidate blob. The aggregate's product error, a
diagnostic recorded in the published version's meta, is measured beside the evaluation
(`product_error` awaits it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from collm_aggregator import metrics
from collm_aggregator.collection import to_numpy
from collm_aggregator.machine import RoundMachine
from collm_aggregator.scoring import CandidateScoring
from collm_aggregator.strategies import WeightedUpdate, product_error, rebase_aggregate
from collm_common.lora import AdapterWeights, decode_adapter, encode_adapter
from collm_common.store import CorruptBlob, NotFound
from collm_common.wire.rounds import EvalReport, RoundPlan

if TYPE_CHECKING:
    from collm_aggregator.runner import RoundDeps

log = logging.getLogger(__name__)


class CandidateAggregation:
    """See module docstring. `deps`: the round's `RoundDeps`; `scoring`: the round's evaluation, told of
    a rebase; `through_outage(what, step)`: the runner's wait for the store across an outage."""

    def __init__(
        self,
        deps: RoundDeps,
        plan: RoundPlan,
        machine: RoundMachine,
        scoring: CandidateScoring,
        through_outage: Callable[[str, Callable[[], Awaitable[Any]]], Awaitable[Any]],
    ) -> None:
        self.deps = deps
        self.plan = plan
        self.machine = machine
        self.scoring = scoring
        self.through_outage = through_outage
        self._product_error: float | None = None
        self._product_error_task: asyncio.Task[None] | None = None

    @property
    def round_id(self) -> int:
        return self.plan.round_id

    async def rebase(self, base_tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray] | None:
        """Async rounds: if an earlier round published from this round's base (`base_tensors`) while this
        one collected, this round is rebased onto that version: the machine's base moves to it (the
        updates count as that much staler), that round's candidate scores stand for the current
        version's, and the tensors of the version are returned for `aggregate` to apply the candidate's
        change to (`strategies.rebase_aggregate`, times `rebase_scale`). Any other move of the pointer (a
        rollback, an import) is left to the publication, which then aborts; so is this round's own
        publication before a restart, which the publication recognises."""
        m, store = self.machine, self.deps.store
        current = await self.through_outage("reading the current version", lambda: store.current(m.adapter))
        if current is None or current <= m.base_version:
            return None
        try:
            rec = await store.get_version(m.adapter, current)
            if rec.source != "round" or rec.parent != m.base_version or rec.round_id == self.round_id:
                return None
            newer = decode_adapter(await store.get_blob(m.adapter, current))
        except (NotFound, CorruptBlob, ValueError) as exc:
            log.warning("round %s: not rebased onto v%s: %s", self.round_id, current, exc)
            return None
        old, new = base_tensors, to_numpy(newer)
        if new.keys() != old.keys() or any(new[k].shape != old[k].shape for k in new):
            log.warning("round %s: not rebased onto v%s: its tensors differ from v%s's", self.round_id,
                        current, m.base_version)  # fmt: skip
            return None
        log.info("round %s: rebased from v%s onto v%s (round %s)", self.round_id, m.base_version, current,
                 rec.round_id)  # fmt: skip
        m.rebase(current)
        self.scoring.stop_prescore()  # the old base's scores no longer judge the candidate
        reports: list[EvalReport] = []
        if rec.round_id is not None:
            with contextlib.suppress(Exception):
                reports = await self.deps.records.evals(rec.round_id)
        self.scoring.rebase(current, reports)
        metrics.REBASED.inc()
        return new

    async def aggregate(
        self,
        updates: list[WeightedUpdate],
        base: AdapterWeights,
        base_tensors: dict[str, np.ndarray],
        onto: dict[str, np.ndarray] | None = None,
    ) -> bytes:
        """The candidate blob: the strategy over `updates` from the round's base (`base`, whose tensors
        are `base_tensors`); with `onto` (the tensors of the version the round was rebased onto), its
        change applied to that version."""
        strategy = self.deps.strategy
        t0 = time.perf_counter()
        agg = await asyncio.to_thread(strategy.aggregate, updates, base_tensors)
        agg_s = time.perf_counter() - t0
        metrics.AGGREGATION_SECONDS.labels(strategy.name).observe(agg_s)
        # A diagnostic of the aggregate, not needed to evaluate it: computed while replicas evaluate, off
        # the path from the close to the publication (awaited before publishing, for the version's meta).
        measure = self._measure_product_error(agg, updates, base_tensors)
        self._product_error_task = asyncio.create_task(measure)
        if onto is not None:
            scale = self.deps.settings.rebase_scale
            agg = await asyncio.to_thread(rebase_aggregate, agg, base_tensors, onto, scale, strategy.products)
        import torch

        weights = AdapterWeights(
            tensors={k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in agg.items()},
            spec=base.spec,
            base_model=base.base_model,
            extra={"collm.round_id": str(self.round_id), "collm.strategy": strategy.name},
        )
        blob = encode_adapter(weights)
        log.info(
            "round %s: %s of %d updates in %.2f s (%.2f s with encoding)",
            self.round_id, strategy.name, len(updates), agg_s, time.perf_counter() - t0,
        )  # fmt: skip
        return blob

    async def product_error(self) -> float | None:
        """The aggregate's product error (relative distance of its B·A from the updates' average), once
        measured; None when not measured."""
        if self._product_error_task is not None:
            with contextlib.suppress(Exception):
                await self._product_error_task
        return self._product_error

    async def _measure_product_error(
        self, agg: dict[str, np.ndarray], updates: list[WeightedUpdate], base_np: dict[str, np.ndarray]
    ) -> None:
        try:
            err = await asyncio.to_thread(product_error, agg, updates, base_np, self.deps.strategy.server_lr)
        except Exception as exc:  # noqa: BLE001 - a diagnostic only
            log.warning("round %s: product error not measured: %s", self.round_id, exc)
            return
        self._product_error = err.get("rel_delta")
        if self._product_error is not None:
            metrics.PRODUCT_ERROR.labels(self.plan.adapter).set(self._product_error)
