"""Fuzz the gateway through its own OpenAPI schema (schemathesis + hypothesis), over real HTTP.

The gateway runs under uvicorn on a free port in a thread of its own, with a real NATS (JetStream) and
Redis, a replica double serving the base model and two adapters, and a real aggregator service (so the
admin endpoints do real work: imports, rollbacks, JetStream publications). Each API operation gets
schema-valid (positive) and schema-violating (negative) cases, sent with an admin key, a tenant's key, a
wrong key or none.

What must hold for every case:

* no 5xx, except 503 and 504. Those two are the gateway saying "not now" or "too late" about a part
  below it (no replica fits the request, a replica or the aggregator did not answer in time; always
  with the envelope, 503 with `Retry-After`); a fuzzer can provoke them legitimately, for instance by
  pinning an adapter version that no replica holds. 500 (a gateway bug) and 502 (a part below broke)
  are failures.
* every non-2xx body is the OpenAI error envelope `{"error": {"message", "type", "param", "code"}}`,
  and so is every error event inside a 200 SSE stream.
* every answer of an API route (`/v1/...`), error or not, carries `x-collm-trace-id` (32 hex digits).
* every 4xx answer is counted once in `collm_gateway_requests_refused_total{status,reason}` under its
  status and its envelope's code; no other answer is.
* a streamed answer asked with `stream_options.include_usage` has `"usage": null` on every chunk but
  the last, which carries the usage.
* a numeric or boolean field given a value of another JSON type (a string for `max_tokens`, a boolean
  for `temperature`, ...) is a 400, naming that field when it is the body's only problem.
* a body padded to sizes around the body limit (1 MiB, which is also NATS's `max_payload`), in its
  prompt or first message (which the packed request carries) or in an unknown field (which it does
  not), never gets a 5xx; over the limit it is a 413.
* every answer conforms to the OpenAPI document (schemathesis's own checks): its status is one the
  operation declares, its content type one declared for that status, its body valid against the
  declared schema (the error envelope for every error status), and the headers declared required
  (`Retry-After` on 429 and 503, `WWW-Authenticate` on 401) are there.

The number of cases run is printed; at least 1000 must run.
"""

from __future__ import annotations

import asyncio
import copy
import json
import re
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import hypothesis
import pytest
import requests
import schemathesis
import uvicorn
from hypothesis import HealthCheck, given
from hypothesis import strategies as st
from prometheus_client import REGISTRY
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from collm_aggregator.service import Aggregator
from collm_aggregator.settings import AggregatorSettings
from collm_common.bus import Bus
from collm_common.clock import WallClock
from collm_common.lora import encode_adapter
from collm_common.store import AdapterStore
from collm_gateway.app import build_app
from collm_gateway.keys import hash_key
from collm_gateway.settings import GatewaySettings
from collm_ops.servers import free_port
from tests.doubles.participant import tiny_adapter
from tests.doubles.replica import ReplicaDouble

pytestmark = [pytest.mark.integration, pytest.mark.fuzz]

BASE_MODEL = "fuzz-base"
ADMIN = "sk-fuzz-admin"
TENANT = "sk-fuzz-acme"
KEYS = {hash_key(TENANT): {"tenant": "acme"}}
AUTH_CHOICES = [ADMIN, ADMIN, TENANT, "sk-wrong", None]
# Known names, swapped into half of the cases so they get past "unknown model" to the replica and the
# store (None: keep what the schema strategy drew).
KNOWN_MODELS = [None, BASE_MODEL, "shared-med", "acme-fin", "acme-fin@v1", "shared-med@v9"]
KNOWN_ADAPTERS = [None, "shared-med", "acme-fin"]
# Absolute paths that get a load past validation to the aggregator's import: a directory that is no PEFT
# adapter, a file, nothing (422, 422, 404).
KNOWN_PATHS = [None, "/", "/etc/passwd", "/nonexistent/peft-adapter"]
# Fields the gateway refuses by design (n > 1, echo, logprobs, ...): dropped from half of the valid
# completions cases so those get through to a replica and exercise the JSON and SSE answers.
# Values JSON can carry that Python and msgpack choke on, planted at one leaf of a third of the bodies.
NASTY = ["\ud800", 2**70, -(2**70), 2**63, 1e308, "\x00", "", "x" * 5000, [], {}]
REFUSED_BY_DESIGN = ("n", "echo", "logprobs", "top_logprobs", "best_of", "suffix", "stream_options", "stop")
COMPLETION_OPS = ("POST /v1/chat/completions", "POST /v1/completions")
# Numeric and boolean fields of chat and completions bodies, and values of a JSON type they refuse.
TYPED_FIELDS = {
    "max_tokens": "int", "max_completion_tokens": "int", "seed": "int", "n": "int", "top_logprobs": "int",
    "best_of": "int", "temperature": "number", "top_p": "number", "stream": "bool", "ignore_eos": "bool",
    "echo": "bool",
}  # fmt: skip
WRONG_TYPED = {
    "int": ["16", "1", True, False, 1.5, 16.0],
    "number": ["0.5", "1", True, False],
    "bool": ["true", "false", 1, 0, "yes"],
}
CHAT_ONLY = ("max_completion_tokens", "top_logprobs")
COMPLETIONS_ONLY = ("best_of", "echo")
BODY_LIMIT = 1 << 20  # the gateway's default body limit, and nats-server's default max_payload
# Body sizes around the limit: from where a chat body grows past max_payload once packed, to over it.
PADDED_SIZES = [BODY_LIMIT + d for d in (-178, -96, -8, -1, 0, 1, 96, 4096)]
TRACE_ID = re.compile(r"[0-9a-f]{32}")
REFUSED_METRIC = "collm_gateway_requests_refused_total"

