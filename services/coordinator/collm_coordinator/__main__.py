"""`python -m collm_coordinator`: the coordinator service."""

from __future__ import annotations

import logging

from collm_common.bus import Bus
from collm_common.service import ServiceContext, run_service
from collm_common.store import AdapterStore
from collm_common.subjects import SERVICE_COORDINATOR
from collm_coordinator.service import Coordinator
from collm_coordinator.settings import CoordinatorSettings

log = logging.getLogger(__name__)


async def serve(ctx: ServiceContext[CoordinatorSettings]) -> None:
    s = ctx.settings
    bus = await ctx.stack.enter_async_context(await Bus.connect(s, ctx.name))
    store: AdapterStore | None = None
    if s.coordinator_use_store:
        # Optional: without Redis the coordinator plans from the versions replicas report.
        store = AdapterStore.connect(s)
        ctx.stack.push_async_callback(store.close)
    coord = Coordinator(s, bus, ctx.clock, store)
    await coord.start()
    ctx.stack.push_async_callback(coord.stop)
    ctx.started()
    await ctx.stopping.wait()


def main() -> None:
    run_service(SERVICE_COORDINATOR, CoordinatorSettings, serve)


if __name__ == "__main__":
    main()
