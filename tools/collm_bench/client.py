"""One streamed request to an OpenAI-compatible endpoint, measured (TTFT, ITL, e2e, usage, errors).

Works with `/v1/chat/completions` and `/v1/completions`, `stream: true` with
`stream_options.include_usage` (the server's `usage` is the ground truth for token counts). Server-sent
events are parsed per the SSE spec (`data:` lines, events ended by a blank line, `:` comments ignored),
and each event is timestamped when its line arrives. A server that ignores `stream` and answers one
JSON object is measured too (TTFT = e2e latency then).

CoLLM extensions, sent only when enabled: `slo: {"ttft_ms", "tpot_ms"}` (per-request SLO) and
`ignore_eos` (also honoured by vLLM), so that a trace's output lengths are really generated.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from collm_workload.records import RequestRecord
from collm_workload.workload import PlannedRequest

ADAPTER_VERSION_HEADER = "x-collm-adapter-version"
REPLICA_HEADER = "x-collm-replica"
REJECT_STATUSES = (429, 503)

Endpoint = Literal["chat", "completions"]


def endpoint_url(base_url: str, endpoint: Endpoint) -> str:
    """`http://host:port` or `http://host:port/v1` -> the full endpoint URL."""
    base = base_url.rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise ValueError(f"--url must be http(s)://host:port (got {base_url!r})")
    if not base.endswith("/v1"):
        base += "/v1"
    return base + ("/chat/completions" if endpoint == "chat" else "/completions")


@dataclass(frozen=True)
class ClientOptions:
    url: str
    endpoint: Endpoint = "chat"
    api_key: str | None = None
    send_slo: bool = False
    ignore_eos: bool = True
    temperature: float = 0.0
    request_timeout_s: float = 300.0
    extra_body: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.request_timeout_s > 0:
            raise ValueError("request_timeout_s must be > 0")


def request_body(p: PlannedRequest, opts: ClientOptions) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": p.model,
        "max_tokens": p.max_tokens,
        "temperature": opts.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if opts.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": p.prompt}]
    else:
        body["prompt"] = p.prompt
    if opts.ignore_eos:
        body["ignore_eos"] = True
    if opts.send_slo:
        slo = {k: v for k, v in (("ttft_ms", p.slo_ttft_ms), ("tpot_ms", p.slo_tpot_ms)) if v is not None}
        if slo:
            body["slo"] = slo
    body.update(opts.extra_body)
    return body


def new_record(p: PlannedRequest) -> RequestRecord:
    """The record of a planned request before it is sent (status `dropped` until something happens)."""
    return RequestRecord(
        request_id=p.request_id,
        index=p.index,
        domain=p.domain,
        model=p.model,
        status="dropped",
        scheduled_s=p.scheduled_s,
        target_input_tokens=p.target_input_tokens,
        estimated_input_tokens=p.estimated_input_tokens,
        max_tokens=p.max_tokens,
        slo_ttft_ms=p.slo_ttft_ms,
        slo_tpot_ms=p.slo_tpot_ms,
    )


class SSEDecoder:
    """Line-fed server-sent-events decoder: returns an event's data when the blank line ends it."""

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> str | None:
        line = line.rstrip("\r")
        if not line:
            return self.flush()
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None

    def flush(self) -> str | None:
        if not self._data:
            return None
        data = "\n".join(self._data)
        self._data = []
        return data


def error_message(raw: bytes | str, limit: int = 300) -> str:
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return text.strip()[:limit]
    if isinstance(obj, dict):
        err = obj.get("error", obj.get("detail"))
        if isinstance(err, dict):
            return str(err.get("message") or err)[:limit]
        if err is not None:
            return str(err)[:limit]
    return text.strip()[:limit]


@dataclass
class _Stream:
    """What one response stream has shown so far."""

    first_s: float | None = None
    last_s: float | None = None
    itl_ms: list[float] = field(default_factory=list)
    chunks: int = 0
    usage: dict[str, Any] | None = None
    finish_reason: str | None = None
    fingerprint: str | None = None
    model: str | None = None
    error: str | None = None
    done: bool = False

    def text_arrived(self, t: float) -> None:
        if self.first_s is None:
            self.first_s = t
        else:
            assert self.last_s is not None
            self.itl_ms.append((t - self.last_s) * 1000.0)
        self.last_s = t
        self.chunks += 1

    def take(self, obj: dict[str, Any], t: float) -> None:
        if obj.get("error") is not None:
            self.error = error_message(json.dumps(obj))
            return
        if isinstance(obj.get("usage"), dict):
            self.usage = obj["usage"]
        if obj.get("system_fingerprint"):
            self.fingerprint = str(obj["system_fingerprint"])
        if obj.get("model"):
            self.model = str(obj["model"])
        for choice in obj.get("choices") or []:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta")
            if isinstance(delta, dict):  # chat chunk
                text = delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
            elif isinstance(choice.get("message"), dict):  # non-streamed chat answer
                text = choice["message"].get("content")
            else:  # completions chunk or answer
                text = choice.get("text")
            if text:
                self.text_arrived(t)
            if choice.get("finish_reason"):
                self.finish_reason = str(choice["finish_reason"])


