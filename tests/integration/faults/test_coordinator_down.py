"""Fault 5: the coordinator is down (SIGKILL).

The gateway routes on its last weights, in full for `weights_hold_frac` of their TTL, then decaying to
even routing at the TTL; replicas keep the coordinator's fine-tuning share until its TTL, then fall back
to their local default; every request succeeds meanwhile; after a restart the coordinator is in control
again. Scenario and checks: serving_faults.coordinator_down. (The decay rule itself:
tests/unit/gateway; the coordinator's own loop without an aggregator: tests/integration/coordinator.)
"""

from __future__ import annotations

import pytest

from .harness import FaultStack
from .scenarios import coordinator_down

pytestmark = pytest.mark.integration


async def test_coordinator_down(fault_stack: FaultStack) -> None:
    report = await coordinator_down(fault_stack)
    report.print()
    assert not report.failed_checks, (report.failed_checks, report.details, fault_stack.log_tail())
