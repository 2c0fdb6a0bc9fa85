"""`collm_common.service`: a service process freezes its start-up heap once `serve` says it started;
code that runs `serve` in its own process (tests) keeps its heap as it is."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

PROGRAM = textwrap.dedent(
    """
    import asyncio, gc, sys
    from collm_common.service import serve_until_stopped
    from collm_common.settings import CommonSettings

    counts = []

    async def serve(ctx):
        counts.append(gc.get_freeze_count())
        ctx.started()
        counts.append(gc.get_freeze_count())
        ctx.stopping.set()
        await ctx.stopping.wait()

    asyncio.run(serve_until_stopped("svc", CommonSettings(), serve, freeze_heap=sys.argv[1] == "1"))
    print(*counts)
    """
)


@pytest.mark.parametrize("freeze", [True, False])
def test_started_freezes_the_heap_only_in_a_service_process(freeze: bool) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", PROGRAM, "1" if freeze else "0"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    before, after = map(int, proc.stdout.split())
    assert before == 0
    # Frozen: every object alive at start (imported modules at least: tens of thousands) is out of the
    # collector's walks; not frozen: none.
    assert (after > 10_000) if freeze else (after == 0)
