"""The pure parts of `python -m collm_bench peer llamacpp`: a level's figures from its request records, the
ratios of CoLLM to llama.cpp F16, the table (the `peer-llamacpp` readme kind), the flags, the prompt
windows and the commands it runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from collm_bench.peer.build import Layout, quantize_command
from collm_bench.peer.llamacpp import levels_of, requests_for, servers_of
from collm_bench.peer.load import plan, summarise, token_windows
from collm_bench.peer.servers import llama_server_command, slot_context
from collm_bench.peer.table import ratios, table
from collm_bench.readme.kinds import kind_for
from collm_workload.records import RequestRecord

pytestmark = pytest.mark.unit


def record(i: int, ttft_ms: float, e2e_ms: float, tokens: int, status: str = "ok") -> RequestRecord:
    return RequestRecord(
        request_id=f"r{i}",
        index=i,
        domain="peer",
        model="m",
        status=status,  # type: ignore[arg-type]
        scheduled_s=0.0,
        ttft_ms=ttft_ms,
        e2e_ms=e2e_ms,
        completion_tokens=tokens,
        prompt_tokens=200 + i,
        error=None if status == "ok" else "HTTP 500: boom",
    )


def test_a_level_counts_only_completed_requests() -> None:
    recs = [record(0, 100.0, 1370.0, 128), record(1, 300.0, 1570.0, 128), record(2, 50.0, 60.0, 3, "error")]
    got = summarise(recs, 2.0, 4)
    assert got["concurrency"] == 4
    assert (got["requests"], got["ok"], got["output_tokens"]) == (3, 2, 256)
    assert got["output_tok_s"] == 128.0
    assert got["ttft_ms_p50"] == 200.0  # the mean of the two: numpy's default percentile
    assert got["ttft_ms_p99"] == 298.0
    assert got["tpot_ms_p50"] == 10.0  # (e2e - ttft) / (tokens - 1)
    assert got["prompt_tokens_mean"] == 200.5
    assert got["first_error"] == "error: HTTP 500: boom"


def test_a_level_without_answers_has_no_latencies() -> None:
    got = summarise([record(0, 5.0, 5.0, 0, "timeout")], 1.0, 1)
    assert (got["ok"], got["output_tok_s"], got["ttft_ms_p50"], got["tpot_ms_p50"]) == (0, 0.0, None, None)
    assert got["prompt_tokens_mean"] is None


def level(c: int, tok_s: float, ttft: float, tpot: float) -> dict[str, Any]:
    return {
        "concurrency": c,
        "requests": 8,
        "ok": 8,
        "wall_s": 10.0,
        "output_tokens": 1024,
        "output_tok_s": tok_s,
        "ttft_ms_p50": ttft,
        "ttft_ms_p99": 2 * ttft,
        "tpot_ms_p50": tpot,
        "prompt_tokens_mean": 200.0,
    }


SERVERS = {
    "llamacpp-f16": {"levels": [level(1, 100.0, 50.0, 10.0), level(4, 200.0, 80.0, 20.0)]},
    "llamacpp-f32": {"levels": [level(1, 80.0, 60.0, 12.5)]},
    "collm": {
        "levels": [level(1, 25.0, 200.0, 40.0), level(4, 100.0, 400.0, 40.0), level(16, 1.0, 1.0, 1.0)]
    },
}


def test_ratios_are_collm_over_llamacpp_f16_where_both_ran() -> None:
    assert ratios(SERVERS) == {
        "1": {"output_tok_s": 0.25, "ttft_ms_p50": 4.0, "tpot_ms_p50": 4.0},
        "4": {"output_tok_s": 0.5, "ttft_ms_p50": 5.0, "tpot_ms_p50": 2.0},
    }
    assert ratios({"collm": SERVERS["collm"]}) == {}


def test_the_table_shows_every_server_level_and_the_ratios() -> None:
    doc = {
        "servers": SERVERS,
        "ratios": ratios(SERVERS),
        "workload": {"prompt_tokens": 200, "output_tokens": 128},
        "llamacpp": {"version": "version: 1 (abc)", "threads": 2, "parallel": 64, "context": 24576},
        "collm": {"command": "collm up --no-demo"},
        "host": {"cpu": "Some CPU", "cpus": 2},
    }
    text = kind_for("peer-llamacpp", 1).table([doc])
    assert text == table(doc)
    rows = [ln for ln in text.splitlines() if ln.startswith("| ") and "---" not in ln]
    assert rows[0].startswith("| streams | llama.cpp F16: tok/s") and "| CoLLM: tok/s" in rows[0]
    assert rows[1:] == [
        "| 1 | 100.0, 0.05 / 0.10 s, 10.0 ms | 80.0, 0.06 / 0.12 s, 12.5 ms | 25.0, 0.20 / 0.40 s, 40.0 ms"
        " | **0.25x**, 4.00x |",
        "| 4 | 200.0, 0.08 / 0.16 s, 20.0 ms | - | 100.0, 0.40 / 0.80 s, 40.0 ms | **0.50x**, 2.00x |",
        "| 16 | - | - | 1.0, 0.00 / 0.00 s, 1.0 ms | - |",
    ]
    assert "did not complete" not in text
    assert "Some CPU (2 CPUs)" in text and "-c 24576" in text


def test_the_flags_parse_to_levels_servers_and_request_counts() -> None:
    assert levels_of("1, 4,16,64") == [1, 4, 16, 64]
    with pytest.raises(ValueError):
        levels_of("0,4")
    assert servers_of("collm,llamacpp-f16") == ["llamacpp-f16", "collm"]  # the running order
    with pytest.raises(ValueError):
        servers_of("vllm")
    assert [requests_for(c, None) for c in (1, 4, 16, 64)] == [8, 8, 32, 128]
    assert requests_for(64, 4) == 4


def test_prompt_windows_are_distinct_and_of_the_asked_length() -> None:
    ids = list(range(1000))
    windows = token_windows(ids, 50, 200, seed=3)
    assert len({w[0] for w in windows}) == 50 and all(len(w) == 200 for w in windows)
    assert windows == token_windows(ids, 50, 200, seed=3)
    with pytest.raises(ValueError):
        token_windows(ids[:10], 5, 8, seed=0)
    reqs = plan(["a", "b"], "m", 128, "c4")
    got = [(r.request_id, r.scheduled_s, r.max_tokens) for r in reqs]
    assert got == [("c4-0", 0.0, 128), ("c4-1", 0.0, 128)]


def test_the_commands_of_the_build_and_the_server() -> None:
    layout = Layout(Path("/w"))
    model = Path("/m/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert quantize_command(layout, model, "F16") == [
        "/w/build/bin/llama-quantize",
        "--allow-requantize",
        str(model),
        "/w/models/SmolLM2-135M-Instruct.F16.gguf",
        "F16",
    ]
    assert slot_context(200, 128) == 384
    cmd = llama_server_command(layout.binary("llama-server"), model, 8080, 2, 64, 384)
    assert cmd[cmd.index("-t") + 1] == "2" and cmd[cmd.index("-np") + 1] == "64"
    assert cmd[cmd.index("-c") + 1] == str(64 * 384) and "--cont-batching" in cmd
