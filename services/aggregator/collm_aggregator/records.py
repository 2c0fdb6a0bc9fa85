"""Durable round records in Redis: what `rounds list|show` reads and what a restarted aggregator resumes.

Keys (prefix P = COLLM_REDIS_PREFIX):

* `P:agg:round_seq`: the round id counter (ids only grow, even across restarts);
* `P:agg:round:N`: hash with `plan` (RoundPlan), `outcome` (latest RoundOutcome), `evals` (EvalReports),
  `candidate_key`/`candidate_sha256` (the aggregate under evaluation);
* `P:agg:round:N:updates`: hash replica id -> UpdateRecord, written with HSETNX *before* the JetStream
  message is acknowledged, so an update is never lost between the bus and the round, and a redelivery
  never records it twice;
* `P:agg:rounds` (zset of every kept round id), `P:agg:active` (set of rounds not final yet);
* `P:agg:carry:{adapter}`: late updates waiting to be carried into the adapter's next round
  (late_policy=staleness).

Values are wire messages (msgpack via `collm_common.wire.encode`), so records and bus share one schema.
"""

from __future__ import annotations

from collections.abc import Sequence

from redis.asyncio.client import Redis

from collm_common.wire import decode, encode
from collm_common.wire.admin import UpdateRecord
from collm_common.wire.rounds import EvalReport, RoundOutcome, RoundPlan

_FINAL = ("published", "held_back", "aborted")


class RoundRecords:
    def __init__(self, redis: Redis, prefix: str, keep: int = 1000) -> None:
        self.r = redis
        self.prefix = prefix
        self.keep = keep

    def _k(self, *parts: str | int) -> str:
        return ":".join((self.prefix, "agg", *map(str, parts)))

    async def next_round_id(self) -> int:
        return int(await self.r.incr(self._k("round_seq")))

    async def last_round_id(self) -> int:
        v = await self.r.get(self._k("round_seq"))
        return int(v) if v is not None else 0

    async def reserve_round_id(self, round_id: int) -> None:
        """A plan that brings its own id: keep the counter ahead of it, so ids are never reused."""
        key = self._k("round_seq")
        cur = await self.r.get(key)
        if cur is None or int(cur) < round_id:
            await self.r.set(key, round_id)

    async def exists(self, round_id: int) -> bool:
        return bool(await self.r.exists(self._k("round", round_id)))

    async def create(self, plan: RoundPlan, outcome: RoundOutcome) -> bool:
        """Write a new round's plan and first outcome; False if the id is already taken."""
        key = self._k("round", plan.round_id)
        if not await self.r.hsetnx(key, "plan", encode(plan)):
            return False
        await self.r.hset(key, "outcome", encode(outcome))
        await self.r.zadd(self._k("rounds"), {str(plan.round_id): plan.round_id})
        if outcome.state not in _FINAL:
            await self.r.sadd(self._k("active"), str(plan.round_id))
        await self._trim()
        return True

    async def save_outcome(self, outcome: RoundOutcome) -> None:
        await self.r.hset(self._k("round", outcome.round_id), "outcome", encode(outcome))
        if outcome.state in _FINAL:
            await self.r.srem(self._k("active"), str(outcome.round_id))

    async def save_candidate(self, round_id: int, key: str, sha256: str) -> None:
        await self.r.hset(
            self._k("round", round_id), mapping={"candidate_key": key, "candidate_sha256": sha256}
        )

    async def candidate(self, round_id: int) -> tuple[str, str] | None:
        k, s = await self.r.hmget(self._k("round", round_id), ["candidate_key", "candidate_sha256"])
        return (k.decode(), s.decode()) if k and s else None

    async def save_evals(self, round_id: int, reports: Sequence[EvalReport]) -> None:
        packed = b"".join(len(b).to_bytes(4, "big") + b for b in (encode(r) for r in reports))
        await self.r.hset(self._k("round", round_id), "evals", packed)

    async def evals(self, round_id: int) -> list[EvalReport]:
        raw = await self.r.hget(self._k("round", round_id), "evals")
        out, i = [], 0
        while raw and i < len(raw):
            n = int.from_bytes(raw[i : i + 4], "big")
            out.append(decode(EvalReport, raw[i + 4 : i + 4 + n]))
            i += 4 + n
        return out

    async def plan(self, round_id: int) -> RoundPlan | None:
        raw = await self.r.hget(self._k("round", round_id), "plan")
        return decode(RoundPlan, raw) if raw else None

    async def outcome(self, round_id: int) -> RoundOutcome | None:
        raw = await self.r.hget(self._k("round", round_id), "outcome")
        return decode(RoundOutcome, raw) if raw else None

    async def active_ids(self) -> list[int]:
        return sorted(int(x) for x in await self.r.smembers(self._k("active")))

    # --- updates ------------------------------------------------------------------------------------
    async def add_update(self, round_id: int, record: UpdateRecord) -> bool:
        """Record an update durably (once per replica and round). False: one was already recorded."""
        field = ("late:" if record.late else "") + record.update.replica_id
        return bool(await self.r.hsetnx(self._k("round", round_id, "updates"), field, encode(record)))

    async def updates(self, round_id: int) -> list[UpdateRecord]:
        raw = await self.r.hgetall(self._k("round", round_id, "updates"))
        recs = [decode(UpdateRecord, v) for v in raw.values()]
        return sorted(recs, key=lambda u: (u.received_unix_s, u.update.replica_id))

    async def add_carry(self, adapter: str, record: UpdateRecord) -> None:
        field = f"{record.update.replica_id}@r{record.update.round_id}"
        await self.r.hsetnx(self._k("carry", adapter), field, encode(record))

    async def take_carry(self, adapter: str) -> list[UpdateRecord]:
        key = self._k("carry", adapter)
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.hgetall(key)
            pipe.delete(key)
            raw, _ = await pipe.execute()
        return [decode(UpdateRecord, v) for v in raw.values()]

    # --- listing --------------------------------------------------------------------------------------
    async def list_outcomes(self, adapter: str | None, state: str | None, limit: int) -> list[RoundOutcome]:
        """Newest first (the index holds at most `keep` records plus the active ones)."""
        out: list[RoundOutcome] = []
        ids = await self.r.zrevrange(self._k("rounds"), 0, -1)  # bounded by trimming: keep + active
        for o in await self._outcomes(ids):
            if (adapter and o.adapter != adapter) or (state and o.state != state):
                continue
            out.append(o)
            if len(out) >= limit:
                break
        return out

    async def _outcomes(self, ids: list[bytes]) -> list[RoundOutcome]:
        """Outcomes of many rounds in one round trip (ids as stored in the index)."""
        async with self.r.pipeline(transaction=False) as pipe:
            for rid in ids:
                pipe.hget(self._k("round", int(rid)), "outcome")
            raw = await pipe.execute()
        return [decode(RoundOutcome, b) for b in raw if b]

    async def count_by_state(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for o in await self._outcomes(await self.r.zrange(self._k("rounds"), 0, -1)):
            counts[o.state] = counts.get(o.state, 0) + 1
        return counts

    async def _trim(self) -> None:
        n = int(await self.r.zcard(self._k("rounds")))
        if n <= self.keep:
            return
        active = {int(x) for x in await self.r.smembers(self._k("active"))}
        for rid in await self.r.zrange(self._k("rounds"), 0, n - self.keep - 1):
            if int(rid) in active:
                continue
            await self.r.delete(self._k("round", int(rid)), self._k("round", int(rid), "updates"))
            await self.r.zrem(self._k("rounds"), rid)
