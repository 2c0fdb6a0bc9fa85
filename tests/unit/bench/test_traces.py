"""Trace parsing (Azure CSV, Mooncake JSONL), slicing, rate scaling and token-length fitting."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from collm_workload.traces import (
    LengthPolicy,
    TraceError,
    TraceRequest,
    fit_lengths,
    load_trace,
    parse_azure_csv,
    resolve_trace,
    slice_window,
    take_at_rate,
    time_scale,
    trace_label,
    trace_stats,
)

pytestmark = pytest.mark.unit

AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:17:03.9799600,4808,10
2023-11-16 18:17:04.0319600,3180,8
2023-11-16 18:17:05.5000000,100,250
2023-11-16 18:17:03.4799600,50,5
2023-11-16 18:18:03.4799600,7,1"""  # unsorted on purpose, and no final newline (like the real files)


def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_parse_azure_sorts_and_rezeroes(tmp_path: Path) -> None:
    reqs = parse_azure_csv(write(tmp_path, "t.csv", AZURE))
    assert [r.input_tokens for r in reqs] == [50, 4808, 3180, 100, 7]
    assert [r.output_tokens for r in reqs] == [5, 10, 8, 250, 1]
    # 7 fractional digits are kept (strptime's %f would refuse them).
    assert [r.arrival_s for r in reqs] == pytest.approx([0.0, 0.5, 0.552, 2.02004, 60.0])


def test_parse_azure_errors_name_the_line(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="missing columns"):
        parse_azure_csv(write(tmp_path, "a.csv", "time,in,out\n1,2,3"))
    bad = AZURE.replace("3180", "many")
    with pytest.raises(TraceError, match=r"t\.csv:3: ContextTokens must be an integer"):
        parse_azure_csv(write(tmp_path, "t.csv", bad))
    with pytest.raises(TraceError, match="bad TIMESTAMP"):
        parse_azure_csv(write(tmp_path, "b.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,1,2"))
    with pytest.raises(TraceError, match="no requests"):
        parse_azure_csv(write(tmp_path, "c.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"))


def test_parse_mooncake_ms_timestamps(tmp_path: Path) -> None:
    lines = [
        {"timestamp": 1000, "input_length": 10, "output_length": 3, "hash_ids": [0]},
        {"timestamp": 2500, "input_length": 20, "output_length": 4},
        {"timestamp": 0, "input_length": 30, "output_length": 5},
    ]
    reqs = load_trace(write(tmp_path, "m.jsonl", "\n".join(json.dumps(x) for x in lines) + "\n"))
    assert [(r.arrival_s, r.input_tokens, r.output_tokens) for r in reqs] == [
        (0.0, 30, 5),
        (1.0, 10, 3),
        (2.5, 20, 4),
    ]
    with pytest.raises(TraceError, match="not a Mooncake trace line"):
        load_trace(write(tmp_path, "bad.jsonl", '{"input_length": 3}\n'))


def test_load_trace_refuses_unknown_formats(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="unknown trace format"):
        load_trace(write(tmp_path, "t.txt", "x"))
    with pytest.raises(TraceError, match="does not exist"):
        load_trace(tmp_path / "missing.csv")
    with pytest.raises(TraceError, match="neither a file nor one of"):
        resolve_trace("nonsense", tmp_path)
    with pytest.raises(TraceError, match="not found"):
        resolve_trace("conv", tmp_path)


def uniform_trace(n: int, gap_s: float = 1.0) -> list[TraceRequest]:
    return [TraceRequest(i * gap_s, 100 + i, 10 + i) for i in range(n)]


def test_take_at_rate_gives_exactly_the_rate() -> None:
    reqs = uniform_trace(100)  # 1 req/s
    out = take_at_rate(reqs, rate_rps=4.0, duration_s=10.0)
    assert len(out) == 40
    # 40 gaps of 1 s become 40 gaps of 0.25 s: the 41st would land at exactly 10 s.
    assert [r.arrival_s for r in out] == pytest.approx([0.25 * i for i in range(40)])
    assert out[0].input_tokens == 100 and out[-1].input_tokens == 139  # consecutive, in order


def test_take_at_rate_keeps_the_burst_shape() -> None:
    # A burst of 3 then a lull: relative spacing is preserved, only stretched.
    reqs = [TraceRequest(t, 1, 1) for t in (0.0, 0.1, 0.2, 5.0, 10.0)]
    out = take_at_rate(reqs, rate_rps=0.2, duration_s=20.0)  # N = 4, span to the 5th = 10 s -> x2
    assert [r.arrival_s for r in out] == pytest.approx([0.0, 0.2, 0.4, 10.0])


