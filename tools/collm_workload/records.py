"""The per-request record: one JSON object per line in `requests.jsonl` (pure data, no I/O but files).

Times ending in `_s` are seconds since the run's start (the first scheduled arrival is at 0), on the
client's monotonic clock; latencies end in `_ms`. Statuses:

* `ok`: the stream finished (`[DONE]` or a `finish_reason`) with no error;
* `error`: an HTTP error status (other than 429/503), an error event in the stream, a broken or
  truncated stream, or a connection failure;
* `rejected`: the server refused admission (HTTP 429 or 503);
* `timeout`: the request had been sent and did not finish within the per-request timeout, or was still
  running when the run's drain timeout ended it;
* `dropped`: scheduled within the run but never sent (still waiting for a concurrency slot when the run
  ended, or the run was interrupted).

Only `ok` requests can be good (see `goodput.py`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

Status = Literal["ok", "error", "rejected", "timeout", "dropped"]
STATUSES: tuple[str, ...] = ("ok", "error", "rejected", "timeout", "dropped")


@dataclass
class RequestRecord:
    request_id: str
    index: int
    domain: str
    model: str
    status: Status
    scheduled_s: float
    sent_s: float | None = None
    first_token_s: float | None = None
    end_s: float | None = None
    # Latencies, measured from `sent_s` (the moment the HTTP request left the client).
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    itl_ms: list[float] = field(default_factory=list)
    # Time spent waiting for a client concurrency slot (scheduled -> sent), not part of TTFT.
    client_wait_ms: float | None = None
    # Token counts: `prompt_tokens`/`completion_tokens` are the server's usage (ground truth);
    # when the server sends no usage, completion_tokens is the number of non-empty text chunks.
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    usage_reported: bool = False
    target_input_tokens: int | None = None
    estimated_input_tokens: int | None = None
    max_tokens: int | None = None
    text_chunks: int = 0
    finish_reason: str | None = None
    http_status: int | None = None
    retry_after: str | None = None  # the `Retry-After` header of an error answer
    error: str | None = None
    # Exact adapter version that served the request (`x-collm-adapter-version` header, else the
    # stream's `system_fingerprint`, whose `replica/` prefix is dropped), the replica that served it
    # (`x-collm-replica`), and the `model` the server echoed.
    adapter_version: str | None = None
    replica: str | None = None
    served_model: str | None = None
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_dict(cls, obj: dict[str, Any]) -> RequestRecord:
        names = {f.name for f in fields(cls)}
        missing = {"request_id", "index", "domain", "model", "status", "scheduled_s"} - obj.keys()
        if missing:
            raise ValueError(f"request record lacks {sorted(missing)}")
        if obj["status"] not in STATUSES:
            raise ValueError(f"request record has unknown status {obj['status']!r}")
        return cls(**{k: v for k, v in obj.items() if k in names})


def write_records(path: str | Path, records: Iterable[RequestRecord]) -> int:
    n = 0
    with Path(path).open("w", encoding="utf-8") as f:
        for r in records:
            f.write(r.to_json() + "\n")
            n += 1
    return n


def read_records(path: str | Path) -> list[RequestRecord]:
    p = Path(path)
    out = []
    with p.open(encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                out.append(RequestRecord.from_dict(json.loads(line)))
            except (json.JSONDecodeError, TypeError, ValueError) as e:
                raise ValueError(f"{p}:{n}: not a request record ({e})") from e
    return out
