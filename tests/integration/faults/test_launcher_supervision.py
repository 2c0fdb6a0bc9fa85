"""The launcher's supervision shell on real processes (small Python programs, no servers): a child
killed by a signal is started again, a child that keeps failing is reported as crash-looping while the
others keep running, `Stack.kill` holds what it kills until `Stack.restart`, and `stop` restarts
nothing. The decisions themselves are unit-tested in tests/unit/ops/test_supervise.py."""

from __future__ import annotations

import io
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from collm_ops.launcher import Stack, StackConfig
from collm_ops.supervise import SupervisionPolicy

pytestmark = pytest.mark.integration

FAST = SupervisionPolicy(
    first_backoff_s=0.05, max_backoff_s=0.4, stable_s=5.0, crash_loop_exits=4, crash_loop_window_s=30.0
)


def until(check: Callable[[], object], timeout_s: float = 15.0, what: str = "condition") -> None:
    end = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[tuple[Stack, io.StringIO]]:
    (tmp_path / "sleeper.py").write_text("import time\ntime.sleep(600)\n")
    (tmp_path / "crasher.py").write_text("import sys\nsys.exit(3)\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    log = io.StringIO()
    s = Stack(StackConfig(replicas=[], run_dir=tmp_path / "run", log_dir=tmp_path / "logs"), log_sink=log)
    s._spawn("sleeper", "sleeper", env)
    s._spawn("other", "sleeper", env)
    try:
        yield s, log
    finally:
        s.stop(timeout_s=5)


def status(s: Stack) -> dict:
    return json.loads(s.supervision_path.read_text())


def test_a_killed_child_is_restarted_and_the_log_says_so(stack: tuple[Stack, io.StringIO]) -> None:
    s, log = stack
    s.supervise(FAST)
    first = s.pids()["sleeper"]
    other = s.pids()["other"]
    os.kill(first, signal.SIGKILL)  # a crash, not a deliberate stop through the launcher
    until(lambda: status(s)["services"]["sleeper"]["restarts"] == 1, what="sleeper restarted")
    text = log.getvalue()
    assert "sleeper exited (killed by SIGKILL)" in text and "restart #1 in 0.1s" in text, text
    assert f"restarted sleeper (restart #1, pid {s.pids()['sleeper']})" in text
    assert s.pids()["other"] == other  # the rest untouched
    st = status(s)
    assert st["supervising"] and st["services"]["sleeper"]["restarts"] == 1
    assert st["services"]["sleeper"]["last_exit"] == "killed by SIGKILL"
    assert st["services"]["sleeper"]["pid"] == s.pids()["sleeper"]


def test_a_crash_loop_is_reported_and_the_others_keep_running(stack: tuple[Stack, io.StringIO]) -> None:
    s, log = stack
    s._spawn("crasher", "crasher", s.child("sleeper").env)
    other = s.pids()["other"]
    s.supervise(FAST)
    until(lambda: "CRASH LOOP" in log.getvalue(), what="the crash loop report")
    lines = [ln for ln in log.getvalue().splitlines() if "CRASH LOOP" in ln]
    assert len(lines) == 1 and "crasher" in lines[0] and "exit code 3" in lines[0], lines
    until(lambda: status(s)["crash_looping"] == ["crasher"], what="crasher listed as crash-looping")
    # Still retried at the longest backoff, not given up.
    restarts = status(s)["services"]["crasher"]["restarts"]
    until(lambda: status(s)["services"]["crasher"]["restarts"] >= restarts + 2, what="more retries")
    assert s.pids()["other"] == other and s.pids()["sleeper"]
    assert len([ln for ln in log.getvalue().splitlines() if "CRASH LOOP" in ln]) == 1


def test_kill_holds_the_child_until_restart(stack: tuple[Stack, io.StringIO]) -> None:
    s, log = stack
    s.supervise(FAST)
    assert s.kill("sleeper") == -signal.SIGKILL
    time.sleep(1.0)  # several polls and backoffs: still down
    assert "sleeper" not in s.pids()
    assert status(s)["services"]["sleeper"]["state"] == "held"
    s.restart("sleeper")
    assert "sleeper" in s.pids()
    # Supervised again from there: a crash now is restarted.
    pid = s.pids()["sleeper"]
    os.kill(pid, signal.SIGKILL)
    until(lambda: s.pids().get("sleeper") not in (None, pid), what="sleeper restarted after the crash")
    # kill(hold=False): left to supervision, like a crash.
    pid = s.pids()["sleeper"]
    s.kill("sleeper", hold=False)
    until(lambda: s.pids().get("sleeper") not in (None, pid), what="sleeper restarted after kill(hold=False)")


def test_stop_restarts_nothing(stack: tuple[Stack, io.StringIO]) -> None:
    s, log = stack
    s.supervise(FAST)
    pids = s.pids()
    s.stop(timeout_s=5)
    time.sleep(0.5)
    assert s.pids() == {}
    assert "restarted sleeper" not in log.getvalue() and "restarted other" not in log.getvalue()
    for pid in pids.values():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert status(s)["supervising"] is False


def test_unsupervised_stack_leaves_exited_children_down(stack: tuple[Stack, io.StringIO]) -> None:
    s, log = stack
    pid = s.pids()["sleeper"]
    os.kill(pid, signal.SIGKILL)
    until(lambda: "sleeper" not in s.pids(), what="sleeper to exit")
    time.sleep(0.6)
    assert "sleeper" not in s.pids() and "restarted sleeper" not in log.getvalue()


def test_the_nats_and_redis_it_started_are_supervised_and_keep_their_data(tmp_path: Path) -> None:
    """SIGKILL the redis-server and the nats-server the launcher started: each is started again on its
    port and data directory (Redis's append-only file keeps a key written before), logged and listed."""
    import redis

    from collm_ops.servers import free_port, port_open

    log = io.StringIO()
    nats_port, redis_port = free_port(), free_port()
    s = Stack(
        StackConfig(
            replicas=[],
            run_dir=tmp_path / "run",
            log_dir=tmp_path / "logs",
            nats_url=f"nats://127.0.0.1:{nats_port}",
            redis_url=f"redis://127.0.0.1:{redis_port}/0",
        ),
        log_sink=log,
    )
    try:
        s._ensure_servers()
        assert {srv.name for srv in s.servers} == {"nats", "redis"}
        url, password = s.redis_login  # the operator's: the Redis it starts is closed (local_store)

        def operator() -> redis.Redis:
            return redis.Redis.from_url(url, password=password)

        client = operator()
        client.set("kept", "1")
        client.execute_command("CONFIG", "SET", "appendfsync", "always")
        client.set("kept", "2")  # written through to the append-only file
        s.supervise(FAST)
        for name, port in (("redis", redis_port), ("nats", nats_port)):
            server = next(srv for srv in s.servers if srv.name == name)
            os.kill(server.proc.pid, signal.SIGKILL)
            until(lambda name=name: status(s)["services"][name]["restarts"] == 1, what=f"{name} restarted")
            until(lambda port=port: port_open("127.0.0.1", port), what=f"{name} listening again")
            assert f"{name} exited (killed by SIGKILL)" in log.getvalue()
            assert status(s)["services"][name]["pid"] == server.proc.pid
        assert operator().get("kept") == b"2"
    finally:
        s.stop(timeout_s=5)
