"""Request traces: parsing, slicing, time scaling and token-length fitting (pure).

Formats:

* Azure LLM inference 2023 (`TIMESTAMP, ContextTokens, GeneratedTokens`; CSV with header). Timestamps look
  like `2023-11-16 18:17:03.9799600` (7 fractional digits, no time zone); they are read as UTC and only
  differences matter.
* Mooncake JSONL (`timestamp` in milliseconds, `input_length`, `output_length`, optional `hash_ids`).

Every function returns a new list of `TraceRequest`s sorted by arrival, with arrivals re-zeroed so the
first request arrives at 0 s. Nothing here touches the clock, the network or the file system beyond the
parse functions.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from collm_common.stats import percentiles

# Names accepted by `resolve_trace` for the files shipped in `shared/data/traces`.
NAMED_TRACES: dict[str, str] = {
    "code": "azure_llm_2023_code.csv",
    "conv": "azure_llm_2023_conv.csv",
    "mooncake-conv": "mooncake_fast25_conversation.jsonl",
    "mooncake-synthetic": "mooncake_fast25_synthetic.jsonl",
}

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


class TraceError(ValueError):
    """A trace that cannot be read or a request for a slice it cannot give."""


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float
    input_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class TraceStats:
    count: int
    span_s: float
    # (count - 1) / span, the definition traces/README.md uses.
    mean_rate_rps: float
    interarrival_cv: float
    input_mean: float
    input_p50: float
    input_p99: float
    output_mean: float
    output_p50: float
    output_p99: float

    def as_dict(self) -> dict[str, float | int]:
        return dict(vars(self))


def _parse_azure_timestamp(text: str, where: str) -> float:
    # strptime's %f takes at most 6 digits and the trace has 7: parse the fraction ourselves.
    whole, _, frac = text.strip().partition(".")
    try:
        dt = datetime.strptime(whole, "%Y-%m-%d %H:%M:%S").replace(tzinfo=UTC)
    except ValueError as e:
        raise TraceError(f"{where}: bad TIMESTAMP {text!r} (want YYYY-MM-DD HH:MM:SS.fffffff)") from e
    if frac and not frac.isdigit():
        raise TraceError(f"{where}: bad TIMESTAMP fraction {text!r}")
    return dt.timestamp() + (int(frac) / 10 ** len(frac) if frac else 0.0)


def _positive_int(value: object, column: str, where: str) -> int:
    try:
        n = int(str(value).strip())
    except ValueError as e:
        raise TraceError(f"{where}: {column} must be an integer (got {value!r})") from e
    if n < 0:
        raise TraceError(f"{where}: {column} must be >= 0 (got {n})")
    return n


def _normalise(rows: list[tuple[float, int, int]]) -> list[TraceRequest]:
    if not rows:
        raise TraceError("the trace has no requests")
    rows.sort(key=lambda r: r[0])
    t0 = rows[0][0]
    return [TraceRequest(t - t0, i, o) for t, i, o in rows]


def parse_azure_csv(path: str | Path) -> list[TraceRequest]:
    p = Path(path)
    with p.open(encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        header = tuple(h.strip() for h in (reader.fieldnames or ()))
        missing = [c for c in AZURE_COLUMNS if c not in header]
        if missing:
            raise TraceError(
                f"{p}: not an Azure LLM trace (missing columns {missing}; header {list(header)})"
            )
        rows: list[tuple[float, int, int]] = []
        for n, row in enumerate(reader, start=2):
            row = {k.strip(): v for k, v in row.items() if k is not None}
            where = f"{p}:{n}"
            rows.append(
                (
                    _parse_azure_timestamp(row["TIMESTAMP"] or "", where),
                    _positive_int(row["ContextTokens"], "ContextTokens", where),
                    _positive_int(row["GeneratedTokens"], "GeneratedTokens", where),
                )
            )
    return _normalise(rows)


def parse_mooncake_jsonl(path: str | Path) -> list[TraceRequest]:
    p = Path(path)
    rows: list[tuple[float, int, int]] = []
    with p.open(encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{p}:{n}"
            try:
                obj = json.loads(line)
                ts_ms = float(obj["timestamp"])
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                raise TraceError(f"{where}: not a Mooncake trace line ({e})") from e
            rows.append(
                (
                    ts_ms / 1000.0,
                    _positive_int(obj.get("input_length"), "input_length", where),
                    _positive_int(obj.get("output_length"), "output_length", where),
                )
            )
    return _normalise(rows)


def load_trace(path: str | Path) -> list[TraceRequest]:
    """Parse a trace file, choosing the format by suffix (`.csv`: Azure, `.jsonl`: Mooncake)."""
    p = Path(path)
    if not p.is_file():
        raise TraceError(f"trace file {p} does not exist")
    if p.suffix == ".csv":
        return parse_azure_csv(p)
    if p.suffix == ".jsonl":
        return parse_mooncake_jsonl(p)
    raise TraceError(f"{p}: unknown trace format (want .csv in the Azure format or Mooncake .jsonl)")


def resolve_trace(spec: str, traces_dir: str | Path | None) -> Path:
    """`conv`, `code`, `mooncake-conv`, `mooncake-synthetic` (files in `traces_dir`) or a path."""
    if spec in NAMED_TRACES:
        if traces_dir is None:
            raise TraceError(f"trace {spec!r} is a named trace but no traces directory is known")
        p = Path(traces_dir) / NAMED_TRACES[spec]
        if not p.is_file():
            raise TraceError(f"named trace {spec!r} not found at {p} (set the traces directory)")
        return p
    p = Path(spec)
    if not p.is_file():
        names = ", ".join(NAMED_TRACES)
        raise TraceError(f"trace {spec!r} is neither a file nor one of: {names}")
    return p


def trace_label(path: str | Path) -> str:
    """The trace's source and name, by its format (as `load_trace` reads it): `azure <name>` for an
    Azure CSV, `mooncake <name>` for a Mooncake JSONL, `<name>` otherwise; the name is the file's stem
    less its source's prefix (`azure_llm_2023_conv.csv` -> `azure 2023 conv`,
    `mooncake_fast25_conversation.jsonl` -> `mooncake fast25 conversation`)."""
    p = Path(path)
    source = {".csv": "azure", ".jsonl": "mooncake"}.get(p.suffix)
    stem = p.stem
    if source is None:
        return stem
    for prefix in (f"{source}_llm_", f"{source}_"):
        if stem.lower().startswith(prefix):
            stem = stem[len(prefix) :]
            break
    return f"{source} {stem.replace('_', ' ')}"


def trace_stats(reqs: Sequence[TraceRequest]) -> TraceStats:
    if not reqs:
        raise TraceError("no requests")
    t = np.array([r.arrival_s for r in reqs])
    ins = np.array([r.input_tokens for r in reqs], dtype=float)
    outs = np.array([r.output_tokens for r in reqs], dtype=float)
    span = float(t[-1] - t[0])
    gaps = np.diff(t)
    cv = float(gaps.std() / gaps.mean()) if len(gaps) > 1 and gaps.mean() > 0 else 0.0
    in_p50, in_p99 = percentiles(ins.tolist(), (50, 99))
    out_p50, out_p99 = percentiles(outs.tolist(), (50, 99))
    return TraceStats(
        count=len(reqs),
        span_s=span,
        mean_rate_rps=(len(reqs) - 1) / span if span > 0 else math.inf,
        interarrival_cv=cv,
        input_mean=float(ins.mean()),
        input_p50=in_p50,
        input_p99=in_p99,
        output_mean=float(outs.mean()),
        output_p50=out_p50,
        output_p99=out_p99,
    )


def _rezero(reqs: Sequence[TraceRequest]) -> list[TraceRequest]:
    if not reqs:
        return []
    t0 = reqs[0].arrival_s
    return [replace(r, arrival_s=r.arrival_s - t0) for r in reqs]


def slice_window(
    reqs: Sequence[TraceRequest], start_s: float = 0.0, length_s: float | None = None
) -> list[TraceRequest]:
    """Requests arriving in [start_s, start_s + length_s) of trace time, re-zeroed at `start_s`."""
    if start_s < 0:
        raise TraceError("start_s must be >= 0")
    end = math.inf if length_s is None else start_s + length_s
    out = [replace(r, arrival_s=r.arrival_s - start_s) for r in reqs if start_s <= r.arrival_s < end]
    if not out:
        raise TraceError(f"no trace requests in [{start_s}, {end}) s")
    return out


def time_scale(reqs: Sequence[TraceRequest], factor: float) -> list[TraceRequest]:
    """Multiply every inter-arrival time by `factor` (< 1 compresses: a higher rate)."""
    if not factor > 0:
        raise TraceError("time scale factor must be > 0")
    return [replace(r, arrival_s=r.arrival_s * factor) for r in _rezero(reqs)]


def take_at_rate(
    reqs: Sequence[TraceRequest], rate_rps: float, duration_s: float, start_s: float = 0.0
) -> list[TraceRequest]:
    """Replay consecutive trace requests at mean rate `rate_rps` for `duration_s` seconds.

    Takes the N = round(rate * duration) consecutive requests arriving at or after `start_s` (trace
    time) and scales their timestamps linearly so that they fill [0, duration): the (N+1)-th request of
    the trace would land exactly at `duration_s`, so the replay's mean rate is exactly N / duration.
    The shape of the slice (its bursts and lulls) is kept; only the time axis is stretched.
    """
    if not rate_rps > 0 or not duration_s > 0:
        raise TraceError("rate_rps and duration_s must be > 0")
    n = max(1, round(rate_rps * duration_s))
    tail = [r for r in reqs if r.arrival_s >= start_s]
    if len(tail) < n:
        raise TraceError(
            f"the trace has {len(tail)} requests after {start_s} s but rate x duration asks for {n}: "
            "lower --rate or --duration, or start earlier"
        )
    window = tail[: n + 1]
    t0 = window[0].arrival_s
    if len(window) == n + 1:
        span = window[-1].arrival_s - t0
    else:
        # The slice reaches the end of the trace: extrapolate one mean gap past the last request.
        last = window[-1].arrival_s - t0
        span = last * n / (n - 1) if n > 1 else 0.0
    chosen = window[:n]
    if span <= 0:
        # All N requests share one timestamp (a burst): spread them evenly, nothing else is meaningful.
        return [replace(r, arrival_s=duration_s * i / n) for i, r in enumerate(chosen)]
    factor = duration_s / span
    return [replace(r, arrival_s=(r.arrival_s - t0) * factor) for r in chosen]


@dataclass(frozen=True)
class LengthPolicy:
    """How trace token counts are fitted to a model: scale first, then clip.

    Output is fitted first (clip to [min_output_tokens, max_output_tokens]); then the input is clipped
    to [min_input_tokens, max_input_tokens] and to `max_context_tokens - output`, so that prompt plus
    generation always fit the model's context.
    """

    input_scale: float = 1.0
    output_scale: float = 1.0
    min_input_tokens: int = 1
    max_input_tokens: int | None = None
    min_output_tokens: int = 1
    max_output_tokens: int | None = None
    max_context_tokens: int | None = None

    def __post_init__(self) -> None:
        if not (self.input_scale > 0 and self.output_scale > 0):
            raise TraceError("token scales must be > 0")
        if self.min_input_tokens < 1 or self.min_output_tokens < 1:
            raise TraceError("minimum token counts must be >= 1")
        for lo, hi, what in (
            (self.min_input_tokens, self.max_input_tokens, "input"),
            (self.min_output_tokens, self.max_output_tokens, "output"),
        ):
            if hi is not None and hi < lo:
                raise TraceError(f"max {what} tokens ({hi}) is below the minimum ({lo})")
        if self.max_context_tokens is not None and (
            self.max_context_tokens < self.min_input_tokens + self.min_output_tokens
        ):
            raise TraceError("max_context_tokens leaves no room for the minimum input and output")

    def fit(self, input_tokens: int, output_tokens: int) -> tuple[int, int]:
        out = max(self.min_output_tokens, round(output_tokens * self.output_scale))
        if self.max_output_tokens is not None:
            out = min(out, self.max_output_tokens)
        if self.max_context_tokens is not None:
            out = min(out, self.max_context_tokens - self.min_input_tokens)
        inp = max(self.min_input_tokens, round(input_tokens * self.input_scale))
        if self.max_input_tokens is not None:
            inp = min(inp, self.max_input_tokens)
        if self.max_context_tokens is not None:
            inp = min(inp, self.max_context_tokens - out)
        return inp, out


def fit_lengths(reqs: Sequence[TraceRequest], policy: LengthPolicy) -> list[TraceRequest]:
    out = []
    for r in reqs:
        i, o = policy.fit(r.input_tokens, r.output_tokens)
        out.append(replace(r, input_tokens=i, output_tokens=o))
    return out
