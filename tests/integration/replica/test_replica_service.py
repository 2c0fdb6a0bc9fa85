"""The replica service over real NATS and Redis with the tiny model."""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest
from opentelemetry import trace

from collm_common import subjects
from collm_common.bus import BusError
from collm_common.lora import decode_adapter, encode_adapter
from collm_common.wire import decode, encode
from collm_common.wire.adapters import AdapterPublished, TrainingSample
from collm_common.wire.control import (
    ControlReply,
    PauseTraining,
    ResumeTraining,
    SetFineTuneShare,
    StartTraining,
    StopTraining,
    SyncAdapter,
)
from collm_common.wire.inference import (
    GENERATE_EVENT,
    CancelRequest,
    ChatMessage,
    GenerateRequest,
    SamplingParams,
)
from collm_common.wire.rounds import DomainLoss, EvalReport, EvaluateCandidate, LocalUpdate
from collm_common.wire.telemetry import ReplicaTelemetry
from collm_replica.lora_bank import LiveLora
from tests.integration.replica.conftest import REPLICA_ID, Running, eventually

pytestmark = pytest.mark.integration


def gen(prompt: str = "hello world", n: int = 6, **kw: object) -> GenerateRequest:
    return GenerateRequest(
        request_id=uuid.uuid4().hex,
        messages=[ChatMessage(role="user", content=prompt)],
        sampling=SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
        **kw,  # type: ignore[arg-type]
    )


async def collect(r: Running, req: GenerateRequest, headers: dict[str, str] | None = None) -> list:
    events = []
    async with r.bus.stream(subjects.replica(REPLICA_ID, "generate"), req, headers=headers) as stream:
        while True:
            ev = decode(GENERATE_EVENT, (await stream.next(30)).data)
            events.append(ev)
            if ev.kind in ("finished", "error"):
                return events


def adapter_blob(r: Running, seed: int, scale: float = 0.5) -> bytes:
    import torch

    ex = r.replica.engine.executor
    live = LiveLora.init_new(r.settings.lora_spec, ex.n_layers, ex.shapes, r.replica.loaded.name, seed=seed)
    g = torch.Generator().manual_seed(seed)
    for _a, b in live.params.values():
        b.data.copy_(torch.randn(b.shape, generator=g) * scale)
    return encode_adapter(live.to_weights())


async def test_micro_ping_info_stats(replica: Running) -> None:
    nc = replica.bus.nc
    ping = json.loads((await nc.request("$SRV.PING.collm-replica", b"", timeout=2)).data)
    assert ping["name"] == "collm-replica" and ping["metadata"] == {"replica_id": REPLICA_ID, "model": "tiny"}
    info = json.loads((await nc.request("$SRV.INFO.collm-replica", b"", timeout=2)).data)
    assert {e["subject"] for e in info["endpoints"]} == {
        subjects.replica(REPLICA_ID, v) for v in subjects.REPLICA_VERBS
    }
    await collect(replica, gen())
    stats = json.loads((await nc.request("$SRV.STATS.collm-replica", b"", timeout=2)).data)
    by_name = {e["name"]: e for e in stats["endpoints"]}
    assert by_name["generate"]["num_requests"] >= 1


async def test_tokenize_answers_json_and_error_replies_name_the_field(replica: Running) -> None:
    nc, subject = replica.bus.nc, subjects.replica(REPLICA_ID, "tokenize")
    headers = {"Content-Type": "application/json"}
    raw = await nc.request(subject, b'{"op": "tokenize_text", "prompt": "hello world"}', 5, headers=headers)
    reply = json.loads(raw.data)
    assert reply["tokens"] == replica.replica.loaded.tokenizer.encode("hello world")
    assert reply["max_model_len"] == replica.replica.loaded.max_model_len and reply["token_strs"] is None
    vocab = int(replica.replica.loaded.config.vocab_size)
    bad = json.dumps({"op": "detokenize", "tokens": [vocab]}).encode()
    raw = await nc.request(subject, bad, 5, headers=headers)
    assert raw.headers["Nats-Service-Error-Code"] == "400"
    assert json.loads(raw.data)["param"] == "tokens"
    raw = await nc.request(subject, b'{"op": "nope"}', 5, headers=headers)
    assert raw.headers["Nats-Service-Error-Code"] == "400"


