"""Admin endpoints end to end: the gateway app, a real aggregator service in-process, real NATS (JetStream)
and Redis. Loads a real PEFT directory saved from the tiny model, lists its versions with their quality,
rolls back, unloads, and uploads training samples that must be in JetStream when the call returns.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from collm_aggregator.service import Aggregator
from collm_aggregator.settings import AggregatorSettings
from collm_common import subjects
from collm_common.bus import Bus
from collm_common.clock import WallClock
from collm_common.store import AdapterStore
from collm_common.wire import decode
from collm_common.wire.adapters import AdapterPublished, TrainingSample
from collm_common.wire.admin import ImportAdapter
from collm_common.wire.telemetry import ReplicaTelemetry
from collm_gateway.keys import hash_key

from .conftest import BASE_MODEL, eventually
from .test_real_replica import REPLICA_MAIN, replica_process
from .test_security import assert_envelope, auth

pytestmark = pytest.mark.integration

ACME = "sk-admin-test-acme"
GLOBEX = "sk-admin-test-globex"
OPS = "sk-admin-test-ops"
KEYS = {hash_key(ACME): {"tenant": "acme"}, hash_key(GLOBEX): {"tenant": "globex"}}


def save_tiny_peft(out: Path, seed: int = 0, r: int = 4, base_model: str = BASE_MODEL) -> Path:
    """A PEFT LoRA directory trained on nothing, but real: saved by peft from the tiny model."""
    import peft
    import torch

    from collm_replica.models import build_tiny_model

    model, _tok = build_tiny_model(0)
    torch.manual_seed(seed)
    cfg = peft.LoraConfig(
        r=r, lora_alpha=2 * r, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False
    )
    pm = peft.get_peft_model(model, cfg)
    pm.peft_config["default"].base_model_name_or_path = base_model
    pm.save_pretrained(str(out))
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    return out


@pytest.fixture(scope="module")
def peft_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("peft")
    return {
        "a": save_tiny_peft(root / "a", seed=1),
        "b": save_tiny_peft(root / "b", seed=2),
        "rank8": save_tiny_peft(root / "rank8", seed=3, r=8),
        "other-base": save_tiny_peft(root / "other", seed=4, base_model="some-org/another-model"),
    }


@pytest.fixture
async def aggregator(nats_server, redis_server, redis_prefix) -> AsyncIterator[Aggregator]:
    s = AggregatorSettings(
        nats_url=nats_server.url,
        redis_url=redis_server.url,
        redis_prefix=redis_prefix,
        nats_connect_timeout_s=5,
        default_plan=False,
        consumer_name=f"agg-{redis_prefix}",
    )
    bus = await Bus.connect(s, "collm-aggregator")
    store = AdapterStore.from_url(s.redis_url, s.redis_prefix, s.retention_versions)
    agg = Aggregator(s, bus, store, WallClock())
    await agg.start()
    try:
        yield agg
    finally:
        await agg.stop()
        await bus.close()
        await store.close()


@pytest.fixture
async def gw(make_gateway, aggregator):
    async with make_gateway(api_keys=KEYS, admin_key=OPS) as gateway:
        yield gateway


async def post(gw, path: str, body: dict[str, Any], key: str | None = OPS):
    return await gw.http.post(path, json=body, headers=auth(key))


async def model_ids(gw, key: str) -> list[str]:
    resp = await gw.http.get("/v1/models", headers=auth(key))
    assert resp.status_code == 200, resp.text
    return [m["id"] for m in resp.json()["data"]]


async def test_load_versions_rollback_unload_through_http(gw, store, replica_bus, peft_dirs) -> None:
    published: list[AdapterPublished] = []

    async def on_pub(msg: AdapterPublished, _raw: object) -> None:
        published.append(msg)

    await replica_bus.subscribe(subjects.adapter_published_all(), AdapterPublished, on_pub)
    await replica_bus.nc.flush()

    # load: a new adapter owned by acme, from a PEFT directory (vLLM's request shape + tenant)
    body = {"lora_name": "med", "lora_path": str(peft_dirs["a"]), "tenant": "acme", "domains": ["medical"]}
    resp = await post(gw, "/v1/load_lora_adapter", body)
    assert resp.status_code == 200, resp.text
    v1 = resp.json()
    assert (v1["id"], v1["version"], v1["source"], v1["owner"]) == ("med@v1", 1, "import", "acme")
    assert v1["base_model"] == BASE_MODEL and len(v1["sha256"]) == 64
    assert await store.meta("med") == {"tenant": "acme", "domains": "medical"}
    assert "med" in await model_ids(gw, ACME)
    assert "med" not in await model_ids(gw, GLOBEX)

    # load again: a new version of the same adapter (the owner stays)
    resp = await post(gw, "/v1/load_lora_adapter", {"lora_name": "med", "lora_path": str(peft_dirs["b"])})
    assert resp.status_code == 200, resp.text
    v2 = resp.json()
    assert (v2["version"], v2["parent"], v2["owner"]) == (2, 1, "acme") and v2["sha256"] != v1["sha256"]
    # a different LoRA spec cannot be a version of it: it conflicts with what the name holds
    resp = await post(gw, "/v1/load_lora_adapter", {"lora_name": "med", "lora_path": str(peft_dirs["rank8"])})
    assert assert_envelope(resp, 409, "conflict")["param"] == "lora_path"

    # versions: digests, created times, quality records (written by the aggregator's evaluation gate)
    await store.record_quality("med", 1, {"medical": 2.5})
    await store.record_quality("med", 2, {"medical": 2.25, "math": 3.0})
    resp = await gw.http.get("/v1/adapters/med/versions", headers=auth(ACME))
    assert resp.status_code == 200, resp.text
    doc = resp.json()
    assert (doc["adapter"], doc["owner"], doc["current"], doc["loaded"]) == ("med", "acme", "med@v2", True)
    rows = {r["version"]: r for r in doc["data"]}
    assert rows[1]["sha256"] == v1["sha256"] and rows[2]["sha256"] == v2["sha256"]
    assert rows[1]["quality"] == {"medical": 2.5} and rows[2]["quality"] == {"math": 3.0, "medical": 2.25}
    assert rows[2]["current"] and not rows[1]["current"] and rows[1]["created"] > 0
    for rec in await store.list_versions("med"):
        assert rows[rec.version]["sha256"] == rec.sha256 and rows[rec.version]["created"] == int(
            rec.created_unix_s
        )
    assert_envelope(await gw.http.get("/v1/adapters/med/versions", headers=auth(GLOBEX)), 404)

    # rollback: the content of v1 again, as v3
    resp = await post(gw, "/v1/adapters/med/rollback", {"version": 1})
    assert resp.status_code == 200, resp.text
    v3 = resp.json()
    assert (v3["id"], v3["source"], v3["parent"], v3["sha256"]) == ("med@v3", "rollback", 1, v1["sha256"])
    assert await store.current("med") == 3
    assert_envelope(await post(gw, "/v1/adapters/med/rollback", {"version": 99}), 404)
    assert_envelope(await post(gw, "/v1/adapters/med/rollback", {"version": 0}), 400)
    assert_envelope(await post(gw, "/v1/adapters/nope/rollback", {"version": 1}), 404)

    # unload: unlisted and unroutable; the versions stay (an admin still sees them)
    resp = await post(gw, "/v1/unload_lora_adapter", {"lora_name": "med"})
    assert resp.status_code == 200 and resp.json()["versions_kept"] == 3
    assert "med" not in await model_ids(gw, ACME) and "med" not in await model_ids(gw, OPS)
    chat = {"model": "med", "messages": [{"role": "user", "content": "hi"}]}
    resp = await gw.http.post("/v1/chat/completions", json=chat, headers=auth(ACME))
    assert_envelope(resp, 404, "model_not_found")
    assert_envelope(await gw.http.get("/v1/adapters/med/versions", headers=auth(ACME)), 404)
    resp = await gw.http.get("/v1/adapters/med/versions", headers=auth(OPS))
    assert resp.status_code == 200 and resp.json()["loaded"] is False and len(resp.json()["data"]) == 3
    assert resp.json()["current"] is None
    assert [r.version for r in await store.list_versions("med")] == [1, 2, 3]
    assert_envelope(await post(gw, "/v1/unload_lora_adapter", {"lora_name": "med"}), 404)

    # loaded again: numbering continues, never reused; a different spec is fine for a fresh start
    resp = await post(gw, "/v1/load_lora_adapter", {"lora_name": "med", "lora_path": str(peft_dirs["rank8"])})
    assert resp.status_code == 200, resp.text
    assert resp.json()["version"] == 4 and resp.json()["owner"] == "acme"
    assert "med" in await model_ids(gw, ACME)

    for _ in range(100):
        if len(published) >= 4:
            break
        await asyncio.sleep(0.02)
    assert [(p.version, p.source) for p in published] == [
        (1, "import"),
        (2, "import"),
        (3, "rollback"),
        (4, "import"),
    ]


async def test_failed_loads_leave_nothing_behind(gw, store, peft_dirs, tmp_path) -> None:
    resp = await post(
        gw,
        "/v1/load_lora_adapter",
        {"lora_name": "ghost", "lora_path": str(tmp_path / "none"), "tenant": "acme"},
    )
    err = assert_envelope(resp, 404, "not_found")
    assert "does not exist" in err["message"] and err["param"] == "lora_path"
    assert "ghost" not in await store.list_adapters() and await store.meta("ghost") == {"tenant": ""}
    resp = await post(gw, "/v1/load_lora_adapter", {"lora_name": "bad name", "lora_path": "/x"})
    assert assert_envelope(resp, 400)["param"] == "lora_name"
    resp = await post(gw, "/v1/load_lora_adapter", {"lora_path": "/x"})
    assert assert_envelope(resp, 400, "missing_field")["param"] == "lora_name"
    # an adapter trained on another base model is refused, unless the request names that base
    resp = await post(
        gw, "/v1/load_lora_adapter", {"lora_name": "alien", "lora_path": str(peft_dirs["other-base"])}
    )
    assert "another-model" in assert_envelope(resp, 422, "invalid_adapter")["message"]
    body = {"lora_name": "alien", "lora_path": str(peft_dirs["other-base"]), "base_model": "another-model"}
    resp = await post(gw, "/v1/load_lora_adapter", body)
    assert resp.status_code == 200 and resp.json()["base_model"] == "another-model"
    # a shared adapter that a failed load tries to give to a tenant stays shared
    resp = await post(gw, "/v1/load_lora_adapter", {"lora_name": "common", "lora_path": str(peft_dirs["a"])})
    assert resp.status_code == 200 and resp.json()["owner"] is None
    resp = await post(
        gw,
        "/v1/load_lora_adapter",
        {"lora_name": "common", "lora_path": str(peft_dirs["rank8"]), "tenant": "globex"},
    )
    assert_envelope(resp, 409, "conflict")
    assert "common" in await model_ids(gw, ACME)


def bad_peft_dirs(root: Path, good: Path) -> dict[str, Path]:
    """Directories that are not a LoRA adapter the tiny base model can serve, each broken in one way."""
    import json
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(good / "adapter_model.safetensors"))
    cfg = json.loads((good / "adapter_config.json").read_text())
    blob = (good / "adapter_model.safetensors").read_bytes()

    def variant(
        name: str, weights: dict[str, torch.Tensor] | None = None, config: dict | None = None
    ) -> Path:
        d = root / name
        shutil.copytree(good, d)
        if weights is not None:
            save_file(weights, str(d / "adapter_model.safetensors"))
        if config is not None:
            (d / "adapter_config.json").write_text(json.dumps(config))
        return d

    out = {
        "renamed": variant(
            "renamed", {k.replace("base_model.model.model.", "encoder."): v for k, v in tensors.items()}
        ),
        # every layer 8 features wider than the tiny model's: consistent, but not this base model's layers
        "wider": variant(
            "wider",
            {
                k: torch.ones(v.shape[0], v.shape[1] + 8)
                if "lora_A" in k
                else torch.ones(v.shape[0] + 8, v.shape[1])
                for k, v in tensors.items()
            },
        ),
        "not-lora": variant("not-lora", config={**cfg, "peft_type": "PREFIX_TUNING"}),
        "full-weights": variant("full-weights", {"model.layers.0.self_attn.q_proj.weight": torch.ones(4, 4)}),
    }
    out["corrupt"] = variant("corrupt")
    (out["corrupt"] / "adapter_model.safetensors").write_bytes(blob[: len(blob) // 2])
    out["garbage"] = variant("garbage")
    (out["garbage"] / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
    out["no-weights"] = variant("no-weights")
    (out["no-weights"] / "adapter_model.safetensors").unlink()
    (root / "loop").symlink_to(root / "loop")
    out["loop"] = root / "loop"
    return out


async def test_bad_adapter_directories_get_client_errors(gw, store, peft_dirs, tmp_path) -> None:
    """Each way a PEFT directory can be unusable gets its status and the reason in the OpenAI error
    envelope (never the aggregator's 500 as a 502), and leaves no adapter behind."""
    bad = bad_peft_dirs(tmp_path, peft_dirs["a"])
    # An adapter on the base model, whose layers show what its shapes are.
    resp = await post(gw, "/v1/load_lora_adapter", {"lora_name": "known", "lora_path": str(peft_dirs["a"])})
    assert resp.status_code == 200, resp.text

    async def load(name: str, path: Path | str, **extra: str) -> Any:
        return await post(gw, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path), **extra})

    cases: list[tuple[Path | str, int, str, str]] = [
        (tmp_path / "missing", 404, "not_found", "does not exist (No such file or directory)"),
        (bad["loop"], 404, "not_found", "does not exist"),
        (peft_dirs["a"] / "adapter_config.json" / "x", 404, "not_found", "does not exist (Not a directory)"),
        (
            peft_dirs["a"] / "adapter_config.json",
            422,
            "invalid_adapter",
            "is a file, not a PEFT adapter directory",
        ),
        (bad["corrupt"], 422, "invalid_adapter", "not a readable safetensors file"),
        (bad["garbage"], 422, "invalid_adapter", "not a readable safetensors file"),
        (bad["no-weights"], 422, "invalid_adapter", "no adapter_model.safetensors"),
        (bad["renamed"], 422, "invalid_adapter", "is not a LoRA A/B weight of a decoder layer"),
        (bad["full-weights"], 422, "invalid_adapter", "is not a LoRA A/B weight of a decoder layer"),
        (bad["not-lora"], 422, "invalid_adapter", "only LoRA adapters can be imported"),
        (bad["wider"], 422, "invalid_adapter", "the base model's are"),
    ]
    for path, status, code, reason in cases:
        err = assert_envelope(await load("fresh", path, tenant="acme"), status, code)
        assert reason in err["message"] and err["param"] == "lora_path", (path, err)
        assert err["type"] == ("not_found_error" if status == 404 else "invalid_request_error"), err
    # the same broken content as a version of the known adapter: refused the same way
    err = assert_envelope(await load("known", bad["wider"]), 422, "invalid_adapter")
    assert "known@v1" in err["message"]
    # what conflicts with the name: another LoRA spec, another base model
    err = assert_envelope(await load("known", peft_dirs["rank8"]), 409, "conflict")
    assert "spec" in err["message"]
    err = assert_envelope(await load("known", peft_dirs["a"], base_model="another-model"), 409, "conflict")
    assert "another-model" in err["message"]
    assert await store.list_adapters() == ["known"] and await store.current("known") == 1
    assert await store.meta("fresh") == {"tenant": ""}


