"""The real services, each logged in as its own NATS and Redis user, on the shipped secured configuration.

Two replicas (tiny model, each with its own local data), the gateway, the coordinator and the aggregator
run as processes through the launcher, each with COLLM_NATS_USER/COLLM_NATS_PASSWORD of its own user and
COLLM_REDIS_URL of its own Redis user; the launcher and the test act as the operator (admin). Proved end
to end: an OpenAI client's streamed request through the gateway, the coordinator's shares reaching the
replicas, a sample consumed from JetStream by its replica, and a whole federated round planned by the
coordinator (its plan, StartTraining, local training, updates on JetStream, evaluation, the gate, the
publication, each participant swapping the new version in on the aggregator's event). The server's own
log then holds exactly one permission violation, the known one: a replica that created an adapter's v1
announcing it, which replicas may not do (the others pick v1 up from the store).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from collm_common import subjects
from collm_common.bus import Bus
from collm_common.lora import encode_adapter
from collm_common.settings import CommonSettings
from collm_common.store import AdapterStore
from collm_common.streams import ensure_streams
from collm_common.wire import encode
from collm_common.wire.adapters import TrainingSample
from collm_common.wire.admin import StatusRequest
from collm_common.wire.control import ControlReply, StartTraining
from collm_common.wire.rounds import RoundOutcome
from collm_common.wire.telemetry import ReplicaTelemetry
from collm_ops.launcher import ReplicaSpec, Stack, StackConfig
from collm_ops.servers import free_port
from tests.integration.security.conftest import SecureNats, SecureRedis, running

pytestmark = pytest.mark.integration
ADAPTER = "fed"
FRESH = "fresh"  # an adapter a replica creates itself
DOMAINS = {"r0": "med", "r1": "math"}


def write_dataset(d: Path, domain: str, n_train: int = 16, n_eval: int = 4) -> None:
    for split, n in (("train", n_train), ("eval", n_eval)):
        (d / split).mkdir(parents=True, exist_ok=True)
        with (d / split / f"{domain}.jsonl").open("w") as f:
            for i in range(n):
                row = {"id": f"{domain}-{split}-{i}", "prompt": f"{domain} question {i}"}
                f.write(json.dumps({**row, "response": f"{domain} answer {i % 3}", "domain": domain}) + "\n")


def login(nats: SecureNats, user: str) -> dict[str, str]:
    return {"COLLM_NATS_USER": user, "COLLM_NATS_PASSWORD": nats.passwords[user]}


@pytest.fixture
def stack(secure_nats: SecureNats, secure_redis: SecureRedis, tmp_path: Path) -> Iterator[Stack]:
    n, r = secure_nats, secure_redis
    replicas = []
    for rid, domain in DOMAINS.items():
        write_dataset(tmp_path / f"data-{rid}", domain)
        env = {
            **login(n, f"replica-{rid}"),
            "COLLM_REDIS_URL": r.url("collm-replica"),
            "COLLM_TELEMETRY_INTERVAL_S": "0.5",
            # No periodic re-read of the store in this test: a new version reaches a replica only by the
            # aggregator's AdapterPublished event (its subscription, the aggregator's publication).
            "COLLM_ADAPTER_SYNC_INTERVAL_S": "600",
            "COLLM_TRAIN_MICRO_TOKENS": "32",
            "COLLM_TRAIN_BATCH_TOKENS": "64",
            "COLLM_TRAIN_MAX_SEQ_LEN": "48",
            "COLLM_EVAL_MAX_EXAMPLES": "4",
            "COLLM_PUBLISH_EVERY_STEPS": "2",
            "COLLM_ROUND_DEADLINE_MARGIN_S": "1",
            "COLLM_FT_SHARE_DEFAULT": "0.9",
        }
        replicas.append(ReplicaSpec(rid, data_dir=str(tmp_path / f"data-{rid}"), env=env))
    cfg = StackConfig(
        nats_url=n.url,
        redis_url=r.url("collm-reader"),
        redis_prefix=r.prefix,
        model="tiny",
        gateway_port=free_port(),
        replicas=replicas,
        start_servers=False,
        run_dir=tmp_path / "run",
        ready_timeout_s=180,
        nats_user="admin",
        nats_password=n.passwords["admin"],
        service_env={
            "aggregator": {
                **login(n, "aggregator"),
                "COLLM_REDIS_URL": r.url("collm-aggregator"),
                "COLLM_DEFAULT_PLAN": "false",
                "COLLM_EVAL_MAX_EXAMPLES": "4",
                "COLLM_EVAL_TIMEOUT_S": "60",
                "COLLM_CONTROL_TIMEOUT_S": "30",
            },
            # The coordinator plans the round of `fed` (seeded as v1 before the start) as soon as both
            # replicas report; its shares let the participants train (it owns the rounds it plans).
            "coordinator": {
                **login(n, "coordinator"),
                "COLLM_REDIS_URL": r.url("collm-reader"),
                "COLLM_COORDINATOR_FAST_INTERVAL_S": "0.5",
                "COLLM_COORDINATOR_WARMUP_S": "1",
                "COLLM_COORDINATOR_SLOW_INTERVAL_S": "60",
                "COLLM_COORDINATOR_ROUND_DEADLINE_S": "30",
                "COLLM_COORDINATOR_ADAPTERS": json.dumps({ADAPTER: sorted(DOMAINS.values())}),
                "COLLM_COORDINATOR_PROBE_BUDGET_TOKENS": "96",
                "COLLM_COORDINATOR_STORE_REFRESH_S": "1",
            },
            "gateway": {**login(n, "gateway"), "COLLM_REDIS_URL": r.url("collm-gateway")},
        },
    )
    # The streams exist before the services start, as after the aggregator's (or an operator's) first
    # start: a replica may not create them (a replica starting first logs one refused STREAM.CREATE).
    asyncio.run(create_streams(n))
    asyncio.run(seed_v1(r))
    with running(cfg) as s:
        yield s


async def create_streams(nats: SecureNats) -> None:
    nc = await nats.connect("admin")
    try:
        await ensure_streams(nc.jetstream(), replicas=1)
    finally:
        await nc.close()


async def seed_v1(redis: SecureRedis) -> None:
    """`fed@v1` for the tiny model as a replica creates it (PEFT's init: B = 0), written by the aggregator's
    Redis user."""
    from collm_replica.lora_bank import LiveLora, module_shapes
    from collm_replica.models import build_tiny_model
    from collm_replica.settings import ReplicaSettings

    model, _ = build_tiny_model(0)
    layers = int(model.config.num_hidden_layers)
    live = LiveLora.init_new(ReplicaSettings().lora_spec, layers, module_shapes(model), "tiny")
    store = AdapterStore.from_url(redis.url("collm-aggregator"), redis.prefix)
    try:
        blob = encode_adapter(live.to_weights({}))
        await store.publish(ADAPTER, blob, expected_current=None, base_model="tiny", source="create")
    finally:
        await store.close()


async def eventually(probe: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = probe()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        await asyncio.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def chat(stack: Stack, model: str) -> tuple[str, str | None]:
    """One streamed chat completion through the gateway: (text, the adapter version that served it)."""
    client = OpenAI(base_url=f"{stack.gateway_url}/v1", api_key="secured", http_client=httpx.Client())
    raw = client.chat.completions.with_raw_response.create(
        model=model,
        messages=[{"role": "user", "content": "med question 1"}],
        max_tokens=6,
        temperature=0,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
    return text, raw.headers.get("x-collm-adapter-version")


async def test_the_stack_serves_and_runs_a_round_with_least_privilege(
    stack: Stack, secure_nats: SecureNats
) -> None:
    t0 = time.monotonic()
    # A request end to end: gateway (its user) -> replica (its user) -> tokens streamed back.
    models = [m.id for m in OpenAI(base_url=f"{stack.gateway_url}/v1", api_key="k").models.list()]
    text, _served = await asyncio.to_thread(chat, stack, models[0])  # the base model
    assert text

    operator = await Bus.connect(
        CommonSettings(
            nats_url=secure_nats.url, nats_user="admin", nats_password=secure_nats.passwords["admin"]
        ),
        "operator",
    )
    events: list[RoundOutcome] = []
    shares: dict[str, str] = {}
    last: dict[str, ReplicaTelemetry] = {}
    try:

        async def on_event(o: RoundOutcome, _m: object) -> None:
            events.append(o)

        async def on_telemetry(t: ReplicaTelemetry, _m: object) -> None:
            shares[t.replica_id] = t.ft_share_source
            last[t.replica_id] = t

        await operator.subscribe(subjects.round_events_all(), RoundOutcome, on_event)
        await operator.subscribe(subjects.telemetry_all(), ReplicaTelemetry, on_telemetry)
        # The coordinator's fast loop commands each replica's fine-tuning share (control, its user).
        await eventually(
            lambda: all(shares.get(r) == "coordinator" for r in DOMAINS), 30, "coordinator shares"
        )

        # A sample for r1 on JetStream (operator), consumed and acknowledged by r1's own durable consumer.
        sample = TrainingSample(
            sample_id=uuid.uuid4().hex, replica_id="r1", domain="math", prompt="p", response="r"
        )
        await operator.js.publish(subjects.samples("r1"), encode(sample), stream=subjects.STREAM_SAMPLES)

        async def consumed() -> bool:
            info = await operator.js.consumer_info(subjects.STREAM_SAMPLES, "replica-r1")
            return info.delivered.stream_seq >= 1 and info.num_ack_pending == 0 and info.num_pending == 0

        await eventually(consumed, 30, "r1 consuming its sample")

        # The coordinator's round (its plan through the aggregator's `open_round`), run to the end:
        # StartTraining, local training, updates on JetStream, evaluation, the gate, the publication.
        try:
            final = await eventually(
                lambda: next((e for e in events if e.state in ("published", "held_back", "aborted")), None),
                90,
                "the coordinator's round to end",
            )
        except AssertionError:
            seen = {r: (t.ft_share, t.round_role, t.training_jobs) for r, t in last.items()}
            raise AssertionError(
                f"no round ended: {events}\n{seen}\n{stack.logs.getvalue()[-6000:]}"
            ) from None  # type: ignore[attr-defined]
        logs = stack.logs.getvalue()  # type: ignore[attr-defined]
        assert final.state in ("published", "held_back"), f"{final.reason}\n{logs[-6000:]}"
        assert final.policy == "collm" and final.participants, final
        assert sorted(final.accepted) == sorted(final.participants) and final.rejected == [], final
        assert final.domain_losses_after, "replicas evaluated the candidate"
        # The gateway's dashboard, as the gateway's own user: round events, the aggregator's round
        # records and the coordinator's status.
        resp = await asyncio.to_thread(httpx.get, f"{stack.gateway_url}/dashboard/state", timeout=10)
        dash = resp.json()
        assert any(r["round_id"] == final.round_id and r["final"] for r in dash["rounds"]), dash["rounds"]
        assert dash["coordinator"]["status_unix_s"] is not None, dash["coordinator"]
        if final.state == "published":
            want = f"{ADAPTER}@v{final.new_version}"
            for rid in final.participants:  # each swapped the new version in (the aggregator's event)

                async def serves(rid: str = rid) -> bool:
                    t = await operator.request(
                        subjects.replica(rid, "status"), StatusRequest(), ReplicaTelemetry
                    )
                    return any(a.version_id == want for a in t.adapters)

                await eventually(serves, 30, f"{rid} serving {want}")
            text, served = await asyncio.to_thread(chat, stack, ADAPTER)
            # That version or a later one: the adapter's next round (async rounds) may have published since.
            name, _, version = served.partition("@v")
            assert text and name == ADAPTER and int(version) >= final.new_version, served
        # A replica asked to create a new adapter writes its v1 to the store but may not announce it.
        reply = await operator.request(
            subjects.replica("r0", "control"), StartTraining(adapter=FRESH, token_budget=8), ControlReply, 30
        )
        assert reply.ok, reply.message
        refused = ("replica-r0", "Publish", subjects.adapter_published(FRESH))
        await eventually(lambda: refused in secure_nats.violations(), 10, "the refused announcement")

        def violation_lines() -> list[str]:
            return [ln for ln in stack.logs.getvalue().splitlines() if "violation" in ln.lower()]  # type: ignore[attr-defined]

        # The replica hears of its refused publish from the server asynchronously, after the server logs it.
        await eventually(violation_lines, 10, "the replica's warning about its refused announcement")
        elapsed_s = time.monotonic() - t0
        print(f"secured stack: request, shares, sample and a {final.state} round in {elapsed_s:.1f}s")
    finally:
        await operator.close()

    # Everything above ran without a single refused publish or subscription, but that one by design: the
    # server logged it, and so did the replica (a warning), and nothing else did.
    assert set(secure_nats.violations()) == {("replica-r0", "Publish", subjects.adapter_published(FRESH))}
    lines = violation_lines()
    assert lines and all(
        ln.strip().startswith("replica-r0") and subjects.adapter_published(FRESH) in ln for ln in lines
    ), lines
