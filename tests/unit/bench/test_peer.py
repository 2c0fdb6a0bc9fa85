"""The pure parts of `python -m collm_bench peer llamacpp`: a level's figures from its request records, the
ratios of CoLLM to llama.cpp F16, the table (the `peer-llamacpp` readme kind) with and without CoLLM +
training, the fine-tuning tokens of a training stack from its replicas' counters, the flags, the prompt
windows, the stacks and the commands it runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from collm_bench.experiment.live import parse_counter
from collm_bench.peer.build import Layout, quantize_command
from collm_bench.peer.llamacpp import build_parser, levels_of, requests_for, servers_of, train_note
from collm_bench.peer.load import plan, summarise, token_windows
from collm_bench.peer.servers import (
    collm_up_config,
    llama_server_command,
    slot_context,
    trained_tokens,
    wait_trained,
)
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
    assert rows[0] == "| streams | llama.cpp F16 | llama.cpp F32 | CoLLM | CoLLM / F16 |"
    assert text.startswith("Per server: output tok/s, TTFT p50 / p99, TPOT p50; over llama.cpp F16 (/ F16)")
    assert rows[1:] == [
        "| 1 | 100.0, 0.05 / 0.10 s, 10.0 ms | 80.0, 0.06 / 0.12 s, 12.5 ms | 25.0, 0.20 / 0.40 s, 40.0 ms"
        " | **0.25x**, 4.00x |",
        "| 4 | 200.0, 0.08 / 0.16 s, 20.0 ms | - | 100.0, 0.40 / 0.80 s, 40.0 ms | **0.50x**, 2.00x |",
        "| 16 | - | - | 1.0, 0.00 / 0.00 s, 1.0 ms | - |",
    ]
    assert "did not complete" not in text
    assert "Some CPU (2 CPUs)" in text and "-c 24576" in text
    assert "products (CPU" not in text  # a result from before the precision was recorded


def test_the_table_says_in_which_precision_collm_multiplied_and_on_what_cpu() -> None:
    doc = {
        "servers": SERVERS,
        "workload": {"prompt_tokens": 200, "output_tokens": 128},
        "llamacpp": {"version": "version: 1 (abc)", "threads": 2, "parallel": 64, "context": 24576},
        "collm": {"command": "collm up --no-demo", "matmul_dtype": "bfloat16"},
        "host": {"cpu": "Some CPU", "cpus": 2, "flags": ["avx2", "avx512_bf16"]},
    }
    assert "CoLLM: collm up --no-demo; bfloat16 products (CPU: avx2, avx512_bf16)." in table(doc)
    doc["collm"] = {"command": "collm up --no-demo", "matmul_dtype": "float32", "small_step_f16_rows": 3}
    doc["host"] = {"cpu": "Some CPU", "cpus": 2, "flags": ["avx2"]}
    want = "CoLLM: collm up --no-demo; float32 products, fp16 copies for steps of <= 3 tokens (CPU: avx2)."
    assert want in table(doc)


def test_the_flags_parse_to_levels_servers_and_request_counts() -> None:
    assert levels_of("1, 4,16,64") == [1, 4, 16, 64]
    with pytest.raises(ValueError):
        levels_of("0,4")
    assert servers_of("collm,llamacpp-f16") == ["llamacpp-f16", "collm"]  # the running order
    assert servers_of("collm-train, collm") == ["collm", "collm-train"]
    assert servers_of(build_parser().parse_args([]).servers) == [
        "llamacpp-f16",
        "llamacpp-f32",
        "collm",
        "collm-train",
    ]
    for bad in ("vllm", "collm-training", " , "):
        with pytest.raises(ValueError):
            servers_of(bad)
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


def train_doc() -> dict[str, Any]:
    """A result with every server, CoLLM + training's levels counting their fine-tuning tokens."""
    train = {
        "training_wait_s": 12.0,
        "ft_tokens": 3000,
        "levels": [
            {**level(1, 20.0, 250.0, 50.0), "ft_tokens": 1000},
            {**level(4, 50.0, 500.0, 80.0), "ft_tokens": 2000},
        ],
    }
    servers = {**SERVERS, "collm-train": train}
    return {
        "servers": servers,
        "ratios": ratios(servers),
        "ratios_collm_train": ratios(servers, "collm-train"),
        "workload": {"prompt_tokens": 200, "output_tokens": 128},
        "llamacpp": {"version": "version: 1 (abc)", "threads": 2, "parallel": 64, "context": 24576},
        "collm": {"command": "collm up --no-demo", "train_command": "collm up"},
        "host": {"cpu": "Some CPU", "cpus": 2},
    }