async def test_load_without_an_aggregator_is_503(make_gateway, peft_dirs) -> None:
    async with make_gateway(api_keys=KEYS, admin_key=OPS) as gw:
        resp = await post(gw, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(peft_dirs["a"])})
        assert_envelope(resp, 503, "aggregator_unavailable")
        assert resp.headers["retry-after"]


async def read_samples(bus: Bus, replica_id: str, expect: int) -> list[TrainingSample]:
    sub = await bus.js.pull_subscribe(
        subjects.samples(replica_id), durable=f"check-{replica_id}", stream=subjects.STREAM_SAMPLES
    )
    out: list[TrainingSample] = []
    try:
        msgs = await sub.fetch(expect + 5, timeout=1.0)
    except TimeoutError:
        msgs = []
    for m in msgs:
        out.append(decode(TrainingSample, m.data))
        await m.ack()
    return out


async def test_samples_land_in_jetstream_before_the_answer(gw, replica_bus) -> None:
    # Two sites with local data: site-a holds medical data, site-b math (telemetry as replicas send it).
    for rid, domains, n in (("site-a", ["medical"], 5), ("site-b", ["math"], 0)):
        t = ReplicaTelemetry(
            replica_id=rid, ts_unix_s=0.0, interval_s=30.0, model="m", domains=domains, local_samples=n
        )
        await replica_bus.publish(subjects.telemetry(rid), t)
    await replica_bus.nc.flush()
    await gw.wait_replicas("site-a", "site-b")

    body = {
        "samples": [
            {
                "domain": "medical",
                "prompt": "What is a fever?",
                "response": "A raised body temperature.",
                "sample_id": "s-1",
            },
            {"domain": "math", "prompt": "2+2?", "response": "4"},
            {
                "replica_id": "site-b",
                "domain": "medical",
                "prompt": "p",
                "response": "r",
                "system": "be brief",
            },
        ]
    }
    resp = await post(gw, "/v1/samples", body)
    assert resp.status_code == 200, resp.text
    acks = resp.json()["data"]
    assert [(a["replica_id"], a["stream"], a["duplicate"]) for a in acks] == [
        ("site-a", subjects.STREAM_SAMPLES, False),
        ("site-b", subjects.STREAM_SAMPLES, False),
        ("site-b", subjects.STREAM_SAMPLES, False),
    ]
    assert acks[0]["sample_id"] == "s-1" and all(a["seq"] >= 1 for a in acks)
    # Already in the stream when the call returned: read it back.
    got_a = await read_samples(replica_bus, "site-a", 1)
    got_b = await read_samples(replica_bus, "site-b", 2)
    assert [(s.sample_id, s.prompt, s.response, s.domain) for s in got_a] == [
        ("s-1", "What is a fever?", "A raised body temperature.", "medical")
    ]
    assert [(s.prompt, s.system) for s in got_b] == [("2+2?", None), ("p", "be brief")]
    assert all(s.received_unix_s > 0 for s in got_a + got_b)

    # A retry with the same sample_id is acknowledged as a duplicate and stored once.
    resp = await post(gw, "/v1/samples", {"samples": [body["samples"][0]]})
    assert resp.status_code == 200 and resp.json()["data"][0]["duplicate"] is True
    info = await replica_bus.js.stream_info(subjects.STREAM_SAMPLES)
    assert info.state.messages == 3

    # Refused before anything is published: no replica for the domain, no domain, not an admin.
    resp = await post(
        gw,
        "/v1/samples",
        {
            "samples": [
                {"domain": "medical", "prompt": "p", "response": "r"},
                {"domain": "law", "prompt": "p", "response": "r"},
            ]
        },
    )
    assert assert_envelope(resp, 422, "no_replica_for_sample")["param"] == "samples.1.domain"
    resp = await post(gw, "/v1/samples", {"samples": [{"prompt": "p", "response": "r"}]})
    assert_envelope(resp, 422, "no_replica_for_sample")
    assert_envelope(await post(gw, "/v1/samples", {"samples": []}), 400)
    assert_envelope(await post(gw, "/v1/samples", body, key=ACME), 403)
    assert (await replica_bus.js.stream_info(subjects.STREAM_SAMPLES)).state.messages == 3


