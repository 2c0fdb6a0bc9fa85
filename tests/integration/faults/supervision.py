"""Fault 7: a replica crashes (SIGKILL) under load while the launcher supervises the stack, as `collm up`
does. Nobody restarts it by hand: supervision must, while the other replica serves.

`supervised_replica_kill` runs against any `SupervisedTarget` (a gateway, a way to crash a replica's
process, and supervision's restart count for it), so the same scenario measures the tiny-model
`FaultStack` (tests, `replica_supervised`) and a real `collm up` process with SmolLM2
(`python -m collm_bench faults supervise`). What it measures, from the client's side:

* `first_new_accepted_s` and `first_new_served_s`: from the kill until a request sent after it was
  first accepted by another replica (its response headers), and until such a request first got a
  token from another replica: when new requests are served again. New requests leave all the time:
  the load's, whenever one of its requests ends, and a probe (one short stream) every `probe_every_s`
  while fewer than `probe_max_in_flight` are pending, so that probing adds little load. A request
  routed to the dead replica before the gateway notices is refused by NATS at once (no responders) and
  placed on the next replica. How long every new request waited for its first token during the outage
  (the surviving replica now holds the whole load) is `ttft_s.outage`; `every request sent after the
  kill succeeded` is a check.
* `restarted_s`: from the kill until supervision has started the replica again; `serving_again_s`: until
  the first token that replica generates for a request sent after the kill (the report's recovery).
* every request's fate: completed where it was accepted, moved before its first token and completed on
  another replica (`system_fingerprint` names another replica than `x-collm-replica`; plain requests
  carry the new replica in both, so the gateway's retry counters are reported too), ended with a clear
  error (an envelope, in the stream or as the status), or lost (anything else: must be 0).

The kill is timed to catch, when it can within `catch_window_s`, a stream on the victim that has been
accepted and has no token yet (the case the gateway moves), else a stream that has just begun.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import httpx

from collm_ops.supervise import SupervisionPolicy

from .harness import CLIENT_TIMEOUT_S, FaultStack, metric, wait_for
from .probe import Outcome, one_request, run_load
from .report import FaultReport

RETRY_REASONS = ("no_responders", "lost_before_first_token", "refused_503_after_accept", "accept_timeout")


@dataclass
class SupervisedTarget:
    gateway_url: str
    model: str
    replicas: tuple[str, ...]
    # SIGKILL replica `rid`'s process (a crash: supervision, not the caller, starts it again).
    crash: Callable[[str], Awaitable[None]]
    # How many times supervision has restarted replica `rid` so far.
    restarts: Callable[[str], int]


async def _retries(url: str) -> dict[str, float]:
    out = {}
    for reason in RETRY_REASONS:
        with contextlib.suppress(httpx.HTTPError):
            out[reason] = await metric(f"{url}/metrics", "collm_gateway_retries_total", reason=reason)
    return out


def _quantiles(xs: list[float]) -> dict[str, float | None]:
    if not xs:
        return {"n": 0, "p50": None, "max": None}
    return {"n": len(xs), "p50": round(statistics.median(xs), 3), "max": round(max(xs), 3)}


async def supervised_replica_kill(
    t: SupervisedTarget,
    victim: str = "r0",
    concurrency: int = 16,
    max_tokens: int = 64,
    streams_only: bool = False,
    warm_s: float = 2.0,
    after_back_s: float = 2.0,
    probe_every_s: float = 0.2,
    probe_tokens: int = 8,
    probe_max_in_flight: int = 2,
    client_timeout_s: float = CLIENT_TIMEOUT_S,
    catch_window_s: float = 10.0,
    back_limit_s: float = 60.0,
    failover_goal_s: float = 2.0,
) -> FaultReport:
    report = FaultReport("replica_supervised")
    retries0 = await _retries(t.gateway_url)
    restarts0 = t.restarts(victim)
    stop = asyncio.Event()
    live: dict[int, tuple[str | None, float]] = {}
    waiting: dict[int, tuple[str | None, float]] = {}
    served_ok: dict[str, int] = {}
    kill: dict[str, Any] = {}
    back: dict[str, float] = {}

    def count(o: Outcome) -> None:
        by = o.generated_by
        if o.kind == "ok" and by is not None:
            served_ok[by] = served_ok.get(by, 0) + 1
        if "t" in kill and o.kind == "ok" and by == victim and o.sent_s > kill["t"] and "serving" not in back:
            back["serving"] = (o.first_data_s or o.end_s) - kill["t"]

    load = asyncio.create_task(
        run_load(
            t.gateway_url,
            t.model,
            concurrency=concurrency,
            duration_s=3600,
            max_tokens=max_tokens,
            timeout_s=client_timeout_s,
            stop=stop,
            on_outcome=count,
            live=live,
            waiting=waiting,
            streams_only=streams_only,
        )
    )
    probes: list[Outcome] = []

    async def prober() -> None:
        async with httpx.AsyncClient(timeout=client_timeout_s) as http:
            pending: set[asyncio.Task[None]] = set()
            i = 1 << 29  # indices apart from the load's

            async def one(index: int) -> None:
                o = await one_request(
                    http, t.gateway_url, t.model, stream=True, max_tokens=probe_tokens,
                    timeout_s=client_timeout_s, index=index, prompt="Probe.",
                )  # fmt: skip
                probes.append(o)
                count(o)

            while not stop.is_set():
                if len(pending) < probe_max_in_flight:
                    task = asyncio.create_task(one(i))
                    pending.add(task)
                    task.add_done_callback(pending.discard)
                    i += 1
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), probe_every_s)
            if pending:
                await asyncio.gather(*pending)

    probe_task = asyncio.create_task(prober())
    try:
        await asyncio.sleep(warm_s)
        await wait_for(lambda: served_ok.get(victim, 0) > 0, 60, f"a request served by {victim}", 0.01)

        def accepted_no_token() -> bool:
            return any(r == victim for r, _ in list(waiting.values()))

        def fresh_stream() -> bool:
            now = time.monotonic()
            return any(r == victim and now - s < 0.05 for r, s in list(live.values()))

        moment = "accepted_no_token"
        try:
            await wait_for(accepted_no_token, catch_window_s, "a stream accepted by the victim", 0.002)
        except AssertionError:
            moment = "fresh_stream"
            await wait_for(fresh_stream, 20, f"a stream just begun on {victim}", 0.005)
        kill["t"] = time.monotonic()
        kill["moment"] = moment
        kill["victim_streams_waiting"] = sum(r == victim for r, _ in list(waiting.values()))
        kill["victim_streams_live"] = sum(r == victim for r, _ in list(live.values()))
        await t.crash(victim)
        kill["crash_returned_s"] = time.monotonic() - kill["t"]

        async def restarted() -> bool:
            return t.restarts(victim) > restarts0

        with contextlib.suppress(AssertionError):
            await wait_for(restarted, back_limit_s, f"{victim} restarted by supervision", 0.05)
            back["restarted"] = time.monotonic() - kill["t"]
        with contextlib.suppress(AssertionError):
            await wait_for(
                lambda: "serving" in back, back_limit_s - (time.monotonic() - kill["t"]), f"{victim} serving"
            )
        await asyncio.sleep(after_back_s)
    finally:
        stop.set()
        outcomes = await load
        await probe_task
    t_kill = kill.get("t", float("inf"))
    everything = sorted([*outcomes, *probes], key=lambda o: o.sent_s)
    # The first token the victim generated again (`back` noted the first such request to *end*).
    firsts = [
        (o.first_data_s or o.end_s) - t_kill
        for o in everything
        if o.kind == "ok" and o.generated_by == victim and o.sent_s > t_kill
    ]
    if firsts:
        back["serving"] = min(firsts)
    report.add_outcomes(everything)
    retries = {k: v - retries0.get(k, 0.0) for k, v in (await _retries(t.gateway_url)).items()}
    report.retried = int(sum(retries.values()))
    report.recovery_s = back.get("serving")
    report.recovery_what = f"kill -> first token generated by the restarted {victim}"

    new = [o for o in everything if o.sent_s > t_kill and o.replica not in (victim, None)]
    accepted = [o.headers_s - t_kill for o in new if o.status == 200 and o.headers_s is not None]
    served = [
        o.first_data_s - t_kill for o in new if o.kind == "ok" and o.generated_by != victim and o.first_data_s
    ]
    first_new_accepted_s = min(accepted, default=None)
    first_new_served_s = min(served, default=None)
    t_back = t_kill + back.get("serving", float("inf"))
    outage = [o for o in everything if t_kill < o.sent_s < t_back]
    in_flight = [o for o in everything if o.sent_s < t_kill < o.end_s]
    errors = [o for o in everything if o.kind == "error"]
    after = [o for o in everything if o.sent_s > t_kill]
    fates = {
        "completed": sum(o.kind == "ok" and not o.moved for o in everything),
        "moved_and_completed": sum(o.moved for o in everything),
        "clear_error": sum(o.kind == "error" for o in everything),
        "lost": sum(o.kind == "lost" for o in everything),
    }
    ttft_probe = [o.first_data_s - o.sent_s for o in probes if o.kind == "ok" and o.first_data_s]
    ttft_probe_outage = [o.first_data_s - o.sent_s for o in outage if o in probes and o.first_data_s]
    report.details.update(
        victim=victim,
        kill_moment=kill.get("moment"),
        victim_streams_at_kill={
            "accepted_no_token": kill.get("victim_streams_waiting"),
            "streaming": kill.get("victim_streams_live"),
        },
        first_new_accepted_s=_round(first_new_accepted_s),
        first_new_served_s=_round(first_new_served_s),
        restarted_s=round(back["restarted"], 3) if "restarted" in back else None,
        serving_again_s=round(back["serving"], 3) if "serving" in back else None,
        fates=fates,
        gateway_retries=retries,
        in_flight_at_kill=len(in_flight),
        in_flight_on_victim=sum(o.replica == victim for o in in_flight),
        sent_after_kill=len(after),
        ok_after_kill=sum(o.kind == "ok" for o in after),
        during_outage={
            "sent": len(outage),
            "ok": sum(o.kind == "ok" for o in outage),
            "served_by": {r: sum(o.generated_by == r for o in outage if o.kind == "ok") for r in t.replicas},
        },
        probe_ttft_s={"all": _quantiles(ttft_probe), "outage": _quantiles(ttft_probe_outage)},
        ttft_s={
            "before_kill": _quantiles(_ttfts(o for o in everything if o.sent_s < t_kill)),
            "outage": _quantiles(_ttfts(outage)),
            "after_back": _quantiles(_ttfts(o for o in everything if o.sent_s > t_back)),
        },
        error_codes=sorted({str(o.code) for o in errors}),
        error_messages=sorted({o.message for o in errors})[:4],
        served_by={r: served_ok.get(r, 0) for r in t.replicas},
        supervision_restarts=t.restarts(victim) - restarts0,
    )
    report.check("nothing lost", fates["lost"] == 0)
    report.check("errors only for requests in flight at the kill", all(o.sent_s < t_kill for o in errors))
    report.check(
        "errors say the replica was lost",
        all(o.code == "replica_lost" or victim in o.message for o in errors),
    )
    report.check("every request sent after the kill succeeded", all(o.kind == "ok" for o in after))
    report.check(
        f"new requests accepted by another replica within {failover_goal_s:g} s of the kill",
        first_new_accepted_s is not None and first_new_accepted_s <= failover_goal_s,
    )
    report.check(
        f"new requests get their first token within {failover_goal_s:g} s of the kill",
        first_new_served_s is not None and first_new_served_s <= failover_goal_s,
    )
    report.check(
        "the other replicas served during the outage",
        any(o.kind == "ok" and o.generated_by not in (victim, None) for o in outage),
    )
    report.check("supervision restarted the victim", t.restarts(victim) > restarts0)
    report.check(
        f"the victim serves again within {back_limit_s:g} s",
        "serving" in back and back["serving"] <= back_limit_s,
    )
    return report


def _ttfts(outcomes: Iterable[Outcome]) -> list[float]:
    """Time to first token of each completed stream, as its client saw it."""
    return [o.first_data_s - o.sent_s for o in outcomes if o.kind == "ok" and o.stream and o.first_data_s]


def _round(x: float | None) -> float | None:
    return round(x, 3) if x is not None else None


def fault_stack_target(fs: FaultStack) -> SupervisedTarget:
    stack = fs.s

    async def crash(rid: str) -> None:
        # Through the launcher's kill, but not held: supervision sees a crash and restarts it.
        await asyncio.to_thread(stack.kill, f"replica-{rid}", hold=False)

    def restarts(rid: str) -> int:
        entry = stack.supervision_status()["services"].get(f"replica-{rid}", {})
        return int(entry.get("restarts") or 0)

    return SupervisedTarget(fs.gateway_url, fs.base_model, fs.replicas, crash, restarts)


async def replica_supervised(
    fs: FaultStack, policy: SupervisionPolicy | None = None, **kw: Any
) -> FaultReport:
    """`supervised_replica_kill` on the fault stack with supervision on for its duration (the stack is
    shared with the other scenarios, which restart what they kill by hand)."""
    await fs.ensure_healthy()
    stack = fs.s
    was_supervising = stack.supervisor is not None
    stack.supervise(policy)
    try:
        report = await supervised_replica_kill(fault_stack_target(fs), **kw)
        # Leave the stack as the other scenarios expect it: every replica fresh again.
        async with httpx.AsyncClient() as http:
            await wait_for(
                lambda: _all_fresh(fs, http), 60, "every replica fresh after the supervised restart"
            )
        report.check("no other process died", not fs.failed_children())
        return report
    finally:
        if not was_supervising:
            stack.unsupervise()


async def _all_fresh(fs: FaultStack, http: httpx.AsyncClient) -> bool:
    return set(fs.replicas) <= set(await fs.fresh_replicas(http))