# Examples per operation and generation mode; the total is what counts (>= MIN_CASES).
BUDGET: dict[str, int] = {
    "POST /v1/chat/completions": 160,
    "POST /v1/completions": 160,
    "GET /v1/models/{model}": 50,
    "POST /v1/load_lora_adapter": 60,
    "POST /v1/unload_lora_adapter": 50,
    "GET /v1/adapters/{name}/versions": 40,
    "POST /v1/adapters/{name}/rollback": 50,
    "POST /v1/samples": 80,
}
DEFAULT_BUDGET = 10
MIN_CASES = 1000
ENVELOPE_KEYS = {"message", "type", "param", "code"}
# Conformance of each answer to the document (what the gateway declares it answers).
CONFORMANCE = [
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    response_headers_conformance,
]


class GatewayUnderTest(threading.Thread):
    """The gateway app (real uvicorn), a replica double and an aggregator, on their own event loop."""

    def __init__(self, nats_url: str, redis_url: str, prefix: str) -> None:
        super().__init__(name="gateway-under-test", daemon=True)
        self.settings = GatewaySettings(
            nats_url=nats_url,
            redis_url=redis_url,
            redis_prefix=prefix,
            nats_connect_timeout_s=5,
            gateway_id="gw-fuzz",
            host="127.0.0.1",
            port=free_port(),
            base_model=BASE_MODEL,
            api_keys=KEYS,
            admin_key=ADMIN,
            first_event_timeout_s=1.0,
            first_token_timeout_s=5.0,
            models_cache_ttl_s=0.5,
            telemetry_stale_s=5.0,
            admin_timeout_s=10.0,
            max_tokens_limit=64,
            default_max_tokens=8,
        )
        self.agg_settings = AggregatorSettings(
            nats_url=nats_url,
            redis_url=redis_url,
            redis_prefix=prefix,
            nats_connect_timeout_s=5,
            default_plan=False,
            consumer_name=f"agg-{prefix}",
        )
        self.app: Any = None
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_event: asyncio.Event | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.settings.port}"

    def run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # reported to the test thread
            self.error = exc
            self.ready.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop_event = asyncio.Event()
        s = self.settings
        gw_bus = await Bus.connect(s, "collm-gateway-fuzz")
        store = AdapterStore.from_url(s.redis_url, s.redis_prefix)
        for name, owner in (("shared-med", None), ("acme-fin", "acme")):
            if owner:
                await store.set_meta(name, {"tenant": owner})
            blob = encode_adapter(tiny_adapter())  # a real adapter blob: the aggregator decodes it
            await store.publish(name, blob, expected_current=None, base_model=BASE_MODEL, source="create")
        replica_bus = await Bus.connect(s, "replica-double")
        double = await ReplicaDouble(replica_bus, "r0", adapters={"shared-med": 1, "acme-fin": 1}).start()
        agg_bus = await Bus.connect(self.agg_settings, "collm-aggregator")
        agg_store = AdapterStore.from_url(s.redis_url, s.redis_prefix)
        agg = Aggregator(self.agg_settings, agg_bus, agg_store, WallClock())
        await agg.start()
        self.app = build_app(s, gw_bus, store)
        server = uvicorn.Server(
            uvicorn.Config(
                self.app, host=s.host, port=s.port, lifespan="on", log_config=None, access_log=False
            )
        )
        serving = asyncio.create_task(server.serve())
        try:
            while not server.started:
                if serving.done():
                    serving.result()
                await asyncio.sleep(0.02)
            while "r0" not in self.app.state.gateway.cluster.fresh_replicas():
                await asyncio.sleep(0.02)
            self.ready.set()
            await self._stop_event.wait()
        finally:
            server.should_exit = True
            await serving
            await agg.stop()
            await double.stop()
            for bus in (agg_bus, replica_bus, gw_bus):
                await bus.close()
            await agg_store.close()
            await store.close()

    def stop(self) -> None:
        if self._loop is not None and self._stop_event is not None:
            self._loop.call_soon_threadsafe(self._stop_event.set)
        self.join(timeout=30)


