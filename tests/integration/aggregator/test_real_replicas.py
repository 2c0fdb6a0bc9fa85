"""A federated round with real processes: three `python -m collm_replica` (tiny model, each with its own
local dataset) and `python -m collm_aggregator`, on real NATS and Redis. Two clearly named malicious
participant doubles (tests/doubles/participant.py) send a NaN update and a wrong-base update.

Checks: the round completes despite them, the new version is served by all three replicas, rollback
republishes old content as a new version that all three serve, and no version is ever overwritten.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import pytest_asyncio

from collm_common import subjects
from collm_common.bus import Bus, BusError
from collm_common.settings import CommonSettings
from collm_common.store import AdapterStore
from collm_common.wire import decode
from collm_common.wire.admin import AdapterVersionInfo, RollbackAdapter, StatusRequest
from collm_common.wire.control import ControlReply, StartTraining
from collm_common.wire.inference import GENERATE_EVENT, Accepted, GenerateRequest, SamplingParams
from collm_common.wire.rounds import ParticipantPlan, RoundOutcome, RoundPlan
from collm_common.wire.telemetry import ReplicaTelemetry
from tests.doubles.participant import ParticipantBehaviour, ParticipantDouble

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        not (Path(__file__).resolve().parents[3] / "services/replica/collm_replica/__main__.py").exists(),
        reason="the replica service does not exist yet",
    ),
]
ADAPTER = "fed"
REPLICAS = {"r0": "med", "r1": "math", "r2": "code"}


def write_dataset(d: Path, domain: str, n_train: int = 24, n_eval: int = 6) -> None:
    for split, n in (("train", n_train), ("eval", n_eval)):
        (d / split).mkdir(parents=True, exist_ok=True)
        with (d / split / f"{domain}.jsonl").open("w") as f:
            for i in range(n):
                row = {
                    "id": f"{domain}-{split}-{i}",
                    "prompt": f"{domain} question {i}",
                    "response": f"{domain} answer {i % 3}",
                }
                f.write(json.dumps({**row, "domain": domain}) + "\n")


def spawn(module: str, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("COLLM_")}
    full.update({"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "COLLM_LOG_JSON": "false", **env})
    out = log.open("wb")
    return subprocess.Popen([sys.executable, "-m", module], env=full, stdout=out, stderr=subprocess.STDOUT)


async def eventually(probe: Callable[[], object], timeout_s: float, what: str) -> object:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        v = probe()
        if asyncio.iscoroutine(v):
            v = await v
        if v:
            return v
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


class Stack:
    def __init__(self, nats_url: str, redis_url: str, prefix: str, tmp: Path) -> None:
        self.nats_url, self.redis_url, self.prefix, self.tmp = nats_url, redis_url, prefix, tmp
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.events: list[RoundOutcome] = []

    def common_env(self) -> dict[str, str]:
        return {
            "COLLM_NATS_URL": self.nats_url,
            "COLLM_REDIS_URL": self.redis_url,
            "COLLM_REDIS_PREFIX": self.prefix,
        }

    def start(self) -> None:
        for rid, domain in REPLICAS.items():
            data = self.tmp / f"data-{rid}"
            write_dataset(data, domain)
            self.procs[rid] = spawn(
                "collm_replica",
                {
                    **self.common_env(),
                    "COLLM_REPLICA_ID": rid,
                    "COLLM_MODEL": "tiny",
                    "COLLM_DATA_DIR": str(data),
                    "COLLM_TORCH_THREADS": "1",
                    "COLLM_TELEMETRY_INTERVAL_S": "0.2",
                    "COLLM_ADAPTER_SYNC_INTERVAL_S": "1",
                    "COLLM_TRAIN_MICRO_TOKENS": "32",
                    "COLLM_TRAIN_BATCH_TOKENS": "64",
                    "COLLM_TRAIN_MAX_SEQ_LEN": "48",
                    "COLLM_EVAL_MAX_EXAMPLES": "6",
                    "COLLM_PUBLISH_EVERY_STEPS": "2",
                    "COLLM_ROUND_DEADLINE_MARGIN_S": "1",
                    "COLLM_FT_SHARE_DEFAULT": "0.9",
                },
                self.tmp / f"{rid}.log",
            )
        self.procs["aggregator"] = spawn(
            "collm_aggregator",
            {
                **self.common_env(),
                "COLLM_DEFAULT_PLAN": "false",
                "COLLM_EVAL_MAX_EXAMPLES": "6",
                "COLLM_EVAL_TIMEOUT_S": "60",
                "COLLM_CONTROL_TIMEOUT_S": "30",
            },
            self.tmp / "aggregator.log",
        )

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()

    def logs(self) -> str:
        return "\n".join(f"--- {n}\n{(self.tmp / f'{n}.log').read_text()[-3000:]}" for n in self.procs)


@pytest_asyncio.fixture
async def stack(nats_server, redis_server, tmp_path: Path) -> AsyncIterator[Stack]:
    s = Stack(nats_server.url, redis_server.url, f"t{uuid.uuid4().hex[:8]}", tmp_path)
    s.start()
    try:
        yield s
    finally:
        s.stop()


async def served_version(bus: Bus, rid: str) -> str | None:
    req = GenerateRequest(
        request_id=uuid.uuid4().hex,
        prompt="med question 1",
        adapter=ADAPTER,
        sampling=SamplingParams(max_tokens=1, temperature=0.0),
    )
    try:
        async with bus.stream(subjects.replica(rid, "generate"), req) as replies:
            first = decode(GENERATE_EVENT, (await replies.next(30)).data)
    except BusError:
        return None
    return first.adapter_version_id if isinstance(first, Accepted) else None


async def test_round_with_real_replicas(stack: Stack) -> None:
    settings = CommonSettings(nats_url=stack.nats_url, nats_connect_timeout_s=10)
    bus = await Bus.connect(settings, "test-client")
    store = AdapterStore.from_url(stack.redis_url, stack.prefix)
    doubles: list[ParticipantDouble] = []
    try:

        async def on_event(o: RoundOutcome, _m: object) -> None:
            stack.events.append(o)

        await bus.subscribe(subjects.round_events_all(), RoundOutcome, on_event)

        async def ready(subject: str, msg: object, reply: type) -> bool:
            try:
                await bus.request(subject, msg, reply, timeout_s=2)  # type: ignore[arg-type]
                return True
            except BusError:
                return False

        for rid in REPLICAS:
            await eventually(
                lambda rid=rid: ready(subjects.replica(rid, "status"), StatusRequest(), ReplicaTelemetry),
                90,
                f"{rid} up",
            )
        from collm_common.wire.admin import AggregatorStatus

        await eventually(
            lambda: ready(subjects.aggregator("status"), StatusRequest(), AggregatorStatus),
            60,
            "aggregator up",
        )

        # v1: a replica creates the adapter itself (StartTraining without a base version).
        reply = await bus.request(
            subjects.replica("r0", "control"),
            StartTraining(adapter=ADAPTER, token_budget=32),
            ControlReply,
            timeout_s=30,
        )
        assert reply.ok, reply.message
        assert await store.current(ADAPTER) == 1

        for name, mode in (("evil-nan", "nan"), ("evil-base", "wrong_base")):
            doubles.append(
                await ParticipantDouble(bus, store, name, ParticipantBehaviour(mode=mode)).start(
                    telemetry=False
                )
            )

        now = time.time()
        plan = RoundPlan(
            adapter=ADAPTER,
            base_version=1,
            participants=[
                ParticipantPlan(replica_id=r, token_budget=96, learning_rate=5e-3)
                for r in [*REPLICAS, "evil-nan", "evil-base"]
            ],
            quorum=3,
            opened_unix_s=now,
            deadline_unix_s=now + 90,
            policy="test",
        )
        opened = await bus.request(subjects.aggregator("open_round"), plan, RoundOutcome, timeout_s=10)
        assert opened.state == "opened"
        rid = opened.round_id
        final = await eventually(
            lambda: next(
                (
                    e
                    for e in stack.events
                    if e.round_id == rid and e.state in ("published", "held_back", "aborted")
                ),
                None,
            ),
            150,
            "the round to finish",
        )
        assert isinstance(final, RoundOutcome)
        assert final.state == "published", f"{final.reason}\n{stack.logs()}"
        assert sorted(final.accepted) == ["r0", "r1", "r2"]
        assert {r.replica_id: r.code for r in final.rejected} == {
            "evil-nan": "not_finite",
            "evil-base": "wrong_base_version",
        }
        assert final.new_version == 2 and set(final.domain_losses_after) == {"med", "math", "code"}
        assert await store.current(ADAPTER) == 2

        for r in REPLICAS:
            await eventually(lambda r=r: _is(served_version(bus, r), f"{ADAPTER}@v2"), 30, f"{r} serving v2")
        digests = {v.version: v.sha256 for v in await store.list_versions(ADAPTER)}

        info = await bus.request(
            subjects.aggregator("rollback"),
            RollbackAdapter(adapter=ADAPTER, to_version=1),
            AdapterVersionInfo,
            timeout_s=10,
        )
        assert info.version == 3 and info.sha256 == digests[1] and info.source == "rollback"
        for r in REPLICAS:
            await eventually(lambda r=r: _is(served_version(bus, r), f"{ADAPTER}@v3"), 30, f"{r} serving v3")
        after = {v.version: v.sha256 for v in await store.list_versions(ADAPTER)}
        assert {k: after[k] for k in digests} == digests and sorted(after) == [1, 2, 3]
    finally:
        for d in doubles:
            await d.stop()
        await bus.close()
        await store.close()


async def _is(coro: object, want: str) -> bool:
    return (await coro) == want  # type: ignore[misc]