async def test_generate_streams_over_nats(replica: Running) -> None:
    events = await collect(replica, gen(n=8))
    assert events[0].kind == "accepted" and events[0].adapter_version_id == "base"
    assert events[0].replica_id == REPLICA_ID and events[0].prompt_tokens > 0
    chunks = [e for e in events if e.kind == "token"]
    assert [c.seq for c in chunks] == list(range(8))
    fin = events[-1]
    assert fin.kind == "finished" and fin.finish_reason == "length" and fin.completion_tokens == 8
    assert fin.seq == 8 and fin.adapter_version_id == "base" and fin.ttft_ms > 0


async def test_refusals_carry_codes(replica: Running) -> None:
    limit = replica.replica.loaded.max_model_len
    too_long = GenerateRequest(request_id="long", prompt_token_ids=[5] * limit)
    with pytest.raises(BusError) as err:
        await collect(replica, too_long)
    assert err.value.code == 400 and str(limit) in err.value.message
    with pytest.raises(BusError) as err:
        await collect(replica, gen(adapter="nosuch"))
    assert err.value.code == 404 and "nosuch" in err.value.message
    bad = GenerateRequest(request_id="none")
    with pytest.raises(BusError) as err:
        await collect(replica, bad)
    assert err.value.code == 400


async def test_trace_context_reaches_the_replica(replica: Running, spans) -> None:
    tracer = trace.get_tracer("test")
    with tracer.start_as_current_span("client") as client:
        await collect(replica, gen(n=3))
        trace_id = client.get_span_context().trace_id
        client_span_id = client.get_span_context().span_id
    await eventually(
        lambda: any(s.name == "generate" for s in spans.get_finished_spans()), 5, "generate span"
    )
    gen_span = next(s for s in spans.get_finished_spans() if s.name == "generate")
    assert gen_span.context.trace_id == trace_id
    assert gen_span.parent is not None and gen_span.parent.trace_id == trace_id
    ancestors = {s.context.span_id: s for s in spans.get_finished_spans()}
    # The generate span descends from the client span (through the bus's request span).
    p = gen_span.parent.span_id
    while p != client_span_id and p in ancestors and ancestors[p].parent is not None:
        p = ancestors[p].parent.span_id
    assert p == client_span_id
    names = [e.name for e in gen_span.events]
    assert names[:2] == ["queued", "prefill_start"] and "first_token" in names and names[-1] == "finished"
    assert gen_span.attributes["collm.adapter.version"] == "base"


async def test_cancel_stops_generation(replica: Running) -> None:
    req = gen(n=400)
    events = []
    async with replica.bus.stream(subjects.replica(REPLICA_ID, "generate"), req) as stream:
        while True:
            ev = decode(GENERATE_EVENT, (await stream.next(30)).data)
            events.append(ev)
            if ev.kind == "token" and ev.seq == 2:
                await replica.bus.publish(
                    subjects.replica(REPLICA_ID, "cancel"), CancelRequest(request_id=req.request_id)
                )
            if ev.kind in ("finished", "error"):
                break
    assert events[-1].kind == "finished" and events[-1].finish_reason == "cancelled"
    assert events[-1].completion_tokens < 400
    reply = await replica.bus.request(
        subjects.replica(REPLICA_ID, "cancel"), CancelRequest(request_id="gone"), ControlReply
    )
    assert not reply.ok


async def control(r: Running, cmd) -> ControlReply:  # noqa: ANN001
    return await r.bus.request(subjects.replica(REPLICA_ID, "control"), cmd, ControlReply, timeout_s=30)


