"""`python -m collm_aggregator`: the aggregator service."""

from __future__ import annotations

from collm_aggregator.service import Aggregator
from collm_aggregator.settings import AggregatorSettings
from collm_common.bus import Bus
from collm_common.service import ServiceContext, run_service
from collm_common.store import AdapterStore
from collm_common.subjects import SERVICE_AGGREGATOR


async def serve(ctx: ServiceContext[AggregatorSettings]) -> None:
    s = ctx.settings
    bus = await ctx.stack.enter_async_context(await Bus.connect(s, ctx.name))
    store = AdapterStore.connect(s, s.retention_versions)
    ctx.stack.push_async_callback(store.close)
    await store.ping()
    agg = Aggregator(s, bus, store, ctx.clock, ctx.instance_id)
    await agg.start()
    ctx.stack.push_async_callback(agg.stop)
    ctx.started()
    await ctx.stopping.wait()


def main() -> None:
    run_service(SERVICE_AGGREGATOR, AggregatorSettings, serve)


if __name__ == "__main__":
    main()