def test_the_table_gives_collm_with_training_its_column_and_ratio_column() -> None:
    doc = train_doc()
    text = kind_for("peer-llamacpp", 1).table([doc])
    rows = [ln for ln in text.splitlines() if ln.startswith("| ")]
    assert rows[0].endswith("| CoLLM | CoLLM + training | CoLLM / F16 | CoLLM + training / F16 |")
    assert text.splitlines()[3] == "|---:|---|---|---|---|---:|---:|"
    assert rows[1:] == [
        "| 1 | 100.0, 0.05 / 0.10 s, 10.0 ms | 80.0, 0.06 / 0.12 s, 12.5 ms | 25.0, 0.20 / 0.40 s, 40.0 ms"
        " | 20.0, 0.25 / 0.50 s, 50.0 ms; 1000 FT tokens | **0.25x**, 4.00x | **0.20x**, 5.00x |",
        "| 4 | 200.0, 0.08 / 0.16 s, 20.0 ms | - | 100.0, 0.40 / 0.80 s, 40.0 ms"
        " | 50.0, 0.50 / 1.00 s, 80.0 ms; 2000 FT tokens | **0.50x**, 2.00x | **0.25x**, 4.00x |",
        "| 16 | - | - | 1.0, 0.00 / 0.00 s, 1.0 ms | - | - | - |",
    ]
    assert text.endswith("CoLLM: collm up --no-demo; CoLLM + training: collm up.")
    assert doc["ratios_collm_train"]["4"] == {"output_tok_s": 0.25, "ttft_ms_p50": 6.25, "tpot_ms_p50": 4.0}


def test_the_table_without_collm_with_training_keeps_one_ratio_column() -> None:
    doc = train_doc()
    del doc["servers"]["collm-train"], doc["ratios_collm_train"], doc["collm"]["train_command"]
    text = table(doc)
    assert text.splitlines()[2].endswith("| CoLLM / F16 |")
    assert text.splitlines()[3] == "|---:|---|---|---|---:|"
    assert "training" not in text and "FT tokens" not in text
    only_train = {"collm-train": doc["servers"]["collm"], "llamacpp-f16": doc["servers"]["llamacpp-f16"]}
    header = table({**doc, "servers": only_train, "collm": {**doc["collm"], "train_command": "collm up"}})
    assert "| CoLLM + training / F16 |" in header.splitlines()[2]
    assert "| CoLLM / F16" not in header


def metrics(r0: float, r1: float) -> dict[str, dict[str, float]]:
    """Two replicas' readings as `experiment.live.read_ft_counters` takes them from each one's exposition
    text."""

    def text(tokens: float) -> str:
        return (
            "# HELP collm_replica_ft_tokens_total Tokens processed by co-executed fine-tuning\n"
            "# TYPE collm_replica_ft_tokens_total counter\n"
            f'collm_replica_ft_tokens_total{{replica="r"}} {tokens}\n'
        )

    return {
        rid: {"ft_tokens": sum(parse_counter(text(v), "collm_replica_ft_tokens").values()), "forward_s": 1.0}
        for rid, v in (("r0", r0), ("r1", r1))
    }


def test_trained_tokens_are_the_counters_growth_over_every_replica() -> None:
    assert trained_tokens(metrics(100.0, 0.0), metrics(350.0, 40.0)) == 290
    assert trained_tokens({}, metrics(7.0, 0.0)) == 7  # the fresh stack's counters started at 0
    assert trained_tokens(metrics(5.0, 5.0), metrics(5.0, 5.0)) == 0


def test_the_load_waits_until_the_replicas_have_trained(tmp_path: Path) -> None:
    readings = iter([metrics(0.0, 0.0), metrics(0.0, 0.0), metrics(0.0, 12.0)])
    calls = []

    def read() -> dict[str, dict[str, float]]:
        calls.append(1)
        return next(readings)

    assert wait_trained(read, timeout_s=60.0, poll_s=0.0, log_dir=tmp_path) >= 0.0
    assert len(calls) == 3
    with pytest.raises(TimeoutError, match="no replica trained a token within 0 s"):
        wait_trained(lambda: metrics(0.0, 0.0), timeout_s=0.0, poll_s=0.0, log_dir=tmp_path)


def test_collm_with_training_is_collm_up_with_its_demo(tmp_path: Path) -> None:
    model = "/m/SmolLM2-135M-Instruct.Q4_1.gguf"
    train = collm_up_config(model, tmp_path / "train", demo=True)
    serve = collm_up_config(model, tmp_path / "serve")
    assert train.model == serve.model == model
    assert all(r.data_dir and Path(r.data_dir).is_dir() for r in train.replicas)  # each its demo share
    assert train.metrics_port_base == 0  # `collm up`'s free Prometheus ports: the counters are read there
    assert all(r.data_dir is None for r in serve.replicas) and serve.metrics_port_base is None
    assert [r.replica_id for r in train.replicas] == [r.replica_id for r in serve.replicas]
    assert train.log_dir == tmp_path / "train" / "logs"


def test_the_note_says_what_collm_with_training_is_and_what_it_trained() -> None:
    note = train_note(train_doc()["servers"]["collm-train"])
    assert note.startswith("CoLLM + training: `collm up`, its demo adapters (")
    assert "12 s after ready" in note
    assert "3000 fine-tuning tokens during the levels" in note
