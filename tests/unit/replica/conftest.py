"""Fixtures of the replica engine tests: the tiny model, loaded once per session (seconds)."""

from __future__ import annotations

import pytest
import torch

from collm_replica.models import LoadedModel, load_model

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny() -> LoadedModel:
    return load_model("tiny", device="cpu", tiny_seed=0)