@pytest.fixture
def gateway(nats_server, redis_server, redis_prefix) -> Iterator[GatewayUnderTest]:
    gut = GatewayUnderTest(nats_server.url, redis_server.url, redis_prefix)
    gut.start()
    assert gut.ready.wait(60), "the gateway did not start"
    if gut.error is not None:
        raise gut.error
    try:
        yield gut
    finally:
        gut.stop()


def check_envelope(body: Any, where: str) -> None:
    assert isinstance(body, dict) and set(body) == {"error"}, f"{where}: not the error envelope: {body!r}"
    err = body["error"]
    assert isinstance(err, dict) and set(err) == ENVELOPE_KEYS, f"{where}: envelope keys {err!r}"
    assert isinstance(err["message"], str) and err["message"], f"{where}: empty message"
    assert isinstance(err["type"], str) and err["type"], f"{where}: no type"
    assert err["param"] is None or isinstance(err["param"], str), where
    assert err["code"] is None or isinstance(err["code"], str), where


def check_response(resp: Any, where: str, path: str = "", include_usage: bool = False) -> None:
    status = resp.status_code
    assert status < 500 or status in (503, 504), f"{where}: {status} {resp.text[:500]}"
    headers = {k.lower(): v[0] for k, v in resp.headers.items() if v}
    ctype = headers.get("content-type", "")
    if path.startswith("/v1/"):
        trace_id = headers.get("x-collm-trace-id", "")
        assert TRACE_ID.fullmatch(trace_id), f"{where}: x-collm-trace-id {trace_id!r}"
    if status >= 400:
        try:
            body = resp.json()
        except ValueError:
            raise AssertionError(f"{where}: {status} with a non-JSON body {resp.text[:300]!r}") from None
        check_envelope(body, where)
        if status == 503:
            assert headers.get("retry-after"), f"{where}: 503 without Retry-After"
        return
    if ctype.startswith("text/event-stream"):
        events = []
        for line in resp.text.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[len("data: ") :])
                if "error" in event:
                    check_envelope(event, f"{where} (in the stream)")
                else:
                    events.append(event)
        if include_usage and not any("error" in line for line in resp.text.splitlines()):
            check_usage_chunks(events, where)
    elif ctype.startswith("application/json"):
        resp.json()


def check_usage_chunks(chunks: list[dict[str, Any]], where: str) -> None:
    """With include_usage: `"usage": null` on every chunk but the last, the usage on the last."""
    assert chunks, f"{where}: no chunks"
    for chunk in chunks[:-1]:
        assert "usage" in chunk and chunk["usage"] is None, f"{where}: {chunk}"
    last = chunks[-1]
    assert last["choices"] == [] and isinstance(last["usage"], dict), f"{where}: last chunk {last}"


def refusals() -> dict[tuple[str, str], float]:
    """The refused-requests counter, (status, reason) -> count."""
    out: dict[tuple[str, str], float] = {}
    for family in REGISTRY.collect():
        for sample in family.samples:
            if sample.name == REFUSED_METRIC:
                out[(sample.labels["status"], sample.labels["reason"])] = sample.value
    return out


def check_counted(before: dict[tuple[str, str], float], resp: Any, where: str) -> None:
    """A 4xx answer adds one to its (status, code) series; any other answer adds nothing."""
    after = refusals()
    grown = {k: after[k] - before.get(k, 0.0) for k in after if after[k] != before.get(k, 0.0)}
    if 400 <= resp.status_code < 500:
        code = resp.json()["error"]["code"] or "none"
        assert grown == {(str(resp.status_code), code): 1.0}, f"{where}: counted {grown}"
    else:
        assert grown == {}, f"{where}: {resp.status_code} counted as {grown}"