def test_take_at_rate_from_a_start_offset_and_at_the_end_of_the_trace() -> None:
    reqs = uniform_trace(10)
    out = take_at_rate(reqs, rate_rps=1.0, duration_s=5.0, start_s=3.0)
    assert [r.input_tokens for r in out] == [103, 104, 105, 106, 107]
    assert [r.arrival_s for r in out] == pytest.approx([0, 1, 2, 3, 4])
    # The slice reaches the last request: one mean gap is extrapolated past it.
    out = take_at_rate(reqs, rate_rps=2.0, duration_s=2.5, start_s=5.0)
    assert [r.arrival_s for r in out] == pytest.approx([0.0, 0.5, 1.0, 1.5, 2.0])
    with pytest.raises(TraceError, match="lower --rate"):
        take_at_rate(reqs, rate_rps=10.0, duration_s=10.0)


def test_take_at_rate_single_timestamp_burst() -> None:
    out = take_at_rate([TraceRequest(0.0, 1, 1)] * 5, rate_rps=1.0, duration_s=4.0)
    assert [r.arrival_s for r in out] == pytest.approx([0, 1, 2, 3])


def test_slice_window_and_time_scale() -> None:
    reqs = uniform_trace(10)
    s = slice_window(reqs, 2.5, 4.0)
    assert [r.arrival_s for r in s] == pytest.approx([0.5, 1.5, 2.5, 3.5])
    assert [r.input_tokens for r in s] == [103, 104, 105, 106]
    with pytest.raises(TraceError, match="no trace requests"):
        slice_window(reqs, 100.0, 1.0)
    ts = time_scale(s, 0.5)
    assert [r.arrival_s for r in ts] == pytest.approx([0.0, 0.5, 1.0, 1.5])


def test_stats() -> None:
    st = trace_stats(uniform_trace(11))
    assert st.count == 11 and st.span_s == 10 and st.mean_rate_rps == pytest.approx(1.0)
    assert st.interarrival_cv == pytest.approx(0.0)
    assert st.input_mean == pytest.approx(105) and st.output_p50 == pytest.approx(15)


def test_length_policy_scales_then_clips_to_the_context() -> None:
    p = LengthPolicy(input_scale=0.5, max_output_tokens=256, max_context_tokens=2048)
    assert p.fit(1000, 100) == (500, 100)
    assert p.fit(8000, 1000) == (2048 - 256, 256)  # output clipped first, input fills what is left
    assert p.fit(1, 0) == (1, 1)  # minimums
    assert LengthPolicy(max_input_tokens=300).fit(7437, 5) == (300, 5)
    out = fit_lengths(uniform_trace(3), LengthPolicy(output_scale=2.0))
    assert [(r.input_tokens, r.output_tokens) for r in out] == [(100, 20), (101, 22), (102, 24)]
    with pytest.raises(TraceError):
        LengthPolicy(max_context_tokens=1)
    with pytest.raises(TraceError):
        LengthPolicy(input_scale=0)
    with pytest.raises(TraceError):
        LengthPolicy(max_output_tokens=0)


def test_real_azure_traces(shared_data: Path) -> None:
    # Figures from shared/data/traces/README.md.
    conv = load_trace(resolve_trace("conv", shared_data / "traces"))
    st = trace_stats(conv)
    assert st.count == 19366 and st.mean_rate_rps == pytest.approx(5.53, abs=0.01)
    assert st.span_s == pytest.approx(3501.7, abs=0.1)
    assert st.input_mean == pytest.approx(1154.7, abs=0.1) and st.output_p50 == 129
    code = load_trace(resolve_trace("code", shared_data / "traces"))
    cst = trace_stats(code)
    assert cst.count == 8819 and cst.interarrival_cv == pytest.approx(13.15, abs=0.01)
    # A 60 s replay of the bursty code trace at 2 req/s: 120 consecutive requests, the rate exact, and
    # the slice's burstiness (inter-arrival CV) unchanged by the time scaling.
    out = take_at_rate(code, rate_rps=2.0, duration_s=60.0, start_s=600.0)
    assert len(out) == 120 and out[-1].arrival_s < 60.0
    original = [r for r in code if r.arrival_s >= 600.0][:120]
    assert [r.input_tokens for r in out] == [r.input_tokens for r in original]
    cv = [np.std(g) / np.mean(g) for g in (np.diff([r.arrival_s for r in x]) for x in (out, original))]
    assert cv[0] == pytest.approx(cv[1], rel=1e-6)


@pytest.mark.parametrize(
    ("name", "label"),
    [
        ("azure_llm_2023_conv.csv", "azure 2023 conv"),
        ("azure_llm_2024_code.csv", "azure 2024 code"),
        ("mooncake_fast25_conversation.jsonl", "mooncake fast25 conversation"),
        ("mooncake_fast25_synthetic.jsonl", "mooncake fast25 synthetic"),
        ("my_slice.csv", "azure my slice"),
        ("other.txt", "other"),
    ],
)
def test_trace_label_names_the_source_by_the_format(name: str, label: str) -> None:
    assert trace_label(Path("/data") / name) == label
