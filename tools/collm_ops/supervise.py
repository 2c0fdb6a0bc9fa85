"""Supervision of the launcher's service processes: when to restart one that exited, and when it is
crash-looping. Pure: no processes, no clock reads (every method takes `now_s`, monotonic seconds, from
the caller's injected clock); the launcher (`collm_ops.launcher.Stack.supervise`) is the shell that
polls its children, feeds their exits in here and starts what `due` names.

Rules (`SupervisionPolicy`):

* Every exit of a supervised service is restarted, whatever its exit code (a service that returns on
  its own is not serving either). The delay before the restart is `first_backoff_s` times
  `backoff_factor` to the power of the number of quick exits since its last stable run, at most
  `max_backoff_s` (1, 2, 4, 8, 16, 30, 30, ... s by default).
* A run that lasted `stable_s` or longer was stable: the exit that ends it is restarted after
  `first_backoff_s` again, and counts as the first of a possible crash loop.
* `crash_loop_exits` exits within `crash_loop_window_s`, none after a stable run but the first, make
  the service crash-looping: reported once
  (`Restart.crash_loop_began`) and listed by `crash_looping()` and `snapshot()`. It is still restarted,
  every `max_backoff_s`: a service that fails because something it needs is missing for a while (NATS,
  Redis, memory, a port) comes back by itself once that is fixed, without an operator restarting the
  whole stack, and one more attempt every 30 s costs the others little. A crash-looping service that
  then runs for `stable_s` has recovered (`recovered()` names it once).
* A held service (`hold`: someone stops it on purpose, as the fault tests do with `Stack.kill`) is not
  restarted until it is started again (`started`).
"""

from __future__ import annotations

import signal
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal

State = Literal["running", "waiting", "held"]


@dataclass(frozen=True)
class SupervisionPolicy:
    first_backoff_s: float = 1.0
    backoff_factor: float = 2.0
    max_backoff_s: float = 30.0
    # A run at least this long resets the backoff (and ends a crash loop).
    stable_s: float = 60.0
    # This many exits within the window: the service is crash-looping.
    crash_loop_exits: int = 5
    crash_loop_window_s: float = 300.0

    def __post_init__(self) -> None:
        if self.first_backoff_s < 0 or self.max_backoff_s < self.first_backoff_s:
            raise ValueError("need 0 <= first_backoff_s <= max_backoff_s")
        if self.backoff_factor < 1.0:
            raise ValueError("backoff_factor must be >= 1")
        if self.crash_loop_exits < 1 or self.crash_loop_window_s <= 0 or self.stable_s <= 0:
            raise ValueError("crash_loop_exits >= 1, crash_loop_window_s > 0 and stable_s > 0 are required")

    def backoff_s(self, quick_exits: int) -> float:
        """Delay before the restart that follows `quick_exits` exits in a row without a stable run
        (0 for the first exit after a stable run)."""
        if quick_exits <= 0:
            return self.first_backoff_s
        # Capped before the power grows large: the delay stays at the cap from there on.
        exponent = min(quick_exits, 64)
        return min(self.max_backoff_s, self.first_backoff_s * self.backoff_factor**exponent)


