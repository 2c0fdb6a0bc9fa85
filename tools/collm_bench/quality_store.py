"""Read the served-quality table from the adapter store (the thin shell around `quality.QualityTable`).

Versions: every version of the named adapters that has a quality record
(`AdapterStore.quality(name, N)` -> {domain: loss}) becomes `name@vN` in the table.

Base losses (the base model, no adapter), per domain, from the first of:
* a quality record under version 0 (the store's counter starts at 1, so 0 never names a real version);
* the quality record of a version created with `source="create"`: replicas create `name@v1` as a
  zero-B LoRA, which computes exactly what the base model computes, and the aggregator records its
  losses (`domains_before`) when round 1 publishes v2.
Base losses given on the command line or in a quality file take precedence over both.
"""

from __future__ import annotations

from collections.abc import Iterable

from collm_common.store import AdapterStore, version_id
from collm_workload.quality import QualityTable

BASE_QUALITY_VERSION = 0
CREATED_SOURCE = "create"  # a freshly created zero-B adapter: the base model's behaviour


def adapter_names(version_ids: Iterable[str | None]) -> list[str]:
    """Adapter names in served version ids (`medical@v3+r1.2` -> `medical`; `base` is no adapter)."""
    names = {v.split("@", 1)[0] for v in version_ids if v and "@" in v}
    return sorted(names)


async def load_quality_from_store(
    redis_url: str, prefix: str, names: Iterable[str] | None = None
) -> QualityTable:
    store = AdapterStore.from_url(redis_url, prefix)
    try:
        wanted = sorted(set(names)) if names is not None else await store.list_adapters()
        table = QualityTable()
        created: list[dict[str, float]] = []
        for name in wanted:
            for rec in await store.list_versions(name):
                losses = await store.quality(name, rec.version)
                if losses:
                    table.versions[version_id(name, rec.version)] = losses
                    if rec.source == CREATED_SOURCE:
                        created.append(losses)
            for domain, loss in (await store.quality(name, BASE_QUALITY_VERSION)).items():
                table.base.setdefault(domain, loss)
        for losses in created:
            for domain, loss in losses.items():
                table.base.setdefault(domain, loss)
        return table
    finally:
        await store.close()
