"""The engine profile's table (`python -m collm_bench engine profile`'s result) from a hand-written result."""

from __future__ import annotations

from typing import Any

import pytest

from collm_bench.readme.engine import profile_table
from collm_bench.readme.kinds import KINDS, kind_for

pytestmark = pytest.mark.unit

CATEGORIES = [
    {"key": "linear", "label": "base projections", "python": False},
    {"key": "lora", "label": "LoRA", "python": False},
    {"key": "attention", "label": "attention", "python": False},
    {"key": "py_forward", "label": "Python in the forward", "python": True},
    {"key": "py_emit", "label": "Python: detokenise, stream", "python": True},
]


def case(kind: str, batch: int, tokens: int, ms: float, prof_ms: dict[str, float], **extra: Any) -> dict:
    return {
        "case": kind,
        "batch": batch,
        "tokens_per_step": tokens,
        "steps": 10,
        "ms_per_step": ms,
        "tokens_per_s": tokens / (ms / 1e3),
        "phases_ms": {"forward": ms - 2.0, "rest_of_step": 1.5, "around_step": 0.5},
        "profiled": {
            "steps": 2,
            "ms_per_step": sum(prof_ms.values()),
            "ms": prof_ms,
            "op_calls": {"linear": 210.0},
            "op_calls_per_step": 2650.0,
            "op_calls_per_layer": 84.6,
            "ranges_per_step": 400.0,
            "top_ops_ms": {"aten::linear": 30.0},
        },
        **extra,
    }


DOC = {
    "benchmark": "profile",
    "machine": {"torch_threads": 1},
    "model": "SmolLM2-135M-Instruct",
    "config": {
        "changed_from_defaults": {"max_batch": 64, "prefill_chunk_tokens": 200},
        "prompt_tokens": 128,
        "adapters": 1,
        "steps": 10,
        "profile_steps": 2,
        "matmul_dtype": "float32",
    },
    "categories": CATEGORIES,
    "range_cost_us": 5.0,
    "cases": [
        case(
            "decode",
            1,
            1,
            40.0,
            {"linear": 20.0, "lora": 2.0, "attention": 3.0, "py_forward": 20.0, "py_emit": 0.0},
            context_tokens_mean=133.0,
        ),
        case(
            "decode",
            64,
            64,
            200.0,
            {"linear": 100.0, "lora": 10.0, "attention": 60.0, "py_forward": 30.0, "py_emit": 0.0},
            context_tokens_mean=151.5,
        ),
        case(
            "prefill",
            1,
            200,
            400.0,
            {"linear": 300.0, "lora": 20.0, "attention": 40.0, "py_forward": 40.0, "py_emit": 0.0},
        ),
    ],
}


def test_the_table_has_a_column_per_case_and_a_row_per_category_present() -> None:
    lines = profile_table(DOC).splitlines()
    assert lines == [
        "|  | decode, batch 1 | decode, batch 64 | prefill 200 tokens |",
        "|---|---|---|---|",
        "| ms per step / tokens per s | 40.0 / 25 | 200.0 / 320 | 400.0 / 500 |",
        # shares of the profiled step (45, 200 and 400 ms)
        "| base projections | 44% | 50% | 75% |",
        "| LoRA | 4% | 5% | 5% |",
        "| attention | 7% | 30% | 10% |",
        "| Python in the forward | 44% | 15% | 10% |",
        # under 2% in every case: with the rest
        "| the rest | 0% | 0% | 0% |",
        "| torch op calls per decoder layer | 85 | 85 | 85 |",
        "",
        "SmolLM2-135M-Instruct, 1 torch thread(s), float32, 1 LoRA adapter(s), 128-token prompts; "
        "max_batch 64, prefill_chunk_tokens 200. Shares: of a step under torch.profiler (mean of 2); ms: "
        "median of 10 plain steps.",
    ]


def test_the_base_model_with_engine_defaults() -> None:
    doc = {
        **DOC,
        "config": {**DOC["config"], "adapters": 0, "changed_from_defaults": {}},
        "cases": [DOC["cases"][2]],
    }
    text = profile_table(doc)
    assert "float32, no adapter, 128-token prompts; engine defaults." in text


def test_the_kind_is_registered_for_one_file() -> None:
    assert kind_for("engine-profile", 1) is KINDS["engine-profile"]
    assert KINDS["engine-profile"].table([DOC]) == profile_table(DOC)
