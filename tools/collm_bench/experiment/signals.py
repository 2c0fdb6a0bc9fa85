"""SIGINT and SIGTERM as an interruption the benchmark harness always unwinds, stopping its stacks.

The launcher starts each service in its own session (a signal to the harness's process group does not
reach them) and stops them in `Stack.stop`. Python's default SIGTERM ends the process without running
any `finally`, leaving the services running. Within `interrupt_on_sigterm`, SIGINT and SIGTERM raise
`KeyboardInterrupt` instead. An exception raised by a signal handler lands wherever the interpreter is:
inside a weakref callback or a `__del__` it is printed and dropped. So the interruption stays pending
and is raised again every `REPEAT_S` (SIGALRM) until the harness reaches `signals_deferred`, which
takes it over: it holds both signals off while its block (a stack's stop) runs and raises the
interruption once the block is done. `stopping(stack)` stops a stack on leaving, however it is left.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any, Protocol

REPEAT_S = 0.2
_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_pending: list[str] = []  # the name of the signal whose interruption is not yet taken over


class Stoppable(Protocol):
    def stop(self) -> None: ...


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _repeat(on: bool) -> None:
    signal.setitimer(signal.ITIMER_REAL, REPEAT_S if on else 0.0, REPEAT_S if on else 0.0)


def _raise_pending(_signum: int, _frame: FrameType | None) -> None:
    if _pending:
        raise KeyboardInterrupt(f"signal {_pending[0]}")


def _interrupt(signum: int, _frame: FrameType | None) -> None:
    if not _pending:
        _pending.append(signal.Signals(signum).name)
        _repeat(True)
    raise KeyboardInterrupt(f"signal {_pending[0]}")


@contextmanager
def interrupt_on_sigterm() -> Iterator[None]:
    """Within (main thread; elsewhere nothing changes): SIGINT and SIGTERM raise KeyboardInterrupt, again
    every `REPEAT_S` until `signals_deferred` takes the interruption over."""
    if not _main_thread():
        yield
        return
    before: dict[int, Any] = {s: signal.signal(s, _interrupt) for s in _SIGNALS}
    before[signal.SIGALRM] = signal.signal(signal.SIGALRM, _raise_pending)
    try:
        yield
    finally:
        _repeat(False)
        _pending.clear()
        for s, h in before.items():
            signal.signal(s, h)


@contextmanager
def signals_deferred() -> Iterator[None]:
    """Within: SIGINT and SIGTERM are noted, not acted on, and a pending interruption is not raised again;
    on leaving, KeyboardInterrupt if either came or one was pending (main thread)."""
    if not _main_thread():
        yield
        return
    _repeat(False)
    came: list[str] = []
    before: dict[int, Any] = {
        s: signal.signal(s, lambda n, _f: came.append(signal.Signals(n).name)) for s in _SIGNALS
    }
    try:
        yield
    finally:
        for s, h in before.items():
            signal.signal(s, h)
    why = [*_pending, *came]
    _pending.clear()
    if why:
        raise KeyboardInterrupt(f"signal {why[0]}")


@contextmanager
def stopping(stack: Stoppable) -> Iterator[None]:
    """`stack.stop()` on leaving, however the block is left, with the signals held off while it stops
    (`signals_deferred`); stopping twice is harmless (`Stack.stop`)."""
    try:
        yield
    finally:
        with signals_deferred():
            stack.stop()
