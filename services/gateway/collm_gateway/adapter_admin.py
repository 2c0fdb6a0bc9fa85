"""Bringing adapters in and out through the gateway: load, unload, versions, rollback.

The aggregator stays the one writer of adapter versions: `load` asks it to import a PEFT directory
(`subjects.aggregator("import")`; the path is read by the aggregator, inside its import roots) and
`rollback` asks it to republish an old version's content as a new one. The gateway itself writes only
adapter metadata (the owner tenant) and the listing:

* **load** (`POST /v1/load_lora_adapter`, vLLM's request shape): an unknown name becomes a new adapter
  at v1; a loaded name gets a new version (same LoRA spec, else 409; same shapes, else 422); a name unloaded
  before is loaded again, its numbering continuing (never reused). The owner is set *before* the
  import, so a tenant's adapter is never visible as shared, not even for a moment; when the import is
  refused, the owner and the listing are put back as they were (after a timeout they are kept: the
  import may still land, and must land owned).
* **unload** (`POST /v1/unload_lora_adapter`): the adapter leaves `GET /v1/models` and becomes
  unroutable at once on this gateway (the listing is re-read) and within `models_cache_ttl_s` on the
  others; its current pointer is removed, so a replica answers a request that names no version of it
  with 404 once it re-reads the pointers (at once when it does not hold it; within
  `COLLM_ADAPTER_SYNC_INTERVAL_S`, 15 s, when it does). Every immutable
  version, its digest and quality record stay in the store (requests already served stay traceable);
  `GET /v1/adapters/{name}/versions` still shows them to an admin, and a later load or a rollback
  brings the name back.
* **versions**: every version with digest, size, source, parent, created time, whether it is current,
  whether retention pruned its blob, its quality record (`quality`: the comparable held-out loss per
  domain, chained over the same sites by the aggregator's `quality_ledger`) and its task metric per
  domain when probed (`task`: metric, score in [0, 1], examples, sites). Tenant-scoped: a non-admin
  sees only adapters it may use.
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import ConfigDict, Field, field_validator
from redis.exceptions import RedisError

from collm_common import subjects
from collm_common.bus import Bus, BusError, NoResponders
from collm_common.store import AdapterStore, StoreError, VersionRecord, version_id
from collm_common.wire.admin import AdapterVersionInfo, ImportAdapter, RollbackAdapter
from collm_gateway.auth import Principal, can_use_adapter
from collm_gateway.catalog import OWNER_FIELD, ModelCatalog
from collm_gateway.errors import APIError, unavailable
from collm_gateway.protocol import EdgeModel
from collm_gateway.settings import GatewaySettings

log = logging.getLogger(__name__)

NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
MAX_NAME_BYTES = 255  # NAME_MAX: longer path components fail with ENAMETOOLONG


class LoadLoraAdapterRequest(EdgeModel):
    """vLLM's `load_lora_adapter` body, plus CoLLM's optional `tenant`, `base_model`, `domains`."""

    model_config = ConfigDict(extra="allow")

    lora_name: str = Field(pattern=NAME_PATTERN, description="Adapter name (becomes a model id).")
    lora_path: str = Field(
        min_length=1,
        max_length=4096,
        description="Absolute path of a PEFT directory, as the aggregator sees it (inside its import roots).",
    )
    load_inplace: bool = Field(False, description="vLLM's flag; every load here is a new version.")
    tenant: str | None = Field(
        None,
        pattern=r"^([A-Za-z0-9_-]{1,64})?$",
        description='Owner tenant; "" makes it shared. Omitted: a new adapter is shared, a known one '
        "keeps its owner.",
    )
    base_model: str | None = Field(
        None,
        min_length=1,
        max_length=256,
        description="The adapter's base model (default: the gateway's); its PEFT config must name the same.",
    )
    domains: list[str] | None = Field(
        None, max_length=64, description="Domains whose local data trains it in federated rounds."
    )

    @field_validator("lora_path")
    @classmethod
    def _absolute_path(cls, v: str) -> str:
        # The aggregator, another process maybe on another machine, reads it: a relative path or `~`
        # would mean something else there. NUL and over-long names cannot name a file anywhere.
        if not v.startswith("/"):
            raise ValueError("lora_path must be an absolute path (the aggregator reads it)")
        if "\x00" in v:
            raise ValueError("lora_path must not contain NUL")
        if any(len(part.encode()) > MAX_NAME_BYTES for part in v.split("/")):
            raise ValueError(f"lora_path has a path component longer than {MAX_NAME_BYTES} bytes")
        return v


class UnloadLoraAdapterRequest(EdgeModel):
    model_config = ConfigDict(extra="allow")

    lora_name: str = Field(pattern=NAME_PATTERN)
    lora_int_id: int | None = Field(None, description="vLLM's numeric id; ignored (names are ids here).")


class RollbackRequest(EdgeModel):
    model_config = ConfigDict(extra="forbid")

    version: int = Field(ge=1, le=2**62, description="The version whose content becomes current again.")
    reason: str = Field("", max_length=512)


def from_aggregator(exc: BusError, param: str | None = None) -> APIError:
    """The aggregator's error reply (or its absence) as the HTTP client should see it."""
    if isinstance(exc, NoResponders):
        return APIError(
            503,
            "the aggregator is not running (nothing answers on its endpoints); start it and retry",
            code="aggregator_unavailable",
            headers={"Retry-After": "5"},
        )
    if exc.code == 504:
        return APIError(504, f"the aggregator did not answer in time: {exc.message}", code="timeout")
    if exc.code in (400, 403, 404, 409, 422):
        code = {
            400: "invalid_value",
            403: "path_not_allowed",
            404: "not_found",
            409: "conflict",
            422: "invalid_adapter",
        }[exc.code]
        return APIError(exc.code, exc.message, param=param, code=code)
    if exc.code == 503:
        return APIError(503, exc.message, code="aggregator_unavailable", headers={"Retry-After": "5"})
    return APIError(502, f"the aggregator failed: {exc.message}", code="aggregator_error")


