"""Fault 3: Redis restarts (append-only persistence, as the shipped config) between a round's
evaluation and its publication, while requests use a resident adapter.

The resident adapter keeps serving, the publication is retried and lands after, the replicas swap the
new version in, and every version's blob verifies afterwards. Scenario and checks:
round_faults.redis_restart. (Redis down for the gateway alone: tests/integration/gateway/test_failures.py.)
"""

from __future__ import annotations

import pytest

from .harness import FaultStack
from .scenarios import redis_restart

pytestmark = pytest.mark.integration


async def test_redis_restart_during_a_publication(fault_stack: FaultStack) -> None:
    report = await redis_restart(fault_stack, down_s=2.0)
    report.print()
    assert not report.failed_checks, (report.failed_checks, report.details, fault_stack.log_tail())
