"""The threads comparison's table (`python -m collm_bench engine threads`'s result) from a hand-written
result."""

from __future__ import annotations

from typing import Any

import pytest

from collm_bench.readme.engine import threads_table
from collm_bench.readme.kinds import KINDS, kind_for

pytestmark = pytest.mark.unit


def run(
    streams: list[int], max_batch: list[int], tok_s: float, ttft: tuple[float, float], tpot: float
) -> dict:
    return {
        "processes": len(streams),
        "streams": streams,
        "max_batch": max_batch,
        "changed_from_defaults": [{"max_batch": m} if m != 16 else {} for m in max_batch],
        "output_tokens": 128 * sum(streams),
        "errors": 0,
        "wall_s": 128 * sum(streams) / tok_s,
        "output_tok_s": tok_s,
        "ttft_ms_p50": ttft[0],
        "ttft_ms_p99": ttft[1],
        "tpot_ms_p50": tpot,
        "per_process": [],
    }


def case(c: int, default: bool, a: dict, b: dict) -> dict[str, Any]:
    return {
        "concurrency": c,
        "default_max_batch": default,
        "a": a,
        "b": b,
        "ratio_b_over_a": {"output_tok_s": round(b["output_tok_s"] / a["output_tok_s"], 3)},
    }


DOC = {
    "benchmark": "threads",
    "machine": {"cpus": 2, "torch_threads": 2},
    "model": "SmolLM2-135M-Instruct",
    "config": {"concurrency": [1, 64], "prompt_tokens": 200, "output_tokens": 128, "matmul_dtype": "float32"},
    "layouts": {
        "a": {"torch_threads": [2], "load_s": [3.0]},
        "b": {"torch_threads": [1, 1], "load_s": [3, 3]},
    },
    "cases": [
        case(
            1,
            False,
            run([1], [16], 20.0, (350.4, 360.0), 48.26),
            run([1, 0], [16, 16], 16.0, (500.0, 501.0), 60.0),
        ),
        case(
            64,
            False,
            run([64], [64], 160.0, (20000, 30000), 350.0),
            run([32, 32], [32, 32], 200.0, (9000, 15000), 300.04),
        ),
        case(
            64,
            True,
            run([64], [16], 100.0, (40000, 80000), 150.0),
            run([32, 32], [16, 16], 130.0, (30000, 60000), 120.0),
        ),
    ],
}


def test_threads_table() -> None:
    assert threads_table(DOC).splitlines() == [
        "| streams (max_batch) | (a) 1 process x 2 threads: tok/s, TTFT, TPOT | (b) 2 x 1 thread "
        "| (b) / (a) |",
        "|---|---|---|---:|",
        "| 1 (16) | 20.0, 0.4 s, 48 ms | 16.0, 0.5 s, 60 ms | **0.80x** |",
        # max_batch raised to the streams a process serves, then the same at the default
        "| 64 (raised) | 160.0, 20.0 s, 350 ms | 200.0, 9.0 s, 300 ms | **1.25x** |",
        "| 64 (default 16) | 100.0, 40.0 s, 150 ms | 130.0, 30.0 s, 120 ms | **1.30x** |",
        "",
        "SmolLM2-135M-Instruct, float32, 2 CPUs; 200-token prompts, 128 tokens out, all at once; (b) splits "
        "the streams, each process with max_batch raised to its share where over 16.",
    ]


def test_threads_kind() -> None:
    assert kind_for("engine-threads", 1) is KINDS["engine-threads"]
    assert KINDS["engine-threads"].table([DOC]) == threads_table(DOC)