def retype(body: dict[str, Any], label: str, field_index: int, value_index: int) -> str | None:
    """Give one numeric or boolean field of a completions body a value of a wrong JSON type; the field."""
    skip = COMPLETIONS_ONLY if label == "POST /v1/chat/completions" else CHAT_ONLY
    fields = [f for f in TYPED_FIELDS if f not in skip]
    field = fields[field_index % len(fields)]
    values = WRONG_TYPED[TYPED_FIELDS[field]]
    body[field] = values[value_index % len(values)]
    return field


def pad(body: dict[str, Any], size: int, into_content: bool) -> None:
    """Make `body` serialize (as the client sends it: `json.dumps`) to exactly `size` bytes, with a long
    prompt or first message (packed for the replica too) or an unknown field (ignored by the gateway)."""
    target: tuple[Any, Any] = (body, "x_fuzz_pad")
    if into_content:
        messages = body.get("messages")
        if isinstance(body.get("prompt"), str):
            target = (body, "prompt")
        elif isinstance(messages, list) and messages and isinstance(messages[0], dict):
            target = (messages[0], "content")
    container, key = target
    container[key] = ""
    container[key] = "x" * max(0, size - len(json.dumps(body)))


def leaves(doc: Any) -> list[tuple[Any, Any]]:
    """(container, key) of every scalar in a JSON document."""
    out: list[tuple[Any, Any]] = []
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else []
    for k, v in items:
        if isinstance(v, dict | list) and v:
            out += leaves(v)
        else:
            out.append((doc, k))
    return out


# Keys whose value decides the route (kept, so a planted value gets past routing into the request).
ROUTING_KEYS = frozenset({"model", "role", "type", "lora_name"})


def plant(body: Any, value: Any, index: int) -> None:
    """Put `value` at one leaf of `body`, of the same kind (text at text, numbers at numbers)."""

    def fits(container: Any, key: Any) -> bool:
        old = container[key]
        if key in ROUTING_KEYS:
            return False
        if isinstance(value, str):
            return isinstance(old, str)
        if isinstance(value, int | float):
            return isinstance(old, int | float) and not isinstance(old, bool)
        return True

    spots = [spot for spot in leaves(body) if fits(*spot)]
    if spots:
        container, key = spots[index % len(spots)]
        container[key] = value