async def status(r: Running) -> ReplicaTelemetry:
    raw = await r.bus.nc.request(subjects.replica(REPLICA_ID, "status"), b"", timeout=5)
    return decode(ReplicaTelemetry, raw.data)


async def test_control_share_pause_resume_and_telemetry(replica: Running) -> None:
    assert (await control(replica, SetFineTuneShare(share=0.8, ttl_s=30, spend=0.4))).ok
    await eventually(lambda: True)
    tel = await status(replica)
    assert tel.ft_share == 0.8 and tel.ft_share_source == "coordinator" and tel.ft_spend == 0.4
    got: list[ReplicaTelemetry] = []

    async def on_tel(t: ReplicaTelemetry, _msg) -> None:  # noqa: ANN001
        got.append(t)

    await replica.bus.subscribe(subjects.telemetry(REPLICA_ID), ReplicaTelemetry, on_tel)
    await collect(replica, gen(n=4))
    await eventually(lambda: any(t.finished >= 1 for t in got), 5, "telemetry with a finished request")
    t = next(t for t in got if t.finished >= 1)
    assert t.model == "tiny" and t.ttft_ms_p50 is not None and t.slo_attainment is not None
    assert t.local_samples == 40 and t.domains == ["med"]
    assert (await control(replica, SetFineTuneShare(share=0.1, ttl_s=0.2))).ok
    await asyncio.sleep(0.4)
    tel = await status(replica)
    assert tel.ft_share == 0.5 and tel.ft_share_source == "local_default"  # the TTL expired
    assert tel.ft_spend == 0.0  # a spend lasts only as long as the coordinator's share
    # Start a local job on a new adapter: the replica creates med@v1 itself, then pause/resume it.
    rep = await control(replica, StartTraining(adapter="med", token_budget=100_000))
    assert rep.ok and rep.detail["base_version_id"] == "med@v1"
    assert await replica.store.current("med") == 1
    assert (await control(replica, PauseTraining())).ok
    await asyncio.sleep(0.2)
    tel = await status(replica)
    assert tel.training_jobs[0].state == "paused"
    assert (await control(replica, ResumeTraining())).ok
    await asyncio.sleep(0.2)
    assert (await status(replica)).training_jobs[0].state == "running"
    got.clear()
    await eventually(lambda: any((t.train_busy_frac or 0) > 0 for t in got), 10, "training busy time")
    assert all(0 <= (t.train_busy_frac or 0) <= 1 and 0 <= (t.infer_busy_frac or 0) <= 1 for t in got)
    assert (await control(replica, StopTraining(adapter="med"))).ok
    with pytest.raises(BusError) as err:
        await control(replica, SyncAdapter(adapter="nosuch"))
    assert err.value.code == 404
    raw = await replica.bus.nc.request(
        subjects.replica(REPLICA_ID, "control"), encode(CancelRequest(request_id="x")), timeout=5
    )
    assert raw.headers["Nats-Service-Error-Code"] == "400"


