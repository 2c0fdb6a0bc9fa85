"""A participant's update survives a Redis outage at the moment it finishes training (participant.py,
`_store_update`): the upload is retried until Redis is back, then the update goes out on JetStream; past
the round's deadline it is logged and counted as not sent. Its announcement on JetStream is retried the
same way while no stream takes it. Real replica (tiny model), real nats-server
and redis-server; Redis is stopped and restarted on the same port and data directory."""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client import REGISTRY

from collm_common import subjects
from collm_common.lora import decode_adapter
from collm_common.streams import ensure_streams
from collm_common.wire import decode
from collm_common.wire.control import ControlReply, PauseTraining, ResumeTraining, StartTraining
from collm_common.wire.rounds import LocalUpdate
from collm_ops.servers import ServerProcess
from tests.integration.replica.conftest import REPLICA_ID, Running, eventually

pytestmark = pytest.mark.integration

RETRIES = "collm_replica_update_upload_retries_total"
UPDATES = "collm_replica_round_updates_total"


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, {"replica": REPLICA_ID, **labels}) or 0.0


async def updates_of(r: Running) -> list[LocalUpdate]:
    got: list[LocalUpdate] = []
    await ensure_streams(r.bus.js, replicas=1)

    async def on_update(msg) -> None:  # noqa: ANN001
        got.append(decode(LocalUpdate, msg.data))
        await msg.ack()

    await r.bus.js.subscribe(subjects.updates_all(), cb=on_update, manual_ack=True)
    return got


async def control(r: Running, cmd: PauseTraining | ResumeTraining | StartTraining) -> None:
    rep = await r.bus.request(subjects.replica(REPLICA_ID, "control"), cmd, ControlReply, timeout_s=30)
    assert rep.ok, rep.message


async def round_finishing_while_redis_is_down(
    r: Running, redis: ServerProcess, round_id: int, deadline_in_s: float
) -> float:
    """Start a round's job, stop Redis, then let the job run: it trains without Redis (its base was read
    at the start) and finishes within a second, so its upload meets the outage. (Training is paused
    until Redis is down: a tiny job is done in a fraction of a second.) The job's deadline (Unix s)."""
    await control(r, PauseTraining())
    deadline_unix_s = time.time() + deadline_in_s
    await control(
        r,
        StartTraining(
            adapter="legal",
            token_budget=128,
            round_id=round_id,
            learning_rate=1e-3,
            deadline_unix_s=deadline_unix_s,
        ),
    )
    await asyncio.to_thread(redis.stop_keep_dir)
    await control(r, ResumeTraining())
    return deadline_unix_s


async def test_an_update_finished_while_redis_is_down_is_sent_once_redis_is_back(
    replica: Running, redis_server: ServerProcess
) -> None:
    updates = await updates_of(replica)
    retries0, sent0 = sample(RETRIES), sample(UPDATES, outcome="sent")
    await round_finishing_while_redis_is_down(replica, redis_server, 21, deadline_in_s=60.0)
    await eventually(lambda: sample(RETRIES) > retries0, 30, "an upload attempt while Redis is down")
    # The store client's own reconnects are long spent when Redis comes back 3 s later, after at
    # least three upload retries.
    await asyncio.sleep(3.0)
    await eventually(lambda: sample(RETRIES) - retries0 >= 3, 30, "three upload retries while Redis is down")
    assert not updates, "an update was announced without its blob"
    await asyncio.to_thread(redis_server.restart)
    back_s = time.monotonic()
    await eventually(lambda: updates, 10, "the update after Redis is back")
    arrived_after_s = time.monotonic() - back_s
    upd = updates[0]
    assert upd.round_id == 21 and upd.replica_id == REPLICA_ID and upd.adapter == "legal"
    assert upd.num_tokens >= 128
    blob = await replica.store.get_update(upd.blob_key, upd.sha256)
    assert decode_adapter(blob).extra["collm.round_id"] == "21"
    assert sample(RETRIES) - retries0 >= 3
    assert sample(UPDATES, outcome="sent") == sent0 + 1
    # Backoff is capped at 1 s: the update follows Redis's return within about that.
    assert arrived_after_s < 2.5, arrived_after_s


async def test_an_update_is_counted_as_not_sent_when_redis_stays_down_past_the_deadline(
    replica: Running, redis_server: ServerProcess
) -> None:
    updates = await updates_of(replica)
    lost0 = sample(UPDATES, outcome="not_sent_store_unreachable")
    deadline_unix_s = await round_finishing_while_redis_is_down(replica, redis_server, 22, deadline_in_s=8.0)
    try:
        await eventually(
            lambda: sample(UPDATES, outcome="not_sent_store_unreachable") > lost0, 20, "the update given up"
        )
        seen_unix_s = time.time()
    finally:
        await asyncio.to_thread(redis_server.restart)
    # Given up within the last second before the deadline (margin 0.5 s, backoff steps up to 1 s), as seen
    # by a poll of the counter every 20 ms: at most one poll and a busy event loop's lag (0.2 s) after it.
    assert deadline_unix_s - 1.6 <= seen_unix_s <= deadline_unix_s + 0.2, seen_unix_s - deadline_unix_s
    await asyncio.sleep(1.0)
    assert not updates
    assert await replica.store.r.exists(replica.store.update_key(22, REPLICA_ID)) == 0


async def test_an_update_is_announced_once_jetstream_takes_it_again(replica: Running) -> None:
    """The updates stream gone for 12 s when the update is stored (as while an R3 stream elects a
    leader after losing its NATS node, no responder answers): the announcement is retried until the
    stream is back, within the round's deadline."""
    sent0 = sample(UPDATES, outcome="sent")
    await ensure_streams(replica.bus.js, replicas=1)
    await replica.bus.js.delete_stream(subjects.STREAM_UPDATES)
    await control(
        replica,
        StartTraining(
            adapter="legal",
            token_budget=128,
            round_id=23,
            learning_rate=1e-3,
            deadline_unix_s=time.time() + 60.0,
        ),
    )
    stored_by_s = time.monotonic() + 30.0
    while not await replica.store.r.exists(replica.store.update_key(23, REPLICA_ID)):
        assert time.monotonic() < stored_by_s, "timed out waiting for the stored update"
        await asyncio.sleep(0.05)
    await asyncio.sleep(12.0)
    assert sample(UPDATES, outcome="sent") == sent0
    updates = await updates_of(replica)  # re-creates the stream
    await eventually(lambda: updates, 10, "the update after the stream is back")
    assert updates[0].round_id == 23 and updates[0].replica_id == REPLICA_ID
    assert sample(UPDATES, outcome="sent") == sent0 + 1