def _finish(rec: RequestRecord, st: _Stream, end_s: float) -> None:
    assert rec.sent_s is not None
    rec.end_s = end_s
    rec.e2e_ms = (end_s - rec.sent_s) * 1000.0
    rec.first_token_s = st.first_s
    # No text at all (an immediate stop): the first "token" is the end of the response.
    rec.ttft_ms = (st.first_s - rec.sent_s) * 1000.0 if st.first_s is not None else rec.e2e_ms
    rec.itl_ms = [round(x, 3) for x in st.itl_ms]
    rec.text_chunks = st.chunks
    rec.finish_reason = st.finish_reason
    rec.served_model = st.model
    if rec.adapter_version is None and st.fingerprint:
        # CoLLM's fingerprint is `replica/version`; another server's is an opaque id, kept whole.
        rec.adapter_version = st.fingerprint.rsplit("/", 1)[-1]
    if st.usage is not None:
        rec.usage_reported = True
        rec.prompt_tokens = _int_or_none(st.usage.get("prompt_tokens"))
        rec.completion_tokens = _int_or_none(st.usage.get("completion_tokens"))
    if rec.completion_tokens is None:
        rec.completion_tokens = st.chunks
    if st.error is not None:
        rec.status, rec.error = "error", f"error event: {st.error}"
    elif not (st.done or st.finish_reason):
        rec.status, rec.error = "error", "stream ended before [DONE] or a finish_reason"
    else:
        rec.status = "ok"


def _int_or_none(v: object) -> int | None:
    return int(v) if isinstance(v, int | float) else None


async def send_request(
    http: httpx.AsyncClient,
    p: PlannedRequest,
    opts: ClientOptions,
    rec: RequestRecord,
    now: Callable[[], float],
) -> None:
    """Send `p`, stream the answer and fill `rec` in place (`now()`: run-relative seconds).

    Never raises for a server or network failure: those become the record's status. Cancellation
    (the run ending) propagates, leaving `rec` as far as it got.
    """
    headers = {"Accept": "text/event-stream"}
    if opts.api_key:
        headers["Authorization"] = f"Bearer {opts.api_key}"
    body = request_body(p, opts)
    rec.sent_s = now()
    rec.client_wait_ms = max(0.0, (rec.sent_s - p.scheduled_s) * 1000.0)
    st = _Stream()
    try:
        async with (
            asyncio.timeout(opts.request_timeout_s),
            http.stream("POST", opts.url, json=body, headers=headers) as resp,
        ):
            rec.http_status = resp.status_code
            if resp.status_code >= 400:
                raw = await resp.aread()
                rec.end_s = now()
                rec.e2e_ms = (rec.end_s - rec.sent_s) * 1000.0
                rec.status = "rejected" if resp.status_code in REJECT_STATUSES else "error"
                rec.retry_after = resp.headers.get("retry-after")
                rec.error = f"HTTP {resp.status_code}: {error_message(raw)}"
                return
            rec.adapter_version = resp.headers.get(ADAPTER_VERSION_HEADER) or None
            rec.replica = resp.headers.get(REPLICA_HEADER) or None
            if "text/event-stream" not in resp.headers.get("content-type", ""):
                raw = await resp.aread()
                t = now()
                try:
                    obj = json.loads(raw)
                except json.JSONDecodeError:
                    st.error = f"not JSON and not an event stream: {raw[:200]!r}"
                else:
                    st.take(obj if isinstance(obj, dict) else {}, t)
                    st.done = True
                _finish(rec, st, t)
                return
            dec = SSEDecoder()
            async for line in resp.aiter_lines():
                data = dec.feed(line)
                if data is None:
                    continue
                if _event(st, data, now()):
                    break
            else:
                data = dec.flush()
                if data is not None:
                    _event(st, data, now())
            _finish(rec, st, now())
    except TimeoutError:
        rec.end_s = now()
        rec.status = "timeout"
        rec.error = f"no complete answer within {opts.request_timeout_s:g} s"
        rec.first_token_s = st.first_s
        rec.text_chunks = st.chunks
    except httpx.HTTPError as e:
        rec.end_s = now()
        rec.status = "error"
        rec.error = f"{type(e).__name__}: {e}"[:300]
        rec.first_token_s = st.first_s
        rec.text_chunks = st.chunks


def _event(st: _Stream, data: str, t: float) -> bool:
    """Take one SSE data payload; True when the stream is over ([DONE] or an error event)."""
    if data.strip() == "[DONE]":
        st.done = True
        return True
    try:
        obj = json.loads(data)
    except json.JSONDecodeError:
        st.error = f"malformed event data: {data[:200]!r}"
        return True
    if not isinstance(obj, dict):
        st.error = f"unexpected event data: {data[:200]!r}"
        return True
    st.take(obj, t)
    return st.error is not None
