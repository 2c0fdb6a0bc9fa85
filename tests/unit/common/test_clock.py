import asyncio

import pytest

from collm_common.clock import VirtualClock, WallClock

pytestmark = pytest.mark.unit


async def test_virtual_clock_wakes_sleepers_in_order() -> None:
    clock = VirtualClock(start_s=100.0)
    woke: list[tuple[str, float]] = []

    async def sleeper(name: str, s: float) -> None:
        await clock.sleep(s)
        woke.append((name, clock.monotonic()))

    tasks = [asyncio.create_task(sleeper("b", 2.0)), asyncio.create_task(sleeper("a", 1.0))]
    await asyncio.sleep(0)
    clock.advance(0.5)
    await asyncio.sleep(0)
    assert woke == []
    await clock.run_for(2.0, step_s=0.5)
    await asyncio.gather(*tasks)
    assert [w[0] for w in woke] == ["a", "b"]
    assert clock.now() == pytest.approx(102.5)


async def test_wall_clock_is_monotonic() -> None:
    c = WallClock()
    a = c.monotonic()
    await c.sleep(0.001)
    assert c.monotonic() > a
