"""A NATS cluster node SIGKILLed under load: the stack on a three-node JetStream cluster (R3 streams,
every service given all three URLs) loses the node that holds the gateway's connection.

No request is lost; one fails (with a clear error) only if its tokens were in flight through the lost
node (it was in flight at the kill or sent before the clients had reconnected); no sample upload is
refused and no accepted sample is lost (each is in the stream under its id and in its replica's local
data); a federated round publishes while the node is down; the node rejoins with every stream current
on three peers. Scenario and checks: cluster_faults.nats_node_loss.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .cluster_faults import ADMIN_KEY, nats_node_loss
from .harness import FaultStack, running

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cluster_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultStack]:
    gateway = {"COLLM_ADMIN_KEY": ADMIN_KEY}
    with running(
        FaultStack(tmp_path_factory.mktemp("cluster"), nats_nodes=3, service_env={"gateway": gateway})
    ) as fs:
        yield fs


async def test_nats_node_loss(cluster_stack: FaultStack) -> None:
    report = await nats_node_loss(cluster_stack)
    report.print()
    assert not report.failed_checks, (report.failed_checks, report.details, cluster_stack.log_tail())
