"""The launcher's supervision decisions (collm_ops.supervise): backoff, its reset after a stable run,
crash-loop detection and recovery, holds, and what the log lines say. Time is passed in (`now_s`)."""

from __future__ import annotations

import signal

import pytest

from collm_ops.supervise import Restart, SupervisionPolicy, Supervisor, describe_exit

pytestmark = pytest.mark.unit

POLICY = SupervisionPolicy(
    first_backoff_s=1.0,
    backoff_factor=2.0,
    max_backoff_s=30.0,
    stable_s=60.0,
    crash_loop_exits=5,
    crash_loop_window_s=300.0,
)


def crash_once(sup: Supervisor, name: str, t: float, code: int = -9) -> tuple[Restart, float]:
    """`name` exits at `t` and is started again when its restart is due; returns the decision and
    the time it was started again."""
    d = sup.exited(name, code, t)
    assert d is not None
    assert sup.due(d.at_s - 1e-6) == []
    assert sup.due(d.at_s) == [name]
    sup.started(name, d.at_s)
    return d, d.at_s


def test_backoff_doubles_from_one_second_up_to_thirty() -> None:
    assert [POLICY.backoff_s(n) for n in range(8)] == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
    assert POLICY.backoff_s(10_000) == 30.0  # no overflow however long it loops


def test_quick_exits_back_off_exponentially_and_are_numbered() -> None:
    sup = Supervisor(POLICY)
    sup.started("replica-r0", 0.0)
    t = 10.0
    delays, numbers = [], []
    for _ in range(7):
        d, t = crash_once(sup, "replica-r0", t + 0.5)
        delays.append(d.delay_s)
        numbers.append(d.restart_number)
    assert delays == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert numbers == [1, 2, 3, 4, 5, 6, 7]


def test_a_stable_run_resets_the_backoff() -> None:
    sup = Supervisor(POLICY)
    sup.started("gateway", 0.0)
    _, t = crash_once(sup, "gateway", 5.0)
    d, t = crash_once(sup, "gateway", t + 1.0)
    assert d.delay_s == 2.0
    d, t = crash_once(sup, "gateway", t + 60.0)  # ran 60 s: stable
    assert d.delay_s == 1.0 and d.restart_number == 3
    d, _ = crash_once(sup, "gateway", t + 1.0)
    assert d.delay_s == 2.0


def test_crash_loop_is_reported_once_and_retried_at_the_max_backoff() -> None:
    sup = Supervisor(POLICY)
    sup.started("replica-r1", 0.0)
    t = 0.0
    began = []
    for _ in range(8):
        d, t = crash_once(sup, "replica-r1", t + 0.1, code=1)
        began.append(d.crash_loop_began)
    assert began == [False, False, False, False, True, False, False, False]
    assert d.crash_looping and d.delay_s == 30.0
    assert sup.crash_looping() == ["replica-r1"]
    snap = sup.snapshot(t)["replica-r1"]
    assert snap["crash_looping"] is True and snap["last_exit"] == "exit code 1" and snap["restarts"] == 8
    line = d.describe(POLICY)
    assert "replica-r1 exited (exit code 1)" in line and "restart #8 in 30.0s" in line
    assert "crash-looping" in line and "other services keep running" in line


def test_exits_spread_wider_than_the_window_are_no_crash_loop() -> None:
    sup = Supervisor(POLICY)
    sup.started("coordinator", 0.0)
    t = 0.0
    for _ in range(10):
        d, t = crash_once(sup, "coordinator", t + 61.0)  # each run stable: never a crash loop
        assert not d.crash_looping
        assert d.delay_s == 1.0  # each run was stable
    assert sup.crash_looping() == []


def test_a_crash_looping_service_that_runs_stably_has_recovered() -> None:
    sup = Supervisor(POLICY)
    sup.started("aggregator", 0.0)
    t = 0.0
    for _ in range(5):
        _, t = crash_once(sup, "aggregator", t + 0.1)
    assert sup.crash_looping() == ["aggregator"]
    assert sup.recovered(t + 59.0) == []
    assert sup.recovered(t + 60.0) == ["aggregator"]
    assert sup.recovered(t + 61.0) == []  # named once
    assert sup.crash_looping() == []
    d, _ = crash_once(sup, "aggregator", t + 70.0)
    assert d.delay_s == 1.0 and not d.crash_looping


def test_held_services_are_not_restarted_until_started_again() -> None:
    sup = Supervisor(POLICY)
    sup.started("replica-r0", 0.0)
    sup.hold("replica-r0")
    assert sup.exited("replica-r0", -9, 1.0) is None
    assert sup.due(1000.0) == []
    assert sup.snapshot(1.0)["replica-r0"]["state"] == "held"
    sup.started("replica-r0", 2.0)  # Stack.restart: by hand, not a restart by supervision
    assert sup.snapshot(2.0)["replica-r0"]["restarts"] == 0
    d = sup.exited("replica-r0", -9, 3.0)
    assert d is not None and d.restart_number == 1


def test_hold_cancels_a_pending_restart() -> None:
    sup = Supervisor(POLICY)
    sup.started("replica-r0", 0.0)
    d = sup.exited("replica-r0", -9, 1.0)
    assert d is not None
    sup.hold("replica-r0")
    assert sup.due(d.at_s + 10) == []


def test_an_exit_is_decided_once_and_unknown_services_are_ignored() -> None:
    sup = Supervisor(POLICY)
    sup.started("gateway", 0.0)
    assert sup.exited("gateway", 0, 1.0) is not None
    assert sup.exited("gateway", 0, 1.1) is None  # already waiting for its restart
    assert sup.exited("nobody", 1, 1.0) is None
    snap = sup.snapshot(1.5)["gateway"]
    assert snap["restart_in_s"] == 0.5 and snap["state"] == "waiting" and snap["restarts"] == 0
    sup.started("gateway", 2.0)
    assert sup.snapshot(2.0)["gateway"]["restarts"] == 1


def test_services_are_independent() -> None:
    sup = Supervisor(POLICY)
    for name in ("replica-r0", "replica-r1"):
        sup.started(name, 0.0)
    t = 0.0
    for _ in range(5):
        _, t = crash_once(sup, "replica-r0", t + 0.1)
    assert sup.crash_looping() == ["replica-r0"]
    assert sup.is_running("replica-r1")
    d = sup.exited("replica-r1", -15, t)
    assert d is not None and d.delay_s == 1.0 and not d.crash_looping


def test_describe_exit() -> None:
    assert describe_exit(0) == "exit code 0"
    assert describe_exit(3) == "exit code 3"
    assert describe_exit(-signal.SIGKILL) == "killed by SIGKILL"
    assert describe_exit(-signal.SIGTERM) == "killed by SIGTERM"
    assert describe_exit(-200) == "killed by signal 200"


def test_bad_policies_are_refused() -> None:
    with pytest.raises(ValueError):
        SupervisionPolicy(first_backoff_s=10, max_backoff_s=1)
    with pytest.raises(ValueError):
        SupervisionPolicy(backoff_factor=0.5)
    with pytest.raises(ValueError):
        SupervisionPolicy(crash_loop_exits=0)


def test_quick_exits_further_apart_than_the_window_are_no_crash_loop() -> None:
    policy = SupervisionPolicy(crash_loop_exits=3, crash_loop_window_s=10.0)
    sup = Supervisor(policy)
    sup.started("replica-r0", 0.0)
    t = 0.0
    for _ in range(6):
        d, t = crash_once(sup, "replica-r0", t + 5.0)  # at most 2 exits within any 10 s
        assert not d.crash_looping and d.exits_in_window <= 2
