"""Smoke: the default SmolLM2 model answers a greedy chat completion through the engine (slow to load)."""

from __future__ import annotations

import pytest
import torch

from collm_replica.engine import Engine, EngineConfig, EngineRequest
from collm_replica.models import ModelLoadError, load_model
from collm_replica.settings import ReplicaSettings
from tests.unit.replica.helpers import submit_all

pytestmark = pytest.mark.smoke


def test_smollm2_knows_the_capital_of_france() -> None:
    torch.set_num_threads(1)
    settings = ReplicaSettings()
    try:
        loaded = load_model("smollm2", device="cpu", cache_dir=settings.model_cache_dir)
    except ModelLoadError as exc:
        pytest.skip(str(exc))
    tok = loaded.tokenizer
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    ids = tok.encode(text, add_special_tokens=False)
    with Engine(loaded, EngineConfig()) as eng:
        res = submit_all(eng, [EngineRequest("paris", ids, max_tokens=24, temperature=0.0)], timeout_s=120)
    answer = res["paris"].text
    assert "Paris" in answer, answer