async def test_published_version_is_swapped_in(replica: Running) -> None:
    store = replica.store
    rec1 = await store.publish(
        "bank", adapter_blob(replica, 1), expected_current=None, base_model="tiny", source="import"
    )
    first = await collect(replica, gen(adapter="bank"))
    assert first[0].adapter_version_id == "bank@v1" and first[-1].adapter_version_id == "bank@v1"
    rec2 = await store.publish(
        "bank", adapter_blob(replica, 2), expected_current=1, base_model="tiny", source="round"
    )
    await replica.bus.publish(
        subjects.adapter_published("bank"),
        AdapterPublished(
            name="bank",
            version=rec2.version,
            version_id=rec2.id,
            sha256=rec2.sha256,
            base_model="tiny",
            source="round",
        ),
    )
    await eventually(lambda: replica.replica.engine.current_version("bank") == "bank@v2", 10, "swap to v2")
    second = await collect(replica, gen(adapter="bank"))
    assert second[0].adapter_version_id == "bank@v2" and second[-1].adapter_version_id == "bank@v2"
    toks = lambda evs: [t for e in evs if e.kind == "token" for t in e.token_ids]  # noqa: E731
    assert toks(first) != toks(second)
    pinned = await collect(replica, gen(adapter="bank", adapter_version=rec1.version))
    assert pinned[0].adapter_version_id == "bank@v1" and toks(pinned) == toks(first)
    with pytest.raises(BusError) as err:
        await collect(replica, gen(adapter="bank", adapter_version=9))
    assert err.value.code == 404
    # A version published without an event (lost) is picked up by the slow pointer re-read.
    await store.publish(
        "bank", adapter_blob(replica, 3), expected_current=2, base_model="tiny", source="round"
    )
    await eventually(lambda: replica.replica.engine.current_version("bank") == "bank@v3", 10, "sync to v3")


async def test_an_unloaded_adapter_is_forgotten_at_the_next_sync(replica: Running) -> None:
    """The gateway's unload removes the adapter's current pointer: at its next pointer re-read the
    replica has no current version of it, so a request naming no version is refused with 404 while one
    pinned to a resident version is still served; a later load makes it current again."""
    store, engine = replica.store, replica.replica.engine
    await store.publish(
        "gone", adapter_blob(replica, 4), expected_current=None, base_model="tiny", source="import"
    )
    served = await collect(replica, gen(adapter="gone"))
    assert served[-1].adapter_version_id == "gone@v1"
    await store.delete_adapter_name("gone")
    await eventually(lambda: engine.current_version("gone") is None, 10, "the unloaded adapter forgotten")
    with pytest.raises(BusError) as err:
        await collect(replica, gen(adapter="gone"))
    assert err.value.code == 404
    pinned = await collect(replica, gen(adapter="gone", adapter_version=1))
    assert pinned[-1].adapter_version_id == "gone@v1"
    await store.publish(
        "gone", adapter_blob(replica, 5), expected_current=None, base_model="tiny", source="import"
    )
    await eventually(lambda: engine.current_version("gone") == "gone@v2", 10, "the adapter loaded again")


async def test_round_participation_sends_a_local_update(replica: Running) -> None:
    updates: list[LocalUpdate] = []
    js = replica.bus.js
    from collm_common.streams import ensure_streams

    await ensure_streams(js, replicas=1)

    async def on_update(msg) -> None:  # noqa: ANN001
        updates.append(decode(LocalUpdate, msg.data))
        await msg.ack()

    await js.subscribe(subjects.updates_all(), cb=on_update, manual_ack=True)
    rep = await control(
        replica, StartTraining(adapter="legal", token_budget=256, round_id=5, learning_rate=1e-3)
    )
    assert rep.ok and rep.detail["base_version_id"] == "legal@v1"
    await eventually(lambda: updates, 60, "a local update")
    upd = updates[0]
    assert (
        upd.round_id == 5
        and upd.replica_id == REPLICA_ID
        and upd.adapter == "legal"
        and upd.base_version == 1
    )
    assert upd.num_tokens >= 256 and upd.num_samples > 0
    # A round job only trains: the aggregator's gate scores the candidate, the update reports no losses.
    assert upd.eval_loss_before is None and upd.eval_loss_after is None and upd.train_loss is not None
    blob = await replica.store.get_update(upd.blob_key, upd.sha256)
    w = decode_adapter(blob)
    assert w.spec == replica.settings.lora_spec and w.extra["collm.round_id"] == "5"
    start = decode_adapter(await replica.store.get_blob("legal", 1))
    diff = max(float((w.tensors[k] - start.tensors[k]).abs().max()) for k in w.tensors)
    assert diff > 0  # trained
    tel = await status(replica)
    assert tel.round_id == 5 and tel.round_role == "done"


