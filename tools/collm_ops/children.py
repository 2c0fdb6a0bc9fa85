"""The processes a launcher starts (`collm_ops.launcher`): each service as `python -m <module>` in its own
process group, its output prefixed into the launcher's log (or written to `<log_dir>/<name>.log`), and
the signals that end it, one child or all of them in order."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

COLORS = {"aggregator": 35, "coordinator": 36, "replica": 32, "gateway": 33, "launcher": 37}
# The order `Children.stop_all` stops services in (by the name's first part; anything else last).
STOP_ORDER = {"gateway": 0, "replica": 1, "coordinator": 2, "aggregator": 3}


class PrefixedLog:
    """One sink for the launcher's lines and its children's: each line prefixed by who wrote it
    (coloured by service on a terminal), whole lines only, from any thread."""

    def __init__(self, sink: IO[str]) -> None:
        self.sink = sink
        self._lock = threading.Lock()

    def log(self, name: str, line: str) -> None:
        color = COLORS.get(name.split("-")[0], 37)
        tty = getattr(self.sink, "isatty", lambda: False)()
        label = f"\x1b[{color}m{name:>12}\x1b[0m" if tty else f"{name:>12}"
        with self._lock:
            self.sink.write(f"{label} | {line.rstrip()}\n")
            self.sink.flush()

    def pump(self, name: str, stream: IO[bytes]) -> None:
        """Log every line of `stream` as child `name`'s until it ends."""
        for raw in iter(stream.readline, b""):
            self.log(name, raw.decode(errors="replace"))


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    pump: threading.Thread | None = None
    # How it was started (`python -m <module>` with `env`): what `Stack.restart` starts again.
    module: str = ""
    env: dict[str, str] = field(default_factory=dict)


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)


def _wait_or_kill(proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    """Wait for `proc` to exit; SIGKILL its group after `timeout_s`."""
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        _signal_group(proc, signal.SIGKILL)
        proc.wait()


class Children:
    """The children, in start order (`items`). `lock` (reentrant) guards the list; supervision holds it
    while it looks at them and starts them again."""

    def __init__(self, log: PrefixedLog, log_dir: Path | None) -> None:
        self.log = log
        self.log_dir = log_dir
        self.items: list[Child] = []
        self.lock = threading.RLock()

    def spawn(self, name: str, module: str, env: dict[str, str], replace: Child | None = None) -> Child:
        """Start `python -m module` as child `name`; it takes `replace`'s place in `items` if given."""
        out: IO[bytes] | int = subprocess.PIPE
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            out = (self.log_dir / f"{name}.log").open("ab")
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", module],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        finally:
            if not isinstance(out, int):
                out.close()  # the child holds its own descriptor
        child = Child(name, proc, module=module, env=env)
        if proc.stdout is not None:
            child.pump = threading.Thread(target=self.log.pump, args=(name, proc.stdout), daemon=True)
            child.pump.start()
        with self.lock:
            if replace is not None and replace in self.items:
                self.items[self.items.index(replace)] = child
            else:
                self.items.append(child)
        return child

    def get(self, name: str) -> Child:
        with self.lock:
            for c in self.items:
                if c.name == name:
                    return c
        raise KeyError(name)

    def pids(self) -> dict[str, int]:
        """Child name -> pid of every child still running."""
        with self.lock:
            return {c.name: c.proc.pid for c in self.items if c.proc.poll() is None}

    def check_running(self) -> None:
        """A RuntimeError naming the first child that has exited (while the stack starts)."""
        for c in self.items:
            if c.proc.poll() is not None:
                raise RuntimeError(f"{c.name} exited with code {c.proc.returncode} during start")

    def end(self, child: Child, sig: int, timeout_s: float) -> None:
        """Send `sig` to `child`'s process group unless it has exited, wait until it has (SIGKILL after
        `timeout_s`), and let its output pump finish."""
        if child.proc.poll() is None:
            _signal_group(child.proc, sig)
            _wait_or_kill(child.proc, timeout_s)
        if child.pump is not None:
            child.pump.join(timeout=2)

    def stop_all(self, timeout_s: float) -> None:
        """SIGTERM every child (gateway, replicas, coordinator, aggregator: `STOP_ORDER`), wait for all
        within `timeout_s` together (SIGKILL past it), and forget them."""
        children = sorted(self.items, key=lambda c: STOP_ORDER.get(c.name.split("-")[0], 9))
        for c in children:
            if c.proc.poll() is None:
                _signal_group(c.proc, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for c in children:
            _wait_or_kill(c.proc, max(0.1, deadline - time.monotonic()))
        for c in children:
            if c.pump is not None:
                c.pump.join(timeout=2)
        self.items.clear()
