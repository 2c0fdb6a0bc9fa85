"""`collm adapters` and `collm rounds`: adapter versions from the store, rounds from the aggregator.

Reads go straight to the adapter store (Redis): a version record is immutable, so reading it needs no
service. Anything that changes state goes through the aggregator's endpoints (`rollback`), the one
writer of versions, reusing `collm_aggregator.cli.call`; so do round records (`rounds`, `round`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from collm_common.settings import CommonSettings
from collm_common.store import AdapterStore, NotFound, VersionRecord
from collm_common.wire.admin import (
    AdapterVersionInfo,
    GetRound,
    ListRounds,
    RollbackAdapter,
    RoundDetail,
    RoundList,
)
from collm_common.wire.rounds import RoundOutcome
from collm_ops.table import num, render_table, size, when


@dataclass
class AdapterSummary:
    name: str
    current: int | None
    versions: int
    latest: int | None
    current_source: str | None
    current_created_unix_s: float | None
    current_quality: dict[str, float]


async def list_adapters(store: AdapterStore) -> list[AdapterSummary]:
    out = []
    for name in await store.list_adapters():
        numbers = await store.version_numbers(name)
        cur = await store.current(name)
        rec = await store.get_version(name, cur) if cur is not None else None
        quality = await store.quality(name, cur) if cur is not None else {}
        out.append(
            AdapterSummary(
                name=name,
                current=cur,
                versions=len(numbers),
                latest=max(numbers) if numbers else None,
                current_source=rec.source if rec else None,
                current_created_unix_s=rec.created_unix_s if rec else None,
                current_quality=quality,
            )
        )
    return out


async def adapter_versions(store: AdapterStore, name: str) -> list[dict[str, Any]]:
    """Every version of `name`, oldest first, with whether it is current and its recorded quality."""
    numbers = await store.version_numbers(name)
    if not numbers:
        raise NotFound(f"adapter {name!r} has no versions")
    cur = await store.current(name)
    rows = []
    for n in numbers:
        rec: VersionRecord = await store.get_version(name, n)
        doc = asdict(rec)
        doc["id"] = rec.id
        doc["current"] = n == cur
        doc["quality"] = await store.quality(name, n)
        doc["task"] = await store.task_quality(name, n)
        rows.append(doc)
    return rows


def _quality(q: dict[str, float]) -> str:
    return " ".join(f"{k}={v:.3f}" for k, v in sorted(q.items())) or "-"


def _task(t: dict[str, dict[str, Any]]) -> str:
    return " ".join(f"{k} {v['metric']}={v['score']:.2f}" for k, v in sorted(t.items())) or "-"


def render_adapters(items: list[AdapterSummary]) -> str:
    if not items:
        return "no adapters in the store"
    rows = [
        [
            a.name,
            f"{a.name}@v{a.current}" if a.current is not None else "unset",
            a.versions,
            f"v{a.latest}" if a.latest is not None else "-",
            a.current_source,
            when(a.current_created_unix_s),
            _quality(a.current_quality),
        ]
        for a in items
    ]
    return render_table(
        ("ADAPTER", "CURRENT", "VERSIONS", "LATEST", "SOURCE", "CREATED", "EVAL LOSS (current)"), rows
    )


def render_versions(rows: list[dict[str, Any]]) -> str:
    table = [
        [
            ("* " if r["current"] else "  ") + r["id"],
            r["sha256"][:12],
            size(int(r["size_bytes"])),
            r["source"],
            r["round_id"],
            f"v{r['parent']}" if r["parent"] is not None else None,
            when(r["created_unix_s"]),
            "pruned" if r["pruned"] else "kept",
            _quality(r["quality"]),
            _task(r.get("task") or {}),
        ]
        for r in rows
    ]
    return render_table(
        (
            "VERSION (* current)",
            "SHA256",
            "SIZE",
            "SOURCE",
            "ROUND",
            "PARENT",
            "CREATED",
            "BLOB",
            "EVAL LOSS",
            "TASK",
        ),
        table,
    )


# --- through the aggregator -------------------------------------------------------------------------------
async def rollback(
    settings: CommonSettings, name: str, to_version: int, reason: str, timeout_s: float
) -> AdapterVersionInfo:
    from collm_aggregator.cli import call

    req = RollbackAdapter(adapter=name, to_version=to_version, reason=reason)
    return await call(settings, "rollback", req, AdapterVersionInfo, timeout_s=timeout_s)  # type: ignore[no-any-return]


async def rounds_list(
    settings: CommonSettings, adapter: str | None, state: str | None, limit: int, timeout_s: float
) -> RoundList:
    from collm_aggregator.cli import call

    req = ListRounds(adapter=adapter, state=state, limit=limit)
    return await call(settings, "rounds", req, RoundList, timeout_s=timeout_s)  # type: ignore[no-any-return]


async def round_detail(settings: CommonSettings, round_id: int, timeout_s: float) -> RoundDetail:
    from collm_aggregator.cli import call

    return await call(settings, "round", GetRound(round_id=round_id), RoundDetail, timeout_s=timeout_s)  # type: ignore[no-any-return]


def _losses(o: RoundOutcome) -> str:
    if o.eval_loss_before is None and o.eval_loss_after is None:
        return "-"
    return f"{num(o.eval_loss_before, 3)} -> {num(o.eval_loss_after, 3)}"


def render_version_info(v: AdapterVersionInfo) -> str:
    parent = f" (content of v{v.parent})" if v.parent is not None else ""
    return (
        f"{v.version_id} is current{parent}: sha256 {v.sha256[:12]}, {size(v.size_bytes)}, source {v.source}"
    )


def render_rounds(rounds: RoundList) -> str:
    if not rounds.rounds:
        return "no rounds recorded"
    rows = [
        [
            o.round_id,
            o.adapter,
            o.state,
            f"v{o.base_version}",
            f"v{o.new_version}" if o.new_version is not None else None,
            f"{len(o.accepted)}/{len(o.participants) or len(o.accepted)}",
            len(o.rejected),
            len(o.late),
            _losses(o),
            _quality(o.new_version_quality) if o.new_version is not None else None,
            o.policy or None,
            when(o.ts_unix_s),
            o.reason[:60] or None,
        ]
        for o in rounds.rounds
    ]
    return render_table(
        ("ROUND", "ADAPTER", "STATE", "BASE", "NEW", "ACCEPTED", "REJECTED", "LATE", "EVAL LOSS",
         "NEW VERSION'S LOSS", "POLICY", "AT", "REASON"),
        rows,
    )  # fmt: skip


def render_round(d: RoundDetail) -> str:
    o, p = d.outcome, d.plan
    out = [
        f"round {o.round_id}: {o.adapter} from v{o.base_version} -> {o.state}"
        + (f" (published v{o.new_version})" if o.new_version is not None else ""),
        f"  reason: {o.reason or '-'}",
        f"  plan: quorum {p.quorum} of {len(p.participants)}, policy {p.policy}, "
        f"opened {when(p.opened_unix_s)}, deadline {when(p.deadline_unix_s)}"
        + (f" ({p.reason})" if p.reason else ""),
        f"  strategy {o.strategy or '-'}, eval loss {_losses(o)}",
    ]
    if o.timeline:
        out.append("  timeline: " + ", ".join(f"{k} {when(v)}" for k, v in o.timeline.items()))
    if o.trace_id:
        out.append(f"  trace id: {o.trace_id}")
    out.append("")
    plan_rows = [[pp.replica_id, pp.token_budget, pp.learning_rate] for pp in p.participants]
    out.append(render_table(("PARTICIPANT", "TOKEN BUDGET", "LR"), plan_rows))
    if d.updates:
        out.append("")
        verdict = {r.replica_id: f"rejected: {r.code or r.reason}" for r in o.rejected}
        verdict.update(dict.fromkeys(o.accepted, "accepted"))
        rows = [
            [
                u.update.replica_id,
                f"v{u.update.base_version}",
                u.update.num_samples,
                u.update.num_tokens,
                num(u.update.train_loss, 3),
                size(u.size_bytes),
                "late" if u.late else verdict.get(u.update.replica_id, "pending"),
            ]
            for u in d.updates
        ]
        out.append(
            render_table(("UPDATE FROM", "BASE", "SAMPLES", "TOKENS", "TRAIN LOSS", "SIZE", "VERDICT"), rows)
        )
    if d.evals:
        out.append("")
        rows = [
            [e.replica_id, dl.domain, dl.num_examples, num(dl.current_loss, 3), num(dl.candidate_loss, 3)]
            for e in d.evals
            for dl in e.losses
        ]
        out.append(
            render_table(("EVALUATED BY", "DOMAIN", "EXAMPLES", "CURRENT LOSS", "CANDIDATE LOSS"), rows)
        )
    return "\n".join(out)