def adapter_not_found(name: str, param: str = "lora_name") -> APIError:
    return APIError(404, f"The adapter {name!r} does not exist.", param=param, code="model_not_found")


def store_down(exc: Exception, retry_after_s: int) -> APIError:
    return unavailable(f"adapter store unreachable: {exc}", retry_after_s, "store_unavailable")


def version_info_json(info: AdapterVersionInfo, owner: str | None) -> dict[str, Any]:
    return {
        "object": "lora_adapter",
        "lora_name": info.name,
        "id": info.version_id,
        "version": info.version,
        "sha256": info.sha256,
        "size_bytes": info.size_bytes,
        "base_model": info.base_model,
        "source": info.source,
        "parent": info.parent,
        "created": int(info.created_unix_s),
        "owner": owner,
    }


def version_json(
    rec: VersionRecord,
    current: int | None,
    quality: dict[str, float],
    task: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    return {
        "object": "adapter_version",
        "id": rec.id,
        "version": rec.version,
        "sha256": rec.sha256,
        "size_bytes": rec.size_bytes,
        "base_model": rec.base_model,
        "source": rec.source,
        "round_id": rec.round_id,
        "parent": rec.parent,
        "created": int(rec.created_unix_s),
        "current": rec.version == current,
        "pruned": rec.pruned,
        "quality": dict(sorted(quality.items())),
        "task": dict(sorted((task or {}).items())),
    }


class AdapterAdmin:
    def __init__(
        self, settings: GatewaySettings, bus: Bus, store: AdapterStore, catalog: ModelCatalog
    ) -> None:
        self.settings = settings
        self.bus = bus
        self.store = store
        self.catalog = catalog

    async def load(self, req: LoadLoraAdapterRequest) -> dict[str, Any]:
        name = req.lora_name
        retry_s = self.settings.retry_after_s
        try:
            listed = name in await self.store.list_adapters()
            before = await self.store.meta(name)
            if req.tenant is not None:
                await self.store.set_meta(name, {OWNER_FIELD: req.tenant})
        except (StoreError, RedisError, OSError) as exc:
            raise store_down(exc, retry_s) from None
        try:
            info = await self.bus.request(
                subjects.aggregator("import"),
                ImportAdapter(
                    adapter=name,
                    path=req.lora_path,
                    # An adapter for another base model is refused (422), unless the request says otherwise.
                    base_model=req.base_model or self.settings.base_model,
                    domains=req.domains,
                ),
                AdapterVersionInfo,
                timeout_s=self.settings.admin_timeout_s,
            )
        except BusError as exc:
            # Undo the owner only when the import surely did not happen (a refusal, or no aggregator);
            # after a timeout it may still land, and must land owned, never shared.
            if isinstance(exc, NoResponders) or 400 <= exc.code < 500:
                await self._undo_load(name, listed, before, req.tenant)
            raise from_aggregator(exc, "lora_path") from None
        finally:
            self.catalog.invalidate()
        owner = req.tenant if req.tenant is not None else before.get(OWNER_FIELD)
        log.info(
            "loaded adapter %s from %s (owner %s)",
            info.version_id,
            req.lora_path,
            owner or "shared",
            extra={"adapter": name, "version": info.version},
        )
        return version_info_json(info, owner or None)

    async def _undo_load(self, name: str, listed: bool, before: dict[str, str], tenant: str | None) -> None:
        if tenant is None:
            return
        try:
            await self.store.set_meta(name, {OWNER_FIELD: before.get(OWNER_FIELD, "")})
            if not listed:
                await self.store.delete_adapter_name(name)
        except (StoreError, RedisError, OSError) as exc:
            log.error("could not undo the owner of %s after a failed load: %s", name, exc)

    async def unload(self, req: UnloadLoraAdapterRequest) -> dict[str, Any]:
        name = req.lora_name
        try:
            if name not in await self.store.list_adapters():
                raise adapter_not_found(name)
            kept = len(await self.store.version_numbers(name))
            await self.store.delete_adapter_name(name)
        except (StoreError, RedisError, OSError) as exc:
            raise store_down(exc, self.settings.retry_after_s) from None
        finally:
            self.catalog.invalidate()
        log.info("unloaded adapter %s (%d versions kept)", name, kept, extra={"adapter": name})
        return {"object": "lora_adapter", "lora_name": name, "unloaded": True, "versions_kept": kept}

    async def _owner_if_visible(self, name: str, principal: Principal) -> str | None:
        """The adapter's owner, or APIError 404 when `principal` may not see it (or it is unknown)."""
        if principal.is_admin:
            if not await self.store.version_numbers(name):
                raise adapter_not_found(name, "name")
            return (await self.store.meta(name)).get(OWNER_FIELD) or None
        try:
            cards = await self.catalog.adapters()
        except StoreError as exc:
            raise store_down(exc, self.settings.retry_after_s) from None
        card = cards.get(name)
        if card is None or not can_use_adapter(principal, card.owner):
            raise adapter_not_found(name, "name")
        return card.owner

    async def versions(self, name: str, principal: Principal) -> dict[str, Any]:
        try:
            owner = await self._owner_if_visible(name, principal)
            current = await self.store.current(name)
            data = []
            for rec in await self.store.list_versions(name):
                quality = await self.store.quality(name, rec.version)
                task = await self.store.task_quality(name, rec.version)
                data.append(version_json(rec, current, quality, task))
            listed = name in await self.store.list_adapters()
        except (StoreError, RedisError, OSError) as exc:
            raise store_down(exc, self.settings.retry_after_s) from None
        return {
            "object": "list",
            "adapter": name,
            "owner": owner,
            "loaded": listed,
            "current": version_id(name, current) if current is not None else None,
            "data": data,
        }

    async def rollback(self, name: str, req: RollbackRequest, principal: Principal) -> dict[str, Any]:
        try:
            owner = await self._owner_if_visible(name, principal)
        except (StoreError, RedisError, OSError) as exc:
            raise store_down(exc, self.settings.retry_after_s) from None
        try:
            info = await self.bus.request(
                subjects.aggregator("rollback"),
                RollbackAdapter(adapter=name, to_version=req.version, reason=req.reason),
                AdapterVersionInfo,
                timeout_s=self.settings.admin_timeout_s,
            )
        except BusError as exc:
            raise from_aggregator(exc, "version") from None
        finally:
            self.catalog.invalidate()
        log.info("rolled %s back to the content of v%d as %s", name, req.version, info.version_id)
        return version_info_json(info, owner)
