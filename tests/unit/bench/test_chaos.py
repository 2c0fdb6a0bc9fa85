"""Chaos under load: the kill schedule, request fates and the summary's goals."""

from __future__ import annotations

from collm_bench.chaos import fate, fates, kill_schedule, recovery, table, verdicts


def test_the_kill_schedule_is_seeded_spaced_and_ends_before_the_window() -> None:
    targets = ["aggregator", "coordinator", "gateway", "nats", "redis", "replica-r0", "replica-r1"]
    s = kill_schedule(7, 1200.0, targets)
    assert s == kill_schedule(7, 1200.0, targets) and s != kill_schedule(8, 1200.0, targets)
    times = [t for t, _ in s]
    gaps = [b - a for a, b in zip([0.0, *times], times, strict=False)]
    assert all(30.0 <= g <= 90.0 + 0.1 for g in gaps) and times[-1] <= 1200.0 - 30.0
    assert 1200 / 90 - 1 <= len(s) <= 1200 / 30 and {w for _, w in s} <= set(targets)


def test_each_request_has_one_fate() -> None:
    assert fate({"status": "ok", "http_status": 200}) == "answered"
    assert fate({"status": "timeout", "http_status": 200}) == "hung"
    assert fate({"status": "error", "http_status": None, "error": "ReadError"}) == "connection_lost"
    assert fate({"status": "rejected", "http_status": 503, "retry_after": "1"}) == "clear_error"
    assert fate({"status": "error", "http_status": 503}) == "bad_5xx"  # no Retry-After
    assert fate({"status": "error", "http_status": 500, "retry_after": "1"}) == "bad_5xx"
    assert fate({"status": "rejected", "http_status": 429, "retry_after": "2"}) == "clear_error"
    assert fate({"status": "error", "http_status": 200, "error": "error event: replica r0 went silent"}) == (
        "clear_error"
    )
    cut = {"status": "error", "http_status": 200, "error": "RemoteProtocolError: peer closed connection"}
    assert fate(cut) == "connection_lost"  # a stream cut by the gateway's death
    out = fates([{"status": "ok"}, {"status": "timeout"}, {"status": "error", "http_status": 502}])
    assert (out["requests"], out["answered"], out["hung"], out["bad_5xx"]) == (3, 1, 1, 1)
    assert out["by_status"] == {"bad_5xx: 502": 1, "hung: -": 1}


def test_recovery_and_goals() -> None:
    kills = [
        {"target": "replica-r0", "recovery_s": 10.0},
        {"target": "replica-r1", "recovery_s": 20.0},
        {"target": "redis", "recovery_s": 3.0},
        {"target": "nats", "recovery_s": None},
    ]
    r = recovery(kills)
    assert (r["kills"], r["recovered"], r["p50_s"], r["max_s"]) == (4, 3, 10.0, 20.0)
    assert r["by_kind"]["replica"] == {"kills": 2, "p50_s": 15.0, "max_s": 20.0}
    summary = {
        "requests": fates([{"status": "ok"}]),
        "samples": {"accepted": 10, "lost": 0},
        "versions": {"checked": 5, "digest_mismatch": 0},
        "recovery": r,
        "rounds_published": 4,
        "quality": {"math": {"base": 1.0, "chaos": 0.9, "no_chaos": 0.85}},
    }
    v = verdicts(summary)
    assert not v["every kill recovered"] and all(ok for k, ok in v.items() if k != "every kill recovered")
    row = "| served loss at the end, chaos / none (base) | math 0.900 / 0.850 (1.000) |  |"
    assert row in table(summary)
