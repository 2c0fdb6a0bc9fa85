"""The adapter store: immutable, digest-checked adapter versions in Redis, and a CAS pointer per name.

Semantics (docs/architecture.md, Adapter identity):

* A version is `name@vN`. N comes from a per-name counter, so it only grows and is never reused, even
  when a write fails halfway. A version record is written once (a Lua script refuses to overwrite it)
  and carries the sha256 of its blob; every read of a blob verifies that digest.
* `current` is a pointer per name, moved only by compare-and-set (`cas_current`), which also refuses to
  point at a version whose blob is missing, and appends the move to an audit stream.
* Retention keeps the blobs of the newest `retention_versions` versions and the current one; older
  blobs are dropped, but their records (digest, provenance, quality) stay forever, so any served
  request can still be joined with what served it.
* A rollback never rewinds the pointer: it republishes an old version's content as a new N.

Key layout (prefix P = COLLM_REDIS_PREFIX; `{name}` is a Redis hash tag, so one adapter's keys share a
slot): `P:adapters` (set of names), `P:adapter:{name}:seq`, `P:adapter:{name}:v:N` (hash),
`P:adapter:{name}:versions` (zset), `P:adapter:{name}:current`, `P:adapter:{name}:quality:N` (hash),
`P:adapter:{name}:quality:N:sites` and `P:adapter:{name}:quality:N:task` (hashes of JSON),
`P:adapter:{name}:meta` (hash: owner tenant and the like), `P:events` (stream), `P:update:R:replica`
(local update blobs, with a TTL).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.client import Redis
from redis.asyncio.connection import parse_url
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import ExponentialBackoff

from collm_common.clock import Clock, WallClock
from collm_common.settings import CommonSettings, sentinel_addresses
from collm_common.subjects import check_token

# Short timeouts so a dead Redis fails fast, not hangs. After a Redis restart (or a Sentinel failover)
# every pooled connection is dead: a command that finds its connection closed reconnects (through the
# Sentinels: to the primary they name now) and is sent again, twice at most, instead of failing once
# per connection.
_CLIENT_OPTIONS: dict[str, Any] = {
    "socket_timeout": 5,
    "socket_connect_timeout": 2,
    "health_check_interval": 10,
}


def _retry() -> Retry:
    return Retry(ExponentialBackoff(cap=0.5, base=0.05), 2)


def redis_client(settings: CommonSettings) -> Redis:
    """The adapter store's Redis client (bytes in and out: blobs are binary): through the Sentinels when
    `redis_sentinels` is set (the primary named `redis_sentinel_master`, with COLLM_REDIS_URL's user,
    password and database), else straight to COLLM_REDIS_URL."""
    sentinels = sentinel_addresses(settings.redis_sentinels)
    if not sentinels:
        return aioredis.Redis.from_url(settings.redis_url, retry=_retry(), **_CLIENT_OPTIONS)
    login = {k: v for k, v in parse_url(settings.redis_url).items() if k in ("username", "password", "db")}
    tls = {"ssl": True} if settings.redis_url.startswith("rediss://") else {}
    sentinel_password = settings.redis_sentinel_password
    sentinel = Sentinel(
        sentinels,
        sentinel_kwargs={
            "password": sentinel_password.get_secret_value() if sentinel_password else None,
            "socket_timeout": _CLIENT_OPTIONS["socket_timeout"],
            "socket_connect_timeout": _CLIENT_OPTIONS["socket_connect_timeout"],
            **tls,
        },
        **_CLIENT_OPTIONS,
        **tls,
    )
    return sentinel.master_for(settings.redis_sentinel_master, retry=_retry(), **login)


class StoreError(Exception):
    pass


class NotFound(StoreError):
    pass


class CorruptBlob(StoreError):
    """A blob whose sha256 does not match its record: never served."""


class Conflict(StoreError):
    """A compare-and-set lost against a concurrent writer."""


def sha256_hex(blob: bytes) -> str:
    return hashlib.sha256(blob).hexdigest()


def version_id(name: str, version: int) -> str:
    return f"{name}@v{version}"


@dataclass(frozen=True)
class VersionRecord:
    name: str
    version: int
    sha256: str
    size_bytes: int
    base_model: str
    source: str
    created_unix_s: float
    round_id: int | None = None
    parent: int | None = None
    pruned: bool = False
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return version_id(self.name, self.version)


_CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
redis.call('ZADD', KEYS[2], tonumber(ARGV[1]), ARGV[1])
redis.call('SADD', KEYS[3], ARGV[2])
return 1
"""