@pytest.mark.skipif(not REPLICA_MAIN.exists(), reason="the replica service is not built yet")
async def test_loaded_adapter_is_served_by_a_real_replica(
    make_gateway, aggregator, peft_dirs, nats_server, redis_server, redis_prefix, tmp_path
) -> None:
    with replica_process(nats_server, redis_server, redis_prefix, tmp_path, "real0") as log_path:
        async with make_gateway(api_keys=KEYS, admin_key=OPS, first_event_timeout_s=10.0) as gw:
            try:
                await eventually(
                    lambda: "real0" in gw.state.cluster.fresh_replicas(), timeout_s=120, what="replica"
                )
            except AssertionError:
                pytest.fail("replica never reported telemetry:\n" + log_path.read_text()[-3000:])
            body = {"lora_name": "med", "lora_path": str(peft_dirs["a"]), "tenant": "acme"}
            resp = await post(gw, "/v1/load_lora_adapter", body)
            assert resp.status_code == 200, resp.text
            chat = {"model": "med", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
            resp = await gw.http.post("/v1/chat/completions", json=chat, headers=auth(ACME))
            assert resp.status_code == 200, resp.text + log_path.read_text()[-3000:]
            assert resp.headers["x-collm-replica"] == "real0"
            assert resp.headers["x-collm-adapter-version"] == "med@v1"
            assert resp.json()["usage"]["completion_tokens"] >= 1
            resp = await gw.http.post(
                "/v1/chat/completions", json={**chat, "model": BASE_MODEL}, headers=auth(ACME)
            )
            assert resp.status_code == 200, resp.text
            assert (await post(gw, "/v1/unload_lora_adapter", {"lora_name": "med"})).status_code == 200
            resp = await gw.http.post("/v1/chat/completions", json=chat, headers=auth(ACME))
            assert_envelope(resp, 404, "model_not_found")


async def test_a_load_that_times_out_keeps_its_owner(make_gateway, store, replica_bus, peft_dirs) -> None:
    seen: list[ImportAdapter] = []

    async def silent(req: ImportAdapter, _raw: object) -> None:
        seen.append(req)  # an aggregator that takes the import and never answers in time

    await replica_bus.subscribe(subjects.aggregator("import"), ImportAdapter, silent)
    await replica_bus.nc.flush()
    async with make_gateway(api_keys=KEYS, admin_key=OPS, admin_timeout_s=0.3) as gw:
        body = {"lora_name": "slow", "lora_path": str(peft_dirs["a"]), "tenant": "acme"}
        assert_envelope(await post(gw, "/v1/load_lora_adapter", body), 504, "timeout")
        assert seen and seen[0].base_model == BASE_MODEL
        # The import may still land: if it does, it lands owned by acme, never shared.
        assert (await store.meta("slow")).get("tenant") == "acme"