async def test_evaluate_returns_losses(replica: Running) -> None:
    await replica.store.publish(
        "med", adapter_blob(replica, 1, 0.0), expected_current=None, base_model="tiny", source="create"
    )
    key, sha = await replica.store.put_update(11, "other", adapter_blob(replica, 4))
    rep = await replica.bus.request(
        subjects.replica(REPLICA_ID, "evaluate"),
        EvaluateCandidate(
            adapter="med", candidate_key=key, candidate_sha256=sha, current_version=1, max_examples=4
        ),
        EvalReport,
        timeout_s=60,
    )
    assert rep.replica_id == REPLICA_ID and [d.domain for d in rep.losses] == ["med"]
    d = rep.losses[0]
    assert d.num_examples > 0 and d.num_tokens > 0 and d.current_loss is not None
    assert d.candidate_loss != d.current_loss
    with pytest.raises(BusError) as err:
        await replica.bus.request(
            subjects.replica(REPLICA_ID, "evaluate"),
            EvaluateCandidate(adapter="med", candidate_key=key, candidate_sha256="0" * 64),
            EvalReport,
        )
    assert err.value.code == 422


async def test_evaluate_scores_a_stored_versions_task_metric_by_generating(replica: Running) -> None:
    """With `task_examples`, a stored version's first held-out examples are answered greedily by that very
    version through the engine (internal requests: not in the SLO telemetry) and scored; the same
    version scores the same (greedy, same examples)."""
    await replica.store.publish(
        "med", adapter_blob(replica, 1, 0.0), expected_current=None, base_model="tiny", source="create"
    )
    engine = replica.replica.engine
    arrivals, generated = engine.arrivals_total, engine.generated_tokens_total
    finished = engine.snapshot().latency.get("finished", 0)
    req = EvaluateCandidate(
        adapter="med", candidate_key="", candidate_sha256="", candidate_version=1, score_current=False,
        max_examples=4, task_examples=3,
    )  # fmt: skip

    async def ask(r: EvaluateCandidate) -> DomainLoss:
        rep = await replica.bus.request(subjects.replica(REPLICA_ID, "evaluate"), r, EvalReport, timeout_s=60)
        return rep.losses[0]

    d = await ask(req)
    assert (d.domain, d.task_metric, d.task_examples) == ("med", "rouge_l", 3)
    assert d.task_score is not None and 0.0 <= d.task_score <= 1.0
    assert (await ask(req)).task_score == d.task_score
    assert engine.arrivals_total == arrivals and engine.snapshot().latency.get("finished", 0) == finished
    assert engine.generated_tokens_total == generated  # not serving demand in the telemetry
    # Without `task_examples`, or for a candidate blob, loss only.
    plain = await ask(req.model_copy(update={"task_examples": 0}))
    assert (plain.task_metric, plain.task_score, plain.task_examples) == ("", None, 0)


async def test_new_samples_are_persisted_and_used(replica: Running) -> None:
    from collm_common.streams import ensure_streams
    from collm_replica.samples import SAMPLES_FILE, samples_dir

    await ensure_streams(replica.bus.js, replicas=1)
    for i in range(3):
        s = TrainingSample(
            sample_id=f"s{i}", replica_id=REPLICA_ID, domain="med", prompt=f"q{i}", response=f"a{i}"
        )
        await replica.bus.js.publish(
            subjects.samples(REPLICA_ID), encode(s), headers={"Nats-Msg-Id": f"s{i}"}
        )
    path = samples_dir(replica.settings) / SAMPLES_FILE
    assert path == replica.settings.data_dir / "samples" / SAMPLES_FILE  # type: ignore[operator]
    await eventually(
        lambda: path.exists() and len(path.read_text().splitlines()) == 3, 15, "persisted samples"
    )
    await eventually(
        lambda: replica.replica.engine.snapshot().local_samples == 43, 5, "samples in the dataset"
    )
