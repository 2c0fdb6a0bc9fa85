"""Faults around federated rounds: Redis restarting before a publication (3), the aggregator SIGKILLed
mid-round (4), a participant that never answers (6). Each returns a `FaultReport` (see scenarios.py)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from typing import Any

import httpx

from collm_common import subjects
from collm_common.wire import decode
from collm_common.wire.control import ControlReply, PauseTraining, ResumeTraining
from collm_common.wire.rounds import EvaluateCandidate, RoundOutcome

from .harness import FaultStack, background_load, replica_status, wait_for
from .probe import Outcome, one_request
from .report import FaultReport
from .rounds import RoundWatch, answers, coordinator_stopped, ensure_adapter, open_round, verify_versions


# --- 3. Redis restarts -------------------------------------------------------------------------------------
async def redis_restart(
    fs: FaultStack, down_s: float = 3.0, adapter: str = "redisfault", crash: bool = False
) -> FaultReport:
    """A round of `adapter` (two real participants) is held at the moment the aggregator asks replicas
    to evaluate its candidate (the aggregator process is SIGSTOPped: the replicas still read the
    candidate and answer), then Redis stops and the aggregator continues: it receives the evaluations
    and attempts the publication while Redis is down. Meanwhile requests use `adapter`, resident on both
    replicas. Redis restarts (SIGTERM; `crash`: SIGKILL, losing at most the last second of writes under
    appendfsync everysec) on the same port with its append-only file; the publication must land
    after, the replicas must swap the new version in, and every blob in the store must verify."""
    report = FaultReport("redis_crash" if crash else "redis_restart")
    await fs.ensure_healthy()
    assert fs.redis is not None
    async with fs.bus("fault-redis") as bus, fs.store() as store, coordinator_stopped(fs, bus):
        base = await ensure_adapter(fs, bus, store, adapter)
        before = await verify_versions(store, adapter)
        watch = await RoundWatch().attach(bus)
        held: list[float] = []
        agg_pid = fs.s.child("aggregator").proc.pid
        # The reply inbox of each evaluation of the candidate, and whether its answer has been sent (seen on
        # every inbox: the answers wait in the stopped aggregator's socket).
        answered: dict[str, bool] = {}

        async def on_evaluate(raw: Any) -> None:
            with contextlib.suppress(Exception):
                req = decode(EvaluateCandidate, raw.data)
                if req.candidate_key and req.adapter == adapter:
                    if not held:
                        os.kill(agg_pid, signal.SIGSTOP)  # at once: the evaluation itself takes milliseconds
                        held.append(time.monotonic())
                    if raw.reply:
                        answered.setdefault(raw.reply, False)

        async def on_inbox(raw: Any) -> None:
            if raw.subject in answered:
                answered[raw.subject] = True

        # Subscribed first: a request reaches this connection before its reply does.
        await bus.nc.subscribe("_INBOX.>", cb=on_inbox)
        await bus.nc.subscribe(subjects.subject("replica", "*", "evaluate"), cb=on_evaluate)
        async with httpx.AsyncClient() as http:
            # The gateway lists the adapter while the store is up (it serves the last listing when down).
            warm = await one_request(http, fs.gateway_url, adapter, stream=False, max_tokens=4)
            opened = await open_round(
                bus, adapter, base, dict.fromkeys(fs.replicas, 64), len(fs.replicas), 60
            )
            round_id = opened.round_id
            try:
                await wait_for(lambda: held or watch.final(round_id), 60, "the candidate's evaluation")
                await wait_for(
                    lambda: watch.final(round_id) or (answered and all(answered.values())),
                    60,
                    "the replicas' answers to the candidate's evaluation",
                )
                t_down = time.monotonic()
                await asyncio.to_thread(fs.redis.kill if crash else fs.redis.stop)
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(agg_pid, signal.SIGCONT)
            outcomes: list[Outcome] = [warm]
            i = 0
            while time.monotonic() - t_down < down_s:
                outcomes.append(
                    await one_request(
                        http, fs.gateway_url, adapter, stream=i % 2 == 0, max_tokens=8, timeout_s=10, index=i
                    )
                )
                i += 1
                await asyncio.sleep(0.1)
            report.details["state_while_down"] = watch.last_state(round_id)
            published_while_down = watch.state(round_id, "published") is not None
            await asyncio.to_thread(fs.redis.restart)
            t_up = time.monotonic()
            t_final, out = await wait_for(lambda: watch.final(round_id), 60, f"round {round_id} to end")
            report.recovery_s = max(0.0, t_final - t_up)
            report.recovery_what = "Redis up -> the held publication landed"
            new_version = out.new_version
            served: dict[str, str] = {}

            async def all_serve_new() -> bool:
                for rid in fs.replicas:
                    st = await replica_status(bus, rid)
                    have = {a.name: a.version for a in st.adapters} if st else {}
                    served[rid] = f"v{have.get(adapter)}"
                return new_version is not None and all(v == f"v{new_version}" for v in served.values())

            with contextlib.suppress(AssertionError):
                await wait_for(all_serve_new, 30, "replicas to swap the new version in")
            after_requests = [
                await one_request(http, fs.gateway_url, adapter, stream=False, max_tokens=4, index=1000 + k)
                for k in range(4)
            ]
        outcomes += after_requests
        after = await verify_versions(store, adapter)
    report.add_outcomes(outcomes)
    during = [o for o in outcomes if t_down <= o.sent_s < t_up]
    report.details.update(
        round_id=round_id,
        held_at_evaluation=bool(held),
        final_state=out.state,
        final_reason=out.reason,
        new_version=new_version,
        versions_before=before["versions"],
        versions_after=after["versions"],
        broken=after["broken"],
        current_after=after["current"],
        replicas_serving=served,
        requests_during_outage=len(during),
        redis_down_s=round(t_up - t_down, 3),
    )
    report.check("nothing lost", report.lost == 0)
    report.check("the resident adapter kept serving during the outage", bool(during) and all(
        o.kind == "ok" for o in during))  # fmt: skip
    report.check("the round was held at its evaluation", bool(held))
    report.check("the publication was attempted during the outage", bool(held) and not published_while_down)
    report.check("the publication landed after the outage", out.state == "published" and t_final > t_up)
    report.check("the new version is current", new_version is not None and after["current"] == new_version)
    report.check(
        "no version lost or changed",
        all(after["versions"].get(v) == sha for v, sha in before["versions"].items()),
    )
    report.check("every blob verifies (sha256, decodes)", not after["broken"])
    report.check("every replica serves the new version", all(v == f"v{new_version}" for v in served.values()))
    report.check("requests after the outage succeed", all(o.kind == "ok" for o in after_requests))
    report.check("no process died", not fs.failed_children())
    return report


# --- 4. the aggregator is SIGKILLed mid-round ------------------------------------------------------------
async def aggregator_kill(fs: FaultStack, adapter: str = "aggfault") -> FaultReport:
    """A round of two real participants under light request traffic, driven through the two states the
    kills need. The second participant's training is paused (`PauseTraining`, an operator command) before
    the round opens, so once the first update is on JetStream the round is held in collecting: the
    aggregator is SIGKILLed there and restarted, then the second participant resumes. The moment the
    resumed round announces evaluating, the aggregator is SIGKILLed again (from the event's callback) and
    restarted. The round must resume from its durable updates and publish exactly once (or abort
    cleanly): never a half-aggregated version, every version complete with a verifying digest; requests
    are served throughout."""
    report = FaultReport("aggregator_kill")
    await fs.ensure_healthy()
    kills: list[dict[str, Any]] = []
    async with fs.bus("fault-aggregator") as bus, fs.store() as store, coordinator_stopped(fs, bus):
        base = await ensure_adapter(fs, bus, store, adapter)
        before = await verify_versions(store, adapter)
        watch = await RoundWatch().attach(bus)
        budgets = dict.fromkeys(fs.replicas, 64)
        held = fs.replicas[-1]  # sends its update only after the first kill
        killed_at_evaluating: list[float] = []
        round_ids: list[int] = []

        def kill_when_evaluating(o: RoundOutcome) -> None:
            if o.state == "evaluating" and o.round_id in round_ids and not killed_at_evaluating:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(fs.s.child("aggregator").proc.pid, signal.SIGKILL)
                killed_at_evaluating.append(time.monotonic())

        async def restart(why: str) -> None:
            code = await asyncio.to_thread(fs.s.kill, "aggregator")  # SIGKILL (or reaps a killed one)
            kills.append({"when": why, "state": watch.last_state(round_ids[0]), "exit_code": code,
                          "updates_on_jetstream": len(watch.updates_of(round_ids[0]))})  # fmt: skip
            await asyncio.to_thread(fs.s.restart, "aggregator")

        async def control(cmd: PauseTraining | ResumeTraining) -> None:
            reply = await bus.request(subjects.replica(held, "control"), cmd, ControlReply, timeout_s=30)
            assert reply.ok, reply.message

        await control(PauseTraining())
        try:
            async with background_load(fs) as served:
                opened = await open_round(bus, adapter, base, budgets, len(fs.replicas), 90)
                round_id = opened.round_id
                round_ids.append(round_id)
                await wait_for(
                    lambda: watch.updates_of(round_id) or watch.final(round_id), 60, "the first update"
                )
                await restart("first update on JetStream")
                t_restart = time.monotonic()
                watch.hooks.append(kill_when_evaluating)
                await control(ResumeTraining())
                await wait_for(lambda: killed_at_evaluating or watch.final(round_id), 90, "the evaluation")
                if killed_at_evaluating:
                    await restart("the round entered evaluation")
                    t_restart = time.monotonic()
                t_final, out = await wait_for(lambda: watch.final(round_id), 90, f"round {round_id} to end")
        finally:
            # Whatever happened, the held participant trains again (a failed scenario leaves no paused
            # replica to the next one).
            with contextlib.suppress(Exception):
                await control(ResumeTraining())
        report.add_outcomes(served)
        after = await verify_versions(store, adapter)
        round_versions = [
            v.version
            for v in await store.list_versions(adapter)
            if v.round_id == round_id and v.source == "round"
        ]
        await wait_for(lambda: answers(fs, bus, "aggregator"), 30, "the aggregator to answer")
    report.recovery_s = t_final - t_restart
    report.recovery_what = "last aggregator restart -> the round ended"
    report.details.update(
        round_id=round_id,
        kills=kills,
        final_state=out.state,
        final_reason=out.reason,
        accepted=out.accepted,
        new_version=out.new_version,
        versions_before=before["versions"],
        versions_after=after["versions"],
        versions_of_this_round=round_versions,
        broken=after["broken"],
    )
    report.check("the aggregator was killed twice mid-round", len(kills) == 2 and all(
        k["exit_code"] == -9 for k in kills))  # fmt: skip
    report.check("the kills found the round collecting, then evaluating",
                 [k["state"] for k in kills] == ["collecting", "evaluating"])  # fmt: skip
    report.check("the round resumed and published, or aborted cleanly", out.state in ("published", "aborted"))
    report.check("not aborted by an error of the aggregator itself", "aggregator error" not in out.reason)
    if out.state == "published":
        report.check(
            "it used the durable updates of both participants", sorted(out.accepted) == sorted(fs.replicas)
        )
        report.check("published exactly once", round_versions == [out.new_version])
        report.check("the published version is current", after["current"] == out.new_version)
    else:
        report.check("nothing of this round was published", not round_versions)
    report.check(
        "no version lost or changed",
        all(after["versions"].get(v) == sha for v, sha in before["versions"].items()),
    )
    report.check("every version complete and verifying", not after["broken"])
    report.check("requests were served throughout", bool(served) and all(o.kind == "ok" for o in served))
    report.check("no process died", not fs.failed_children())
    return report


# --- 6. a straggling participant ----------------------------------------------------------------------------
async def straggler(fs: FaultStack, deadline_s: float = 6.0, adapter: str = "straggle") -> FaultReport:
    """A round with the real replicas plus a participant that accepts StartTraining and never sends
    (the silent `ParticipantDouble` of tests/doubles, a clearly named double). With a quorum of the real
    ones the round closes at its deadline and publishes; a round of the silent one alone is aborted at
    its deadline. Measured: how long after the deadline each round ended."""
    from tests.doubles.participant import ParticipantBehaviour, ParticipantDouble

    report = FaultReport("straggler")
    await fs.ensure_healthy()
    async with fs.bus("fault-straggler") as bus, fs.store() as store, coordinator_stopped(fs, bus):
        base = await ensure_adapter(fs, bus, store, adapter)
        mute = await ParticipantDouble(bus, store, "mute", ParticipantBehaviour(mode="silent")).start(
            telemetry=False
        )
        try:
            async with background_load(fs) as served:
                watch = await RoundWatch().attach(bus)
                parts = {**dict.fromkeys(fs.replicas, 64), "mute": 64}
                o1 = await open_round(bus, adapter, base, parts, len(fs.replicas), deadline_s)
                t1, out1 = await wait_for(lambda: watch.final(o1.round_id), deadline_s + 60, "round 1 to end")
                close1 = watch.state(o1.round_id, "aggregating")
                base2 = await store.current(adapter) or base
                o2 = await open_round(bus, adapter, base2, {"mute": 64}, 1, deadline_s / 2)
                t2, out2 = await wait_for(lambda: watch.final(o2.round_id), deadline_s + 30, "round 2 to end")
        finally:
            await mute.stop()
    report.add_outcomes(served)
    wall = time.time() - time.monotonic()  # monotonic -> unix offset, for comparing with deadlines
    close_late_s = (close1[0] + wall - (o1.deadline_unix_s or 0)) if close1 else None
    abort_late_s = t2 + wall - o2.deadline_unix_s
    report.details.update(
        round_with_quorum={
            "state": out1.state,
            "accepted": out1.accepted,
            "reason": out1.reason,
            "closed_after_deadline_s": round(close_late_s, 3) if close_late_s is not None else None,
            "ended_after_deadline_s": round(t1 + wall - o1.deadline_unix_s, 3),
        },
        round_without_quorum={
            "state": out2.state,
            "reason": out2.reason,
            "ended_after_deadline_s": round(abort_late_s, 3),
        },
        existing_test="tests/integration/aggregator/test_rounds.py"
        "::test_silent_participant_never_blocks_past_the_deadline",
    )
    report.recovery_s = max(close_late_s or 0.0, abort_late_s)
    report.recovery_what = "round deadline -> the round closed (quorum) or aborted (no quorum)"
    report.check("the round with a quorum published without the straggler", out1.state == "published"
                 and sorted(out1.accepted) == sorted(fs.replicas))  # fmt: skip
    report.check("it closed within 1 s of its deadline", close_late_s is not None and close_late_s <= 1.0)
    report.check("the round without a quorum aborted", out2.state == "aborted")
    report.check("it aborted within 1 s of its deadline", abort_late_s <= 1.0)
    report.check("requests were served throughout", bool(served) and all(o.kind == "ok" for o in served))
    report.check("no process died", not fs.failed_children())
    return report
