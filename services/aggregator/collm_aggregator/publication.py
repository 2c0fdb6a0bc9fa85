"""A round's candidate stored for evaluation and published (steps 4 and 5 of the `runner` timeline).

`RoundPublication.store_candidate` writes the candidate blob under `put_update(N, "_candidate")` once per
round (blobs are write-once; one written before a restart is recognised); `publish` makes the candidate
the adapter's current version by compare-and-set from the round's base, records its quality from the
round's scores and announces it (`AdapterPublished`), or aborts the round when the pointer moved. Both
are safe to repeat: the runner retries them across a store outage, and `publish` recognises a version
this round already made current.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from collm_aggregator import metrics
from collm_aggregator.evaluation import EvalSummary
from collm_aggregator.machine import RoundMachine
from collm_aggregator.scoring import record_round_quality
from collm_common import subjects
from collm_common.store import Conflict, CorruptBlob, StoreError, VersionRecord, sha256_hex
from collm_common.wire.adapters import AdapterPublished
from collm_common.wire.rounds import RoundPlan

if TYPE_CHECKING:
    from collm_aggregator.runner import RoundDeps

log = logging.getLogger(__name__)
CANDIDATE_ID = "_candidate"


class RoundPublication:
    """See module docstring. `deps`: the round's `RoundDeps`; `product_error()`: the aggregate's product
    error once measured (recorded in the version's meta)."""

    def __init__(
        self,
        deps: RoundDeps,
        plan: RoundPlan,
        machine: RoundMachine,
        product_error: Callable[[], Awaitable[float | None]],
    ) -> None:
        self.deps = deps
        self.plan = plan
        self.machine = machine
        self.product_error = product_error
        self.new_quality: dict[str, float] = {}  # the published version's comparable loss, by domain

    @property
    def round_id(self) -> int:
        return self.plan.round_id

    async def store_candidate(self, blob: bytes) -> tuple[str, str]:
        """(key, sha256) of the stored candidate blob, recorded on the round."""
        store, records = self.deps.store, self.deps.records
        known = await records.candidate(self.round_id)
        if known is not None:
            with contextlib.suppress(StoreError):
                await store.get_update(*known)
                return known
        try:
            key, sha = await store.put_update(
                self.round_id, CANDIDATE_ID, blob, ttl_s=self.deps.settings.update_ttl_s
            )
        except Conflict:
            # Written before a restart but not recorded: reuse it if it is byte-identical; else (another
            # process, other float rounding) store this one beside it: candidate blobs are write-once.
            key = store.update_key(self.round_id, CANDIDATE_ID)
            sha = sha256_hex(blob)
            try:
                await store.get_update(key, sha)
            except CorruptBlob:
                other = f"{CANDIDATE_ID}-{sha[:16]}"
                try:
                    key, sha = await store.put_update(
                        self.round_id, other, blob, ttl_s=self.deps.settings.update_ttl_s
                    )
                except Conflict:  # stored by an earlier restart: the name is its digest
                    key = store.update_key(self.round_id, other)
                    await store.get_update(key, sha)
        await records.save_candidate(self.round_id, key, sha)
        return key, sha

    async def publish(self, blob: bytes, base_model: str, summary: EvalSummary) -> None:
        """Publish `blob` (trained on `base_model`, scored as `summary`) as the adapter's next version if
        the adapter is still at the round's base; the machine ends published or aborted."""
        m, store = self.machine, self.deps.store
        now = self.deps.clock.now
        current = await store.current(m.adapter)
        if current != m.base_version:
            if current is not None:
                rec = await store.get_version(m.adapter, current)
                if rec.round_id == self.round_id and rec.source == "round":
                    m.published(current, now())  # published before a restart
                    return
            m.abort(
                f"{m.adapter} moved from v{m.base_version} to v{current} during the round; not published",
                now(),
            )
            return
        meta = {
            "strategy": self.deps.strategy.name,
            "accepted": ",".join(e.replica_id for e in m.accepted),
            "product_error_rel_delta": await self.product_error(),
        }
        try:
            rec = await store.publish(
                m.adapter,
                blob,
                expected_current=m.base_version,
                base_model=base_model,
                source="round",
                round_id=self.round_id,
                parent=m.base_version,
                meta=meta,
            )
        except Conflict as exc:
            m.abort(f"publication lost a compare-and-set: {exc}; not published", now())
            return
        m.published(rec.version, now())
        metrics.PUBLICATIONS.labels("round").inc()
        await self._record_quality(rec.version, summary)
        self.deps.published(m.adapter, rec.version, m.base_version)
        await self._announce(rec)

    async def _record_quality(self, version: int, summary: EvalSummary) -> None:
        m = self.machine
        try:
            self.new_quality = await record_round_quality(
                self.deps.store, m.adapter, version, m.base_version, summary.entries
            )
        except Exception as exc:  # noqa: BLE001 - the version is published; its record is best effort
            log.warning("round %s: quality of %s@v%d not recorded: %s", self.round_id, m.adapter,
                        version, exc)  # fmt: skip

    async def _announce(self, rec: VersionRecord) -> None:
        event = AdapterPublished(
            name=self.machine.adapter,
            version=rec.version,
            version_id=rec.id,
            sha256=rec.sha256,
            base_model=rec.base_model,
            source="round",
            round_id=self.round_id,
            created_unix_s=rec.created_unix_s,
        )
        await self.deps.bus.publish(subjects.adapter_published(self.machine.adapter), event)
