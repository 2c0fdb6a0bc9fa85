"""vLLM's serving metrics on a replica: names, labels, buckets and what a finished request adds."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from collm_common.wire.inference import Finished
from collm_common.wire.telemetry import ResidentAdapter
from collm_replica import vllm_metrics

pytestmark = pytest.mark.unit


def value(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_token_buckets_are_vllms_one_two_five_series() -> None:
    assert vllm_metrics.one_two_five_buckets(512) == (1, 2, 5, 10, 20, 50, 100, 200, 500)
    assert vllm_metrics.one_two_five_buckets(1) == (1,)


def test_a_finished_request_is_counted_as_vllm_counts_it() -> None:
    engine = {"model_name": "m-unit", "engine": "e-unit"}
    before = {
        r: value("vllm:request_success_total", finished_reason=r, **engine)
        for r in ("stop", "length", "abort")
    }

    def finished(reason: str, completion: int) -> Finished:
        return Finished(
            request_id="x", seq=0, finish_reason=reason, prompt_tokens=7, completion_tokens=completion,  # type: ignore[arg-type]
            adapter_version_id="base", replica_id="e-unit", queue_ms=10.0, ttft_ms=30.0, tpot_ms=20.0,
            e2e_ms=90.0,
        )  # fmt: skip

    vllm_metrics.record_finished("m-unit", "e-unit", finished("length", 4), max_tokens=4)
    vllm_metrics.record_finished("m-unit", "e-unit", finished("cancelled", 1), max_tokens=None)
    assert value("vllm:request_success_total", finished_reason="length", **engine) == before["length"] + 1
    assert value("vllm:request_success_total", finished_reason="abort", **engine) == before["abort"] + 1
    assert value("vllm:prompt_tokens_total", **engine) >= 14
    assert value("vllm:generation_tokens_total", **engine) >= 5
    # TTFT once a token came; TPOT and inter-token latency from the second token on.
    assert value("vllm:time_to_first_token_seconds_count", **engine) >= 2
    assert value("vllm:time_per_output_token_seconds_bucket", le="0.025", **engine) >= 1
    assert value("vllm:inter_token_latency_seconds_count", **engine) >= 1
    assert value("vllm:e2e_request_latency_seconds_bucket", le="0.3", **engine) >= 2
    assert value("vllm:request_params_max_tokens_count", **engine) >= 1


def test_the_engine_state_and_the_lora_info_of_the_latest_tick() -> None:
    engine = {"model_name": "m-state", "engine": "e-state"}
    adapters = [
        ResidentAdapter(name="math", version_id="math@v2", version=2, in_flight=3),
        ResidentAdapter(name="medical", version_id="medical@v1", version=1, in_flight=0),
    ]
    vllm_metrics.record_state("m-state", "e-state", 5, 2, 0.25, adapters, 4, 1234.0)
    assert value("vllm:num_requests_running", **engine) == 5
    assert value("vllm:num_requests_waiting", **engine) == 2
    assert value("vllm:kv_cache_usage_perc", **engine) == 0.25
    info = {"max_lora": "4", "waiting_lora_adapters": "", "running_lora_adapters": "math"}
    assert value("vllm:lora_requests_info", **info) == 1234.0
