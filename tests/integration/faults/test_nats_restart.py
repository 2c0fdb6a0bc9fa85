"""Fault 2: the NATS server restarts (same port, same JetStream store).

While it is down the gateway answers 503 with Retry-After at once; once it is back every service
(gateway completions, every NATS endpoint, both JetStream consumers) serves again within 5 s.
Scenario and checks: serving_faults.nats_restart.
"""

from __future__ import annotations

import pytest

from .harness import FaultStack
from .scenarios import nats_restart

pytestmark = pytest.mark.integration


async def test_nats_restart(fault_stack: FaultStack) -> None:
    report = await nats_restart(fault_stack, down_s=2.0)
    report.print()
    assert not report.failed_checks, (report.failed_checks, report.details, fault_stack.log_tail())