def describe_exit(returncode: int) -> str:
    """A process's exit as people read it: `exit code 1`, `killed by SIGKILL` (Popen's negative codes)."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


@dataclass(frozen=True)
class Restart:
    """What to do after one exit: start `name` again in `delay_s` (at `at_s`)."""

    name: str
    returncode: int
    ran_s: float
    restart_number: int  # 1 for the first restart of this service by supervision
    delay_s: float
    at_s: float
    crash_looping: bool
    crash_loop_began: bool  # this exit made it crash-looping (report it once)
    exits_in_window: int

    def describe(self, policy: SupervisionPolicy) -> str:
        """The log line of this decision."""
        line = (
            f"{self.name} exited ({describe_exit(self.returncode)}) after {self.ran_s:.1f}s; "
            f"restart #{self.restart_number} in {self.delay_s:.1f}s"
        )
        if self.crash_looping:
            line += (
                f" (crash-looping: {self.exits_in_window} exits within {policy.crash_loop_window_s:.0f}s; "
                f"retrying every {policy.max_backoff_s:.0f}s, the other services keep running)"
            )
        return line


@dataclass
class _Service:
    state: State = "running"
    started_s: float = 0.0
    restarts: int = 0  # times started again by supervision (not by hand after a hold)
    quick_exits: int = 0  # exits in a row without a stable run: the backoff's exponent
    exits_s: deque[float] = field(default_factory=deque)
    last_returncode: int | None = None
    restart_at_s: float | None = None
    crash_looping: bool = False


class Supervisor:
    """The supervision decisions for a set of named services (module docstring)."""

    def __init__(self, policy: SupervisionPolicy | None = None) -> None:
        self.policy = policy or SupervisionPolicy()
        self._services: dict[str, _Service] = {}

    def started(self, name: str, now_s: float) -> None:
        """`name` is (again) running from `now_s` (at the stack's start, after a restart, or when a held
        service is started by hand)."""
        svc = self._services.setdefault(name, _Service())
        if svc.state == "waiting":
            svc.restarts += 1
        svc.state = "running"
        svc.started_s = now_s
        svc.restart_at_s = None

    def exited(self, name: str, returncode: int, now_s: float) -> Restart | None:
        """`name` exited with `returncode`: when to restart it, or None when it is not to be restarted
        (held, or not running as far as supervision knows)."""
        svc = self._services.get(name)
        if svc is None or svc.state != "running":
            return None
        p = self.policy
        ran_s = max(0.0, now_s - svc.started_s)
        if ran_s >= p.stable_s:
            svc.quick_exits = 0
            svc.exits_s.clear()
        svc.exits_s.append(now_s)
        while svc.exits_s and svc.exits_s[0] < now_s - p.crash_loop_window_s:
            svc.exits_s.popleft()
        began = False
        if len(svc.exits_s) >= p.crash_loop_exits and not svc.crash_looping:
            svc.crash_looping = began = True
        delay_s = p.backoff_s(svc.quick_exits)
        svc.quick_exits += 1
        svc.last_returncode = returncode
        svc.state = "waiting"
        svc.restart_at_s = now_s + delay_s
        return Restart(
            name=name,
            returncode=returncode,
            ran_s=ran_s,
            restart_number=svc.restarts + 1,
            delay_s=delay_s,
            at_s=svc.restart_at_s,
            crash_looping=svc.crash_looping,
            crash_loop_began=began,
            exits_in_window=len(svc.exits_s),
        )

    def due(self, now_s: float) -> list[str]:
        """Services whose restart delay has passed (start them, then call `started`)."""
        return sorted(
            name
            for name, svc in self._services.items()
            if svc.state == "waiting" and svc.restart_at_s is not None and svc.restart_at_s <= now_s
        )

    def hold(self, name: str) -> None:
        """Do not restart `name` when it exits (a deliberate stop), until `started` is called for it."""
        svc = self._services.setdefault(name, _Service())
        svc.state = "held"
        svc.restart_at_s = None

    def restarts(self, name: str) -> int:
        """How many times supervision has started `name` again."""
        svc = self._services.get(name)
        return svc.restarts if svc is not None else 0

    def is_running(self, name: str) -> bool:
        svc = self._services.get(name)
        return svc is not None and svc.state == "running"

    def recovered(self, now_s: float) -> list[str]:
        """Crash-looping services that have now run for `stable_s`: no longer crash-looping (each named
        once)."""
        out = []
        for name, svc in sorted(self._services.items()):
            if svc.crash_looping and svc.state == "running" and now_s - svc.started_s >= self.policy.stable_s:
                svc.crash_looping = False
                svc.quick_exits = 0
                svc.exits_s.clear()
                out.append(name)
        return out

    def crash_looping(self) -> list[str]:
        return sorted(name for name, svc in self._services.items() if svc.crash_looping)

    def snapshot(self, now_s: float) -> dict[str, dict[str, Any]]:
        """Per service: state, restarts done so far, last exit, seconds until its restart,
        crash-looping."""
        out: dict[str, dict[str, Any]] = {}
        for name, svc in sorted(self._services.items()):
            out[name] = {
                "state": svc.state,
                "restarts": svc.restarts,
                "up_s": round(now_s - svc.started_s, 3) if svc.state == "running" else None,
                "last_exit": describe_exit(svc.last_returncode) if svc.last_returncode is not None else None,
                "last_returncode": svc.last_returncode,
                "restart_in_s": (
                    round(max(0.0, svc.restart_at_s - now_s), 3) if svc.restart_at_s is not None else None
                ),
                "crash_looping": svc.crash_looping,
            }
        return out
