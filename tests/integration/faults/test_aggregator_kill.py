"""Fault 4: the aggregator process is SIGKILLed mid-round, twice (collecting, then evaluating).

After each restart the round resumes from its durable record and the updates kept by JetStream
(COLLM_UPDATES); it publishes exactly once or aborts cleanly, and every version in the store is complete
with a verifying digest. Scenario and checks: round_faults.aggregator_kill. (Graceful stops of an in-process
aggregator: tests/integration/aggregator/test_rounds.py, test_restart_resumes_the_round_from_durable_updates
and test_restart_while_evaluating_resumes_and_publishes_once.)
"""

from __future__ import annotations

import pytest

from .harness import FaultStack
from .scenarios import aggregator_kill

pytestmark = pytest.mark.integration


async def test_aggregator_sigkill_mid_round(fault_stack: FaultStack) -> None:
    report = await aggregator_kill(fault_stack)
    report.print()
    assert not report.failed_checks, (report.failed_checks, report.details, fault_stack.log_tail())
