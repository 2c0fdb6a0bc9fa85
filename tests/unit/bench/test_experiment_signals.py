"""SIGINT and SIGTERM in the benchmark harness: an interruption that always unwinds, stacks stopped
(collm_bench.experiment.signals)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from collm_bench.experiment.signals import REPEAT_S, interrupt_on_sigterm, signals_deferred, stopping

pytestmark = pytest.mark.unit


def test_sigterm_interrupts_until_the_interruption_is_taken_over() -> None:
    # The handlers it had (a process started in the background by a shell without job control ignores
    # SIGINT from its start: SIG_IGN, not Python's default handler).
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with interrupt_on_sigterm():
        with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)
        # Dropped where it landed (as in a weakref callback), it comes again.
        with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
            time.sleep(1)
        # Taken over: the block runs to its end, then the interruption goes on, once.
        done: list[str] = []
        with pytest.raises(KeyboardInterrupt, match="SIGTERM"), signals_deferred():
            time.sleep(2 * REPEAT_S)
            os.kill(os.getpid(), signal.SIGINT)  # held off too
            time.sleep(0.05)
            done.append("the block ran to its end")
        assert done == ["the block ran to its end"]
        time.sleep(2 * REPEAT_S)  # nothing pending any more
    assert {s: signal.getsignal(s) for s in before} == before  # restored


def test_stopping_stops_however_the_block_is_left() -> None:
    class StackDouble:
        stops = 0

        def stop(self) -> None:
            self.stops += 1

    stack = StackDouble()
    with pytest.raises(KeyboardInterrupt), interrupt_on_sigterm(), stopping(stack):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1)
    assert stack.stops == 1
    with stopping(stack):
        pass
    assert stack.stops == 2
