"""Supervision of a launched stack (`collm_ops.launcher` docstring): a thread that polls the children and
the servers the launcher started every `SUPERVISE_POLL_S`, reports their exits, starts them again when
`collm_ops.supervise.Supervisor` says so, and keeps `<run_dir>/supervision.json` current."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from collm_common.clock import Clock
from collm_ops.children import Child, Children
from collm_ops.servers import ServerProcess
from collm_ops.supervise import SupervisionPolicy, Supervisor, describe_exit

# How often supervision looks at its children (the delay between a child's exit and its report).
SUPERVISE_POLL_S = 0.2
SUPERVISION_FILE = "supervision.json"


class StackSupervision:
    """Supervision of `children` and of the servers in `servers` (the list the launcher keeps of those it
    started), on/off (`start`, `stop`); `supervisor` is None while off. `log(line)` is the launcher's
    log."""

    def __init__(
        self,
        children: Children,
        servers: list[ServerProcess],
        clock: Clock,
        run_dir: Path,
        log: Callable[[str], None],
    ) -> None:
        self.children = children
        self.servers = servers
        self.clock = clock
        self.path = run_dir / SUPERVISION_FILE
        self.log = log
        self.supervisor: Supervisor | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, policy: SupervisionPolicy) -> Supervisor:
        """Start supervising every child and server under `policy`; idempotent."""
        if self.supervisor is not None:
            return self.supervisor
        sup = Supervisor(policy)
        now_s = self.clock.monotonic()
        with self.children.lock:
            for c in self._supervised():
                sup.started(c.name, now_s)
            self.supervisor = sup
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="collm-supervise", daemon=True)
        self._thread.start()
        self.write()
        p = sup.policy
        self.log(
            f"supervising {len(self._supervised())} processes: an exit is restarted after "
            f"{p.first_backoff_s:g}s doubling to {p.max_backoff_s:g}s; {p.crash_loop_exits} exits within "
            f"{p.crash_loop_window_s:g}s is a crash loop (status: {self.path})",
        )
        return sup

    def stop(self) -> None:
        """Stop supervising (children that exit from now on stay down)."""
        thread = self._thread
        self._stop.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=30)
        self._thread = None
        with self.children.lock:
            was = self.supervisor is not None
            self.supervisor = None
        if was:
            self.write(final=True)

    def _loop(self) -> None:
        while not self._stop.wait(SUPERVISE_POLL_S):
            try:
                self.step()
            except Exception as exc:  # never let one bad step end supervision
                self.log(f"supervision step failed: {type(exc).__name__}: {exc}")

    def step(self) -> None:
        """One look at the children: report exits, start those whose backoff has passed."""
        changed = False
        with self.children.lock:
            sup = self.supervisor
            if sup is None or self._stop.is_set():
                return
            now_s = self.clock.monotonic()
            changed = self._report_exits(sup, now_s)
            for name in sup.recovered(now_s):
                changed = True
                self.log(f"{name} has run {sup.policy.stable_s:g}s: no longer crash-looping")
            for name in sup.due(now_s):
                changed = True
                self._start_again(sup, name, now_s)
        if changed:
            self.write()

    def _report_exits(self, sup: Supervisor, now_s: float) -> bool:
        """Tell `sup` of every supervised process that has exited since it last ran, and log its
        decision; whether there was one."""
        changed = False
        for c in self._supervised():
            code = c.proc.poll()
            if code is None or not sup.is_running(c.name):
                continue
            decision = sup.exited(c.name, code, now_s)
            if decision is None:
                continue
            changed = True
            self.log(decision.describe(sup.policy))
            if decision.crash_loop_began:
                self.log(
                    f"CRASH LOOP: {c.name} exited {decision.exits_in_window} times within "
                    f"{sup.policy.crash_loop_window_s:g}s, last {describe_exit(code)}; it is retried "
                    f"every {sup.policy.max_backoff_s:g}s, the other services keep running",
                )
        return changed

    def _start_again(self, sup: Supervisor, name: str, now_s: float) -> None:
        """Start child or server `name` again as it was started, and tell `sup`."""
        try:
            server = next((s for s in self.servers if s.name == name), None)
            if server is not None:
                server.respawn()
                pid = server.proc.pid
            else:
                old = self.children.get(name)
                pid = self.children.spawn(name, old.module, old.env, replace=old).proc.pid
        except OSError as exc:
            # Counted as a run that ended at once: the next look sees the old exit and backs off.
            sup.started(name, now_s)
            self.log(f"cannot start {name} again: {exc}")
            return
        sup.started(name, self.clock.monotonic())
        self.log(f"restarted {name} (restart #{sup.restarts(name)}, pid {pid})")

    def _supervised(self) -> list[Child | ServerProcess]:
        """The service children and the NATS and Redis servers this launcher started (a server it found
        running is not its to restart)."""
        return [*self.children.items, *self.servers]

    def hold(self, name: str) -> None:
        """Leave `name` down, if supervising, until `started(name)`."""
        if self.supervisor is not None:
            self.supervisor.hold(name)

    def started(self, name: str) -> None:
        """`name` was started again by hand: supervised again from now, if supervising."""
        if self.supervisor is not None:
            self.supervisor.started(name, self.clock.monotonic())

    def status(self) -> dict[str, Any]:
        """What `<run_dir>/supervision.json` holds: each service's supervision state and pid."""
        with self.children.lock:
            sup = self.supervisor
            services = sup.snapshot(self.clock.monotonic()) if sup is not None else {}
            for c in self._supervised():
                entry = services.setdefault(c.name, {})
                entry["pid"] = c.proc.pid if c.proc.poll() is None else None
            return {
                "supervising": sup is not None,
                "launcher_pid": os.getpid(),
                "updated_unix_s": round(self.clock.now(), 3),
                "crash_looping": sup.crash_looping() if sup is not None else [],
                "services": services,
            }

    def write(self, final: bool = False) -> None:
        """Rewrite `<run_dir>/supervision.json` (while supervising; `final`: once more when it ends)."""
        if self.supervisor is None and not final:
            return
        path = self.path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(self.status(), indent=1))
            tmp.replace(path)
        except OSError as exc:
            self.log(f"cannot write {path}: {exc}")
