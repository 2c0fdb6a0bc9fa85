"""Fault 7: with supervision on (as `collm up` runs), a replica SIGKILLed under load is restarted by the
launcher while the other replica serves; requests it had accepted without a token yet are moved to the
other replica; nothing is lost. Scenario and checks: supervision.replica_supervised."""

from __future__ import annotations

import pytest

from .harness import FaultStack
from .supervision import replica_supervised

pytestmark = pytest.mark.integration


async def test_supervision_restarts_a_killed_replica_while_the_other_serves(fault_stack: FaultStack) -> None:
    report = await replica_supervised(fault_stack, concurrency=8, max_tokens=64, catch_window_s=5.0)
    report.print()
    assert report.sent > 0 and report.lost == 0, report.details
    assert not report.failed_checks, (report.failed_checks, report.details, fault_stack.log_tail())
    assert report.details["supervision_restarts"] == 1
    assert fault_stack.s.supervisor is None  # the shared stack is left unsupervised, as it was
