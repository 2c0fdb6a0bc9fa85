"""Fault 6: a straggling or silent participant never holds a round past its deadline.

Covered with an in-process aggregator and participant doubles by
tests/integration/aggregator/test_rounds.py::test_silent_participant_never_blocks_past_the_deadline
(a quorum closes at the deadline and publishes; no quorum aborts). Here the same with the real stack
(replica and aggregator processes) and one silent double, measuring how long after the deadline each
round ended. Scenario and checks: round_faults.straggler.
"""

from __future__ import annotations

import pytest

from .harness import FaultStack
from .scenarios import straggler

pytestmark = pytest.mark.integration


async def test_silent_participant_with_real_replicas(fault_stack: FaultStack) -> None:
    # The real replicas train their 64 tokens beside a background load before the deadline: 12 s leaves
    # room for a CPU shared with other work.
    report = await straggler(fault_stack, deadline_s=12.0)
    report.print()
    assert not report.failed_checks, (report.failed_checks, report.details, fault_stack.log_tail())
