"""The models the gateway serves: the base model, and every adapter in the store addressed as a model.

`"medical"` means the adapter's current version (the replica decides which exact version serves and
reports it back); `"medical@v3"` pins version 3. Adapter names and current versions are read from the
`AdapterStore` and reused for `models_cache_ttl_s` (a publication event on NATS drops the cache at once),
so the request path does not touch Redis per request. When Redis is unreachable, the last good listing
keeps serving; only a name never seen before is refused, with 503.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from redis.exceptions import RedisError

from collm_common.clock import Clock, WallClock
from collm_common.store import AdapterStore, NotFound, StoreError
from collm_gateway.auth import Principal, can_use_adapter
from collm_gateway.errors import model_not_found, unavailable

log = logging.getLogger(__name__)

# The adapter-metadata field (store.meta) naming the owner tenant; absent or "": shared by every tenant.
OWNER_FIELD = "tenant"

_PINNED = re.compile(r"^(?P<name>[A-Za-z0-9_-]{1,64})@v(?P<version>[1-9][0-9]{0,9})$")
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclass(frozen=True)
class ModelRef:
    """A resolved `model` field."""

    requested: str
    adapter: str | None = None
    version: int | None = None

    @property
    def label(self) -> str:
        """The model as a metrics label: the base model id or the adapter name (never a version)."""
        return self.adapter if self.adapter is not None else self.requested


def parse_model_id(model: str, base_model: str) -> ModelRef | None:
    """Split a model id into adapter and pinned version; None when it cannot name anything."""
    if model == base_model:
        return ModelRef(requested=model)
    m = _PINNED.match(model)
    if m:
        return ModelRef(requested=model, adapter=m["name"], version=int(m["version"]))
    if _NAME.match(model):
        return ModelRef(requested=model, adapter=model)
    return None


@dataclass(frozen=True)
class AdapterCard:
    name: str
    current: int | None
    created_unix_s: float
    owner: str | None


class ModelCatalog:
    def __init__(
        self, store: AdapterStore, base_model: str, ttl_s: float, clock: Clock | None = None
    ) -> None:
        self.store = store
        self.base_model = base_model
        self.ttl_s = ttl_s
        self.clock = clock or WallClock()
        self._cards: dict[str, AdapterCard] | None = None
        self._read_at = float("-inf")

    def invalidate(self) -> None:
        self._read_at = float("-inf")

    async def adapters(self) -> dict[str, AdapterCard]:
        """Adapter cards by name (cached; raises StoreError only when nothing was ever read)."""
        now = self.clock.monotonic()
        if self._cards is not None and now - self._read_at < self.ttl_s:
            return self._cards
        try:
            cards: dict[str, AdapterCard] = {}
            for name in await self.store.list_adapters():
                current = await self.store.current(name)
                created = 0.0
                if current is not None:
                    try:
                        created = (await self.store.get_version(name, current)).created_unix_s
                    except NotFound:
                        current = None
                meta = await self.store.meta(name)
                cards[name] = AdapterCard(name, current, created, meta.get(OWNER_FIELD) or None)
        except (StoreError, RedisError, OSError) as exc:
            if self._cards is None:
                raise StoreError(f"adapter store unreachable: {exc}") from exc
            log.warning("adapter store unreachable, serving the last listing: %s", exc)
            return self._cards
        self._cards = cards
        self._read_at = now
        return cards

    async def resolve(self, model: str, principal: Principal, retry_after_s: int = 1) -> ModelRef:
        """The model a request names, or APIError 404 (unknown) / 503 (store down, name unknown)."""
        ref = parse_model_id(model, self.base_model)
        if ref is None:
            raise model_not_found(model, "model ids are the base model, `adapter` or `adapter@vN`")
        if ref.adapter is None:
            return ref
        try:
            cards = await self.adapters()
        except StoreError as exc:
            raise unavailable(
                f"cannot resolve adapter {ref.adapter!r}: {exc}", retry_after_s, "store_unavailable"
            ) from None
        card = cards.get(ref.adapter)
        if card is None or not can_use_adapter(principal, card.owner):
            raise model_not_found(model)
        if ref.version is None:
            if card.current is None:
                raise model_not_found(model, "the adapter has no published version yet")
            return ref
        await self._check_version(ref, card, retry_after_s)
        return ref

    async def _check_version(self, ref: ModelRef, card: AdapterCard, retry_after_s: int) -> None:
        assert ref.adapter is not None and ref.version is not None
        if card.current == ref.version:
            return
        try:
            rec = await self.store.get_version(ref.adapter, ref.version)
        except NotFound:
            raise model_not_found(ref.requested, f"{ref.adapter} has no version {ref.version}") from None
        except (StoreError, RedisError, OSError) as exc:
            raise unavailable(
                f"cannot check {ref.requested}: adapter store unreachable ({exc})",
                retry_after_s,
                "store_unavailable",
            ) from None
        if rec.pruned:
            raise model_not_found(ref.requested, "that version was pruned by retention; its weights are gone")