_CAS = """
local cur = redis.call('GET', KEYS[1])
if (cur or '') ~= ARGV[1] then return {0, cur or ''} end
if redis.call('HEXISTS', KEYS[2], 'blob') == 0 then return {-1, cur or ''} end
redis.call('SET', KEYS[1], ARGV[2])
redis.call('XADD', KEYS[3], 'MAXLEN', '~', 10000, '*', 'adapter', ARGV[3], 'version', ARGV[2],
  'previous', cur or '', 'ts', ARGV[4], 'reason', ARGV[5])
return {1, ARGV[2]}
"""


class AdapterStore:
    def __init__(
        self, redis: Redis, prefix: str = "collm", retention_versions: int = 5, clock: Clock | None = None
    ) -> None:
        if retention_versions < 1:
            raise ValueError("retention_versions must be >= 1")
        self.clock = clock or WallClock()
        self.r = redis
        self.prefix = prefix
        self.retention_versions = retention_versions
        self._create = redis.register_script(_CREATE)
        self._cas = redis.register_script(_CAS)

    @classmethod
    def from_url(cls, url: str, prefix: str = "collm", retention_versions: int = 5) -> AdapterStore:
        """A store on the Redis at `url` (operators' tools, tests)."""
        client = aioredis.Redis.from_url(url, retry=_retry(), **_CLIENT_OPTIONS)
        return cls(client, prefix, retention_versions)

    @classmethod
    def connect(
        cls, settings: CommonSettings, retention_versions: int = 5, clock: Clock | None = None
    ) -> AdapterStore:
        """A service's store: `redis_client(settings)` under `redis_prefix`, timestamps from `clock`."""
        return cls(redis_client(settings), settings.redis_prefix, retention_versions, clock)

    async def close(self) -> None:
        await self.r.aclose()

    async def ping(self) -> bool:
        return bool(await self.r.ping())

    # --- keys ----------------------------------------------------------------------------------------
    def _k(self, name: str, *rest: str) -> str:
        return ":".join((self.prefix, "adapter", "{" + check_token(name, "adapter name") + "}", *rest))

    @property
    def _names_key(self) -> str:
        return f"{self.prefix}:adapters"

    @property
    def events_key(self) -> str:
        return f"{self.prefix}:events"

    # --- versions -------------------------------------------------------------------------------------
    async def create_version(
        self,
        name: str,
        blob: bytes,
        *,
        base_model: str,
        source: str,
        round_id: int | None = None,
        parent: int | None = None,
        meta: dict[str, Any] | None = None,
    ) -> VersionRecord:
        """Write a new immutable version (the pointer does not move). Returns its record."""
        if not blob:
            raise StoreError("an adapter version needs a non-empty blob")
        n = int(await self.r.incr(self._k(name, "seq")))
        rec = VersionRecord(
            name=name,
            version=n,
            sha256=sha256_hex(blob),
            size_bytes=len(blob),
            base_model=base_model,
            source=source,
            created_unix_s=self.clock.now(),
            round_id=round_id,
            parent=parent,
            meta=dict(meta or {}),
        )
        fields: list[Any] = [
            "blob", blob,
            "sha256", rec.sha256,
            "size_bytes", rec.size_bytes,
            "base_model", base_model,
            "source", source,
            "created_unix_s", repr(rec.created_unix_s),
            "round_id", "" if round_id is None else round_id,
            "parent", "" if parent is None else parent,
            "meta", json.dumps(rec.meta),
        ]  # fmt: skip
        keys = [self._k(name, "v", str(n)), self._k(name, "versions"), self._names_key]
        created = await self._create(keys=keys, args=[n, name, *fields])
        if int(created) != 1:  # only possible if the counter was reset under us: refuse, never overwrite
            raise Conflict(f"{version_id(name, n)} already exists; refusing to overwrite")
        return rec

    async def get_version(self, name: str, version: int) -> VersionRecord:
        raw = await self.r.hmget(
            self._k(name, "v", str(version)),
            ["sha256", "size_bytes", "base_model", "source", "created_unix_s", "round_id", "parent", "meta"],
        )
        if raw[0] is None:
            raise NotFound(f"{version_id(name, version)} does not exist")
        has_blob = await self.r.hexists(self._k(name, "v", str(version)), "blob")
        s = [v.decode() if isinstance(v, bytes) else v for v in raw]
        return VersionRecord(
            name=name,
            version=version,
            sha256=s[0],
            size_bytes=int(s[1]),
            base_model=s[2],
            source=s[3],
            created_unix_s=float(s[4]),
            round_id=int(s[5]) if s[5] else None,
            parent=int(s[6]) if s[6] else None,
            pruned=not has_blob,
            meta=json.loads(s[7] or "{}"),
        )

    async def get_blob(self, name: str, version: int) -> bytes:
        """The blob of `name@vN`, verified against its digest (raises CorruptBlob, NotFound)."""
        blob, digest = await self.r.hmget(self._k(name, "v", str(version)), ["blob", "sha256"])
        if digest is None:
            raise NotFound(f"{version_id(name, version)} does not exist")
        if blob is None:
            raise NotFound(f"{version_id(name, version)} was pruned by retention; its blob is gone")
        if sha256_hex(blob) != digest.decode():
            raise CorruptBlob(f"{version_id(name, version)} failed its sha256 check")
        return bytes(blob)

    async def list_adapters(self) -> list[str]:
        return sorted(n.decode() for n in await self.r.smembers(self._names_key))

    async def version_numbers(self, name: str) -> list[int]:
        return [int(v) for v in await self.r.zrange(self._k(name, "versions"), 0, -1)]

    async def list_versions(self, name: str) -> list[VersionRecord]:
        return [await self.get_version(name, n) for n in await self.version_numbers(name)]

    # --- the pointer ----------------------------------------------------------------------------------
    async def current(self, name: str) -> int | None:
        v = await self.r.get(self._k(name, "current"))
        return int(v) if v is not None else None

    async def cas_current(self, name: str, expected: int | None, new: int, reason: str = "") -> None:
        """Move `current` from `expected` to `new` atomically, or raise Conflict / NotFound."""
        res = await self._cas(
            keys=[self._k(name, "current"), self._k(name, "v", str(new)), self.events_key],
            args=["" if expected is None else str(expected), str(new), name, repr(self.clock.now()), reason],
        )
        status = int(res[0])
        if status == 1:
            return
        actual = res[1].decode() if isinstance(res[1], bytes) else res[1]
        if status == 0:
            raise Conflict(f"{name}: current is {actual or 'unset'}, expected {expected or 'unset'}")
        raise NotFound(f"{version_id(name, new)} has no blob; the pointer was not moved")

    async def publish(
        self,
        name: str,
        blob: bytes,
        *,
        expected_current: int | None,
        base_model: str,
        source: str,
        round_id: int | None = None,
        parent: int | None = None,
        meta: dict[str, Any] | None = None,
    ) -> VersionRecord:
        """Create a version and make it current in one step (CAS against `expected_current`).

        If the CAS loses, the created version stays as an unpublished record (its number is burnt,
        never reused) and Conflict is raised.
        """
        rec = await self.create_version(
            name, blob, base_model=base_model, source=source, round_id=round_id, parent=parent, meta=meta
        )
        await self.cas_current(name, expected_current, rec.version, reason=source)
        await self.apply_retention(name)
        return rec

    async def rollback(self, name: str, to_version: int, base_model: str | None = None) -> VersionRecord:
        """Republish the content of `name@v{to_version}` as a new version and make it current."""
        old = await self.get_version(name, to_version)
        blob = await self.get_blob(name, to_version)
        cur = await self.current(name)
        return await self.publish(
            name,
            blob,
            expected_current=cur,
            base_model=base_model or old.base_model,
            source="rollback",
            parent=to_version,
            meta={"rollback_of": version_id(name, to_version)},
        )

    async def apply_retention(self, name: str) -> list[int]:
        """Drop the blobs of versions older than the newest `retention_versions` (never the current)."""
        numbers = await self.version_numbers(name)
        cur = await self.current(name)
        keep = set(numbers[-self.retention_versions :]) | ({cur} if cur is not None else set())
        pruned = []
        for n in numbers:
            if n not in keep and await self.r.hdel(self._k(name, "v", str(n)), "blob"):
                pruned.append(n)
        return pruned

    # --- quality ----------------------------------------------------------------------------------------
    async def record_quality(self, name: str, version: int, losses: dict[str, float]) -> None:
        """`name@vN`'s comparable held-out loss per domain (the aggregator's `quality_ledger`: chained
        through paired comparisons from its first scored version; additive: later evals add domains)."""
        if losses:
            await self.r.hset(
                self._k(name, "quality", str(version)), mapping={k: repr(v) for k, v in losses.items()}
            )

    async def quality(self, name: str, version: int) -> dict[str, float]:
        raw = await self.r.hgetall(self._k(name, "quality", str(version)))
        return {k.decode(): float(v) for k, v in raw.items()}

    async def record_site_quality(self, name: str, version: int, rows: dict[str, dict[str, Any]]) -> None:
        """`name@vN`'s scores on each site (a replica's held-out share of a domain), keyed by site."""
        await self._record_quality_rows(name, version, "sites", rows)

    async def site_quality(self, name: str, version: int) -> dict[str, dict[str, Any]]:
        return await self._quality_rows(name, version, "sites")

    async def record_task_quality(self, name: str, version: int, scores: dict[str, dict[str, Any]]) -> None:
        """`name@vN`'s task metric per domain (`{"metric", "score", "examples", "sites"}`)."""
        await self._record_quality_rows(name, version, "task", scores)

    async def task_quality(self, name: str, version: int) -> dict[str, dict[str, Any]]:
        return await self._quality_rows(name, version, "task")

    async def _record_quality_rows(
        self, name: str, version: int, kind: str, rows: dict[str, dict[str, Any]]
    ) -> None:
        """`rows` into `name@vN`'s quality hash of `kind`, one JSON document per key (none: nothing)."""
        if rows:
            await self.r.hset(
                self._k(name, "quality", str(version), kind),
                mapping={k: json.dumps(v, sort_keys=True) for k, v in rows.items()},
            )

    async def _quality_rows(self, name: str, version: int, kind: str) -> dict[str, dict[str, Any]]:
        raw = await self.r.hgetall(self._k(name, "quality", str(version), kind))
        return {k.decode(): json.loads(v) for k, v in raw.items()}

    # --- adapter metadata (owner tenant etc.) -----------------------------------------------------------
    async def set_meta(self, name: str, meta: dict[str, str]) -> None:
        await self.r.hset(self._k(name, "meta"), mapping=meta)
        await self.r.sadd(self._names_key, name)

    async def meta(self, name: str) -> dict[str, str]:
        raw = await self.r.hgetall(self._k(name, "meta"))
        return {k.decode(): v.decode() for k, v in raw.items()}

    async def delete_adapter_name(self, name: str) -> None:
        """Hide a name from listings (unload); versions and records are kept for provenance."""
        await self.r.srem(self._names_key, name)
        await self.r.delete(self._k(name, "current"))

    # --- local update blobs (federated rounds) ----------------------------------------------------------
    def update_key(self, round_id: int, replica_id: str) -> str:
        return f"{self.prefix}:update:{int(round_id)}:{check_token(replica_id, 'replica id')}"

    async def put_update(
        self, round_id: int, replica_id: str, blob: bytes, ttl_s: int = 86400
    ) -> tuple[str, str]:
        """Store a participant's update blob once (SET NX). Returns (key, sha256)."""
        key = self.update_key(round_id, replica_id)
        if not await self.r.set(key, blob, nx=True, ex=ttl_s):
            raise Conflict(f"an update for round {round_id} from {replica_id} already exists")
        return key, sha256_hex(blob)

    async def delete_updates(self, keys: Sequence[str]) -> int:
        """Drop update blobs a finished round no longer needs (their TTL is only the fallback)."""
        mine = [k for k in keys if k.startswith(f"{self.prefix}:update:")]
        return int(await self.r.delete(*mine)) if mine else 0

    async def get_update(self, key: str, sha256: str) -> bytes:
        if not key.startswith(f"{self.prefix}:update:"):
            raise StoreError(f"{key!r} is not an update key of this store")
        blob = await self.r.get(key)
        if blob is None:
            raise NotFound(f"update blob {key} is missing (expired or never written)")
        if sha256_hex(blob) != sha256:
            raise CorruptBlob(f"update blob {key} failed its sha256 check")
        return bytes(blob)
