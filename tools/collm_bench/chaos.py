"""Chaos under load (pure): the kill schedule, each request's fate, and the summary of a chaos run.

`python -m collm_bench adaptation run --chaos` runs the default stack (`collm up`: the demo adapting,
supervision on) under the load generator's replay while a chaos loop SIGKILLs one random process of the stack
(replicas, gateway, coordinator, aggregator, NATS, Redis) at the times `kill_schedule` draws, measures each
kill's time to full service, uploads training samples throughout, and at the end checks that every accepted
sample reached a replica's local data and every stored adapter blob matches its sha256. This module classifies
and summarises; the result is `bench/results/faults/chaos.json` (`RESULT_SCHEMA`).

A request's fate (`fate`, from the load generator's record):

* `answered`: a complete answer;
* `clear_error`: an HTTP error status (the OpenAI envelope), 4xx or 503 with `Retry-After`, or an error
  event in a stream that had started;
* `bad_5xx`: any other 5xx, or a 503 without `Retry-After` (goal 0);
* `connection_lost`: the connection ended without an HTTP answer, or a stream ended without an error
  event or `[DONE]` (the gateway process was killed while it held the request: one gateway has no one
  to hand its connections to);
* `hung`: no complete answer within the client's timeout (goal 0).
"""

from __future__ import annotations

import random
import statistics
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

RESULT_SCHEMA = "collm-chaos/1"
FATES = ("answered", "clear_error", "bad_5xx", "connection_lost", "hung")


def kill_schedule(
    seed: int, window_s: float, targets: Sequence[str], min_gap_s: float = 30.0, max_gap_s: float = 90.0
) -> list[tuple[float, str]]:
    """(seconds from the start, process) of each kill: gaps uniform in [min_gap_s, max_gap_s], the
    process uniform among `targets`, the last kill at least `min_gap_s` before the window ends."""
    rng = random.Random(seed)
    out: list[tuple[float, str]] = []
    t = rng.uniform(min_gap_s, max_gap_s)
    while t <= window_s - min_gap_s:
        out.append((round(t, 1), rng.choice(list(targets))))
        t += rng.uniform(min_gap_s, max_gap_s)
    return out


def fate(rec: Mapping[str, Any]) -> str:
    """One load-generator record's fate (module docstring)."""
    status, http = rec.get("status"), rec.get("http_status")
    if status == "ok":
        return "answered"
    if status == "timeout":
        return "hung"
    if http is None or (http < 400 and not str(rec.get("error") or "").startswith("error event")):
        return "connection_lost"
    if http >= 500 and not (http == 503 and rec.get("retry_after")):
        return "bad_5xx"
    return "clear_error"


def fates(records: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Counts per fate; of the non-answered, per HTTP status and the most frequent error messages."""
    counts: Counter[str] = Counter()
    statuses: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    for r in records:
        f = fate(r)
        counts[f] += 1
        if f != "answered":
            statuses[f"{f}: {r.get('http_status') or '-'}"] += 1
            reasons[str(r.get("error") or r.get("status"))[:72]] += 1
    return {"requests": sum(counts.values()), **{f: counts.get(f, 0) for f in FATES},
            "by_status": dict(sorted(statuses.items())),
            "top_reasons": dict(reasons.most_common(8))}  # fmt: skip


def recovery(kills: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Time to full service after the kills: p50 and max over those that recovered, per process kind
    too, and how many never did within the wait."""
    done = [float(k["recovery_s"]) for k in kills if k.get("recovery_s") is not None]
    by_kind: dict[str, list[float]] = {}
    for k in kills:
        if k.get("recovery_s") is not None:
            by_kind.setdefault(kind_of(str(k["target"])), []).append(float(k["recovery_s"]))
    return {
        "kills": len(kills),
        "recovered": len(done),
        "p50_s": round(statistics.median(done), 1) if done else None,
        "max_s": round(max(done), 1) if done else None,
        "by_kind": {
            k: {"kills": len(v), "p50_s": round(statistics.median(v), 1), "max_s": round(max(v), 1)}
            for k, v in sorted(by_kind.items())
        },
    }


def kind_of(target: str) -> str:
    """`replica-r0` -> `replica`; other processes are their own kind."""
    return "replica" if target.startswith("replica") else target


def verdicts(summary: Mapping[str, Any]) -> dict[str, bool]:
    """The goals: nothing hung, no 5xx but 503 with Retry-After, no accepted sample lost, no blob that
    fails its digest, every kill recovered."""
    r = summary["requests"]
    return {
        "no request hung": r["hung"] == 0,
        "no 5xx other than 503 with Retry-After": r["bad_5xx"] == 0,
        "no accepted sample lost": summary["samples"]["lost"] == 0,
        "no adapter blob failing its sha256": summary["versions"]["digest_mismatch"] == 0,
        "every kill recovered": summary["recovery"]["recovered"] == summary["recovery"]["kills"],
    }


def table(summary: Mapping[str, Any]) -> str:
    """The results page's table."""
    r, s, v, rec = summary["requests"], summary["samples"], summary["versions"], summary["recovery"]
    rows = [
        ("requests: answered / clear error / connection lost (gateway killed)",
         f"{r['answered']} / {r['clear_error']} / {r['connection_lost']} of {r['requests']}", ""),
        ("requests hung", r["hung"], "0"),
        ("5xx other than 503 with Retry-After", r["bad_5xx"], "0"),
        ("accepted training samples lost", f"{s['lost']} of {s['accepted']}", "0"),
        ("adapter versions failing their sha256", f"{v['digest_mismatch']} of {v['checked']}", "0"),
        ("rounds published during the run", summary["rounds_published"], ""),
        ("kills; time to full service p50 / max",
         f"{rec['kills']}; {rec['p50_s']} / {rec['max_s']} s ({rec['recovered']} recovered)", ""),
    ]  # fmt: skip
    q = summary.get("quality") or {}
    if q:
        rows.append(
            ("served loss at the end, chaos / none (base)",
             "; ".join(f"{name} {_f(d.get('chaos'))} / {_f(d.get('no_chaos'))} ({_f(d.get('base'))})"
                       for name, d in sorted(q.items())), "")
        )  # fmt: skip
    lines = ["| measure | value | goal |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    return "\n".join(lines)


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"