def fuzz_operation(
    base_url: str,
    session: requests.Session,
    operation: Any,
    label: str,
    mode: GenerationMode,
    cases: Counter[str],
    statuses: Counter[str],
    extras: Counter[str],
) -> Any:
    """A hypothesis test of one operation in one generation mode (call it to run it)."""

    @given(
        case=operation.as_strategy(generation_mode=mode),
        key=st.sampled_from(AUTH_CHOICES),
        model=st.sampled_from(KNOWN_MODELS),
        adapter=st.sampled_from(KNOWN_ADAPTERS),
        lora_path=st.sampled_from(KNOWN_PATHS),
        servable=st.booleans(),
        nasty=st.one_of(st.none(), st.none(), st.sampled_from(NASTY)),
        leaf=st.integers(min_value=0, max_value=1000),
        extra=st.sampled_from(["none", "retype", "pad"]),
        pick=st.integers(min_value=0, max_value=1000),
    )
    @hypothesis.settings(
        max_examples=BUDGET.get(label, DEFAULT_BUDGET),
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        phases=[hypothesis.Phase.generate, hypothesis.Phase.shrink],
    )
    def run(
        case: Any,
        key: str | None,
        model: str | None,
        adapter: str | None,
        lora_path: str | None,
        servable: bool,
        nasty: Any,
        leaf: int,
        extra: str,
        pick: int,
    ) -> None:
        # The edits below are made in place, on a copy of the body, so that none reaches another case.
        # (Set past schemathesis's change tracking: an equal body, as it was generated.)
        object.__setattr__(case, "body", copy.deepcopy(case.body))
        if isinstance(case.body, dict) and servable and mode is GenerationMode.POSITIVE:
            for name in REFUSED_BY_DESIGN:
                case.body.pop(name, None)
            if isinstance(case.body.get("max_tokens"), int):
                case.body["max_tokens"] = min(case.body["max_tokens"], 8)
        if isinstance(case.body, dict):
            if model is not None and "model" in case.body:
                case.body["model"] = model
            if adapter is not None and "lora_name" in case.body:
                case.body["lora_name"] = adapter
            if lora_path is not None and "lora_path" in case.body:
                case.body["lora_path"] = lora_path
        if case.path_parameters:
            if model is not None and "model" in case.path_parameters:
                case.path_parameters["model"] = model
            if adapter is not None and "name" in case.path_parameters:
                case.path_parameters["name"] = adapter
        completions = label in COMPLETION_OPS and isinstance(case.body, dict)
        positive = mode is GenerationMode.POSITIVE and nasty is None
        include_usage, retyped, padded = False, None, None
        if completions and extra == "none" and pick % 2 == 0 and servable and mode is GenerationMode.POSITIVE:
            # a stream the replica serves: the base model, a key that passes
            case.body.update(model=BASE_MODEL, stream=True, stream_options={"include_usage": True})
            key = key if key in (ADMIN, TENANT) else TENANT
            include_usage = True
        elif completions and extra == "retype":
            retyped = retype(case.body, label, pick, leaf)
        elif completions and extra == "pad":
            padded = PADDED_SIZES[pick % len(PADDED_SIZES)]
        if nasty is not None:
            plant(case.body, nasty, leaf)
        if padded is not None:
            pad(case.body, padded, into_content=leaf % 2 == 0)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        before = refusals()
        resp = case.call(base_url=base_url, session=session, headers=headers, timeout=30)
        cases[label] += 1
        statuses[f"{label} {resp.status_code}"] += 1
        kind = "include_usage" if include_usage else extra
        where = f"{label} [{mode.value}] {kind} {case.as_curl_command()[:2000]}"
        check_response(resp, where, operation.path, include_usage)
        check_counted(before, resp, where)
        if key in (ADMIN, TENANT):  # past the API keys, the body decides
            if retyped is not None and positive:
                assert resp.status_code == 400, f"{where}: {resp.status_code} for {retyped}"
                err = resp.json()["error"]
                if "more problem" not in err["message"]:
                    assert err["param"] == retyped, f"{where}: param {err['param']!r}, not {retyped!r}"
            if padded is not None and padded > BODY_LIMIT:
                assert resp.status_code == 413, f"{where}: {resp.status_code} for a {padded}-byte body"
                assert resp.json()["error"]["code"] == "request_too_large", where
        if padded is not None:
            extras[f"padded {resp.status_code}"] += 1
        if retyped is not None:
            extras[f"retyped {resp.status_code}"] += 1
        if include_usage:
            extras[f"include_usage {resp.status_code}"] += 1
        case.validate_response(resp, checks=CONFORMANCE, headers=headers)

    return run


def test_fuzz_the_openapi_schema(gateway: GatewayUnderTest) -> None:
    schema = schemathesis.openapi.from_dict(gateway.app.openapi())
    session = requests.Session()
    cases: Counter[str] = Counter()
    statuses: Counter[str] = Counter()
    extras: Counter[str] = Counter()
    started_s = time.monotonic()
    for result in schema.get_all_operations():
        operation = result.ok()
        label = f"{operation.method.upper()} {operation.path}"
        has_input = bool(operation.body or operation.path_parameters or operation.query or operation.headers)
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            if mode is GenerationMode.NEGATIVE and not has_input:
                continue  # nothing to violate
            run = fuzz_operation(gateway.base_url, session, operation, label, mode, cases, statuses, extras)
            try:
                run()
            except hypothesis.errors.Unsatisfiable:
                pass  # no schema-violating input exists for this operation (nothing to negate)
    total = sum(cases.values())
    elapsed_s = time.monotonic() - started_s
    print(f"\nfuzz: {total} cases over {len(cases)} operations in {elapsed_s:.1f} s")
    for label, n in sorted(cases.items()):
        by_status = sorted(
            (k.rsplit(" ", 1)[1], v) for k, v in statuses.items() if k.rsplit(" ", 1)[0] == label
        )
        print(f"  {n:5d}  {label:36s} " + " ".join(f"{code}:{v}" for code, v in by_status))
    print("  " + " ".join(f"{k}:{v}" for k, v in sorted(extras.items())))
    assert total >= MIN_CASES, f"only {total} cases ran"
    for kind in ("padded 413", "retyped 400", "include_usage 200"):
        assert extras[kind] > 0, f"no {kind} case ran"
