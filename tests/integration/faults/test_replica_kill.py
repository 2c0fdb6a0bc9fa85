"""Fault 1: a replica is SIGKILLed under load (two replicas, concurrent streamed and plain requests).

Requests it had not accepted are retried on the other replica; requests it was generating end with a
clear error (an SSE error event then [DONE], or a 503 envelope); nothing hangs, nothing is lost; the
restarted replica serves again. Scenario and checks: serving_faults.replica_kill.
"""

from __future__ import annotations

import pytest

from .harness import FaultStack
from .scenarios import replica_kill

pytestmark = pytest.mark.integration


async def test_replica_sigkill_under_load(fault_stack: FaultStack) -> None:
    report = await replica_kill(fault_stack, concurrency=8, duration_s=5.0, kill_at_s=2.0, max_tokens=256)
    report.print()
    assert report.sent > 0 and report.lost == 0, report.details
    assert not report.failed_checks, (report.failed_checks, report.details, fault_stack.log_tail())
