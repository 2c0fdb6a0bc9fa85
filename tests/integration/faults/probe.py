"""Requests through the gateway, each classified by what the client got: a full answer, a clear error, or
nothing usable ("lost").

* ok: HTTP 200 and, for a stream, a chunk with a `finish_reason` then `data: [DONE]` and no error event;
  for a plain request, a JSON body with a choice and a `finish_reason`.
* error (clear): an HTTP error status with the OpenAI envelope `{"error": {"message", "type", ...}}`,
  or, once a stream has started, an error event `data: {"error": {...}}` followed by `data: [DONE]`.
* lost: anything else: a connection dropped mid-answer, a stream without `[DONE]`, a body that is not
  the envelope, or no answer before the client's timeout (the request deadline plus a margin), which
  is a request that hung past its deadline.

`run_load` keeps `concurrency` requests in flight for `duration_s` (closed loop), alternating streamed
and plain requests (or streams only), and returns every outcome with its send and end times (monotonic
seconds). Each outcome also names the replica in the `x-collm-replica` header (the one that accepted the
request first) and in `system_fingerprint` (the one that generated the answer): they differ when the
gateway moved the request to another replica before its first token.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Literal

import httpx

Kind = Literal["ok", "error", "lost"]


@dataclass
class Outcome:
    index: int
    stream: bool
    sent_s: float
    end_s: float
    kind: Kind
    status: int | None = None
    code: str | None = None
    message: str = ""
    replica: str | None = None
    completion_tokens: int = 0
    retry_after: str | None = None
    # `system_fingerprint` of the answer (`r1/base`), and when a stream's first data event arrived
    # (its first token: the gateway sends the first chunk with it).
    fingerprint: str | None = None
    first_data_s: float | None = None
    # When the response headers arrived (a stream's: when a replica had accepted it).
    headers_s: float | None = None

    @property
    def latency_s(self) -> float:
        return self.end_s - self.sent_s

    @property
    def generated_by(self) -> str | None:
        """The replica that generated the answer (from `system_fingerprint`; else the header's)."""
        if self.fingerprint:
            return self.fingerprint.split("/", 1)[0]
        return self.replica

    @property
    def moved(self) -> bool:
        """Accepted by one replica, answered by another (moved before its first token)."""
        return self.kind == "ok" and self.replica is not None and self.generated_by != self.replica

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _envelope(body: Any) -> dict[str, Any] | None:
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        err = body["error"]
        if isinstance(err.get("message"), str) and err.get("message") and "type" in err:
            return err
    return None


def _events(raw: str) -> list[str]:
    out = []
    for block in raw.replace("\r\n", "\n").split("\n\n"):
        data = [line[len("data:") :].strip() for line in block.split("\n") if line.startswith("data:")]
        if data:
            out.append("\n".join(data))
    return out


async def one_request(
    http: httpx.AsyncClient,
    base_url: str,
    model: str,
    *,
    stream: bool,
    max_tokens: int = 16,
    timeout_s: float = 35.0,
    index: int = 0,
    prompt: str = "Tell me something about faults.",
    live: dict[int, tuple[str | None, float]] | None = None,
    waiting: dict[int, tuple[str | None, float]] | None = None,
) -> Outcome:
    """One chat completion, classified (module docstring). A stream whose answer has started (HTTP 200
    received) sits in `live` (index -> the replica serving it and when its answer started, monotonic)
    until it ends, and in `waiting` until its first data event (accepted, no token yet)."""
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": f"{prompt} ({index})"}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    t0 = time.monotonic()

    first_data_s: float | None = None
    headers_s: float | None = None
    fingerprint: str | None = None

    def done(kind: Kind, **kw: Any) -> Outcome:
        end_s = time.monotonic()
        first = first_data_s if stream else (end_s if kind == "ok" else None)
        return Outcome(
            index,
            stream,
            t0,
            end_s,
            kind,
            fingerprint=fingerprint,
            first_data_s=first,
            headers_s=headers_s,
            **kw,
        )

    try:
        async with asyncio.timeout(timeout_s):
            async with http.stream("POST", f"{base_url}/v1/chat/completions", json=body) as resp:
                headers_s = time.monotonic()
                replica = resp.headers.get("x-collm-replica")
                if stream and resp.status_code == 200:
                    now = time.monotonic()
                    for where in (live, waiting):
                        if where is not None:
                            where[index] = (replica, now)
                parts: list[str] = []
                try:
                    async for part in resp.aiter_text():
                        parts.append(part)
                        if first_data_s is None and "data:" in part:
                            first_data_s = time.monotonic()
                            if waiting is not None:
                                waiting.pop(index, None)
                finally:
                    for where in (live, waiting):
                        if where is not None:
                            where.pop(index, None)
                raw = "".join(parts)
                retry_after = resp.headers.get("retry-after")
                if resp.status_code != 200:
                    try:
                        err = _envelope(json.loads(raw))
                    except ValueError:
                        err = None
                    if err is None:
                        return done("lost", status=resp.status_code, message=f"not an envelope: {raw[:200]}")
                    return done(
                        "error",
                        status=resp.status_code,
                        code=err.get("code"),
                        message=err["message"],
                        replica=replica,
                        retry_after=retry_after,
                    )
                if not stream:
                    data = json.loads(raw)
                    fingerprint = data.get("system_fingerprint")
                    choice = (data.get("choices") or [{}])[0]
                    if choice.get("finish_reason") in ("stop", "length"):
                        tokens = int((data.get("usage") or {}).get("completion_tokens", 0))
                        return done("ok", status=200, replica=replica, completion_tokens=tokens)
                    return done("lost", status=200, message=f"no finish_reason: {raw[:200]}")
                events = _events(raw)
                if not events or events[-1] != "[DONE]":
                    return done("lost", status=200, replica=replica, message=f"no [DONE]: {raw[-200:]}")
                finished, tokens = False, 0
                for e in events[:-1]:
                    obj = json.loads(e)
                    fingerprint = fingerprint or obj.get("system_fingerprint")
                    err = _envelope(obj)
                    if err is not None:
                        return done(
                            "error", status=200, code=err.get("code"), message=err["message"], replica=replica
                        )
                    for ch in obj.get("choices") or []:
                        finished = finished or ch.get("finish_reason") in ("stop", "length")
                    if obj.get("usage"):
                        tokens = int(obj["usage"].get("completion_tokens", 0))
                if not finished:
                    return done("lost", status=200, replica=replica, message="stream ended without a finish")
                return done("ok", status=200, replica=replica, completion_tokens=tokens)
    except TimeoutError:
        return done("lost", message=f"no answer within {timeout_s:.0f}s (hung past its deadline)")
    except (httpx.HTTPError, ValueError) as exc:
        return done("lost", message=f"{type(exc).__name__}: {exc}")


async def run_load(
    base_url: str,
    model: str,
    *,
    concurrency: int,
    duration_s: float,
    max_tokens: int = 48,
    timeout_s: float = 35.0,
    stop: asyncio.Event | None = None,
    on_outcome: Callable[[Outcome], None] | None = None,
    live: dict[int, tuple[str | None, float]] | None = None,
    waiting: dict[int, tuple[str | None, float]] | None = None,
    streams_only: bool = False,
) -> list[Outcome]:
    """Closed-loop load: `concurrency` workers, each sending its next request when the last one ends
    (`live`, `waiting`: the streams in progress, see `one_request`)."""
    outcomes: list[Outcome] = []
    end_s = time.monotonic() + duration_s
    counter = iter(range(1 << 30))
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)

    async def worker(http: httpx.AsyncClient) -> None:
        while time.monotonic() < end_s and not (stop is not None and stop.is_set()):
            i = next(counter)
            o = await one_request(
                http,
                base_url,
                model,
                stream=streams_only or i % 2 == 0,
                max_tokens=max_tokens,
                timeout_s=timeout_s,
                index=i,
                live=live,
                waiting=waiting,
            )
            outcomes.append(o)
            if on_outcome is not None:
                on_outcome(o)

    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout_s)) as http:
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
    return sorted(outcomes, key=lambda o: o.sent_s)


def tally(outcomes: list[Outcome]) -> dict[str, int]:
    return {
        "sent": len(outcomes),
        "succeeded": sum(o.kind == "ok" for o in outcomes),
        "failed_clear": sum(o.kind == "error" for o in outcomes),
        "lost": sum(o.kind == "lost" for o in outcomes),
    }
