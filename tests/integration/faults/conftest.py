"""One live stack for every fault test (starting one costs seconds; each scenario leaves it healthy)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .harness import FaultStack, running


@pytest.fixture(scope="session")
def fault_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultStack]:
    with running(FaultStack(tmp_path_factory.mktemp("faults"))) as fs:
        yield fs
