"""A short human-readable rendering of a summary (the JSON stays the source of truth)."""

from __future__ import annotations

from typing import Any


def _f(v: Any, spec: str = ".1f", suffix: str = "") -> str:
    return "-" if v is None else f"{v:{spec}}{suffix}"


def format_summary(s: dict[str, Any]) -> str:
    c = s["counts"]
    st = c["by_status"]
    lat = s["latency_ms"]
    lines = [
        f"duration {_f(s['duration_s'], '.1f', ' s')}  submitted {c['submitted']}  "
        f"completed {c['completed']}  good {c['good']}",
        f"goodput {_f(s['goodput_rps'], '.3f', ' req/s')}  "
        f"attainment {_f(_pct(s['attainment']), '.1f', '%')}  "
        f"throughput {_f(s['request_throughput_rps'], '.3f', ' req/s')}  "
        f"output {_f(s['output_throughput_tps'], '.1f', ' tok/s')}",
        "status   " + "  ".join(f"{k} {v}" for k, v in st.items()),
    ]
    if c["not_good_by_reason"]:
        lines.append("not good " + "  ".join(f"{k} {v}" for k, v in c["not_good_by_reason"].items()))
    lines.append(f"{'ms':6} {'mean':>9} {'p50':>9} {'p90':>9} {'p99':>9} {'n':>7}")
    for name in ("ttft", "tpot", "itl", "e2e"):
        d = lat[name]
        lines.append(
            f"{name:6} {_f(d['mean']):>9} {_f(d['p50']):>9} {_f(d['p90']):>9} {_f(d['p99']):>9} "
            f"{d['count']:>7}"
        )
    if s.get("by_domain"):
        lines.append(f"{'domain':18} {'subm':>6} {'good':>6} {'attain':>7} {'ttft p50':>9} {'tpot p50':>9}")
        for name, d in s["by_domain"].items():
            lines.append(
                f"{name:18} {d['submitted']:>6} {d['good']:>6} {_f(_pct(d['attainment']), '.1f', '%'):>7} "
                f"{_f(d['ttft_ms_p50']):>9} {_f(d['tpot_ms_p50']):>9}"
            )
    q = s.get("quality") or {}
    if q.get("available"):
        lines.append(
            f"quality: joined {q['requests_joined']}/{q['requests_served']} served  "
            f"mean served loss {_f(q['mean_served_loss'], '.4f')}  "
            f"mean gain {_f(q['mean_quality_gain'], '.4f')}  "
            f"final gain {_f(q['final_quality_gain'], '.4f')}"
        )
    for msg, n in list((s.get("errors") or {}).items())[:5]:
        lines.append(f"error x{n}: {msg}")
    return "\n".join(lines)


def _pct(v: float | None) -> float | None:
    return None if v is None else 100.0 * v
