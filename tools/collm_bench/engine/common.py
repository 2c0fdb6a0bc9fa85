"""Shared pieces of the engine benchmarks: model, prompts from real text, timed request runs, results.

Only what an engine of an earlier commit also has is imported at module level (the `concurrency`
benchmark runs this module against one): `collm_bench.calibrate`, which needs this tree's engine, is
imported where it is used."""

from __future__ import annotations

import json
import os
import platform
import random
import resource
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from collm_bench.groups import REPO, RESULTS, command_line
from collm_common.data import Example
from collm_common.lora import AdapterWeights, LoraSpec
from collm_replica.engine import Engine, EngineRequest
from collm_replica.models import LoadedModel, load_model
from collm_replica.settings import ReplicaSettings
from collm_workload.tokens import prompts_from_text

ENGINE_RESULTS = RESULTS / "engine"
SHARED_DATA = REPO.parent / "shared" / "data" / "domains"


def matmul_dtype() -> str:
    """The products' precision of the benchmarks' engines: the replica's setting (`COLLM_MATMUL_DTYPE`)."""
    return ReplicaSettings().matmul_dtype


def engine_command_line() -> str:
    """This run's command as the result files record it, with `COLLM_MATMUL_DTYPE` when it is not fp32."""
    env = "" if matmul_dtype() == "float32" else f"COLLM_MATMUL_DTYPE={matmul_dtype()} "
    return env + command_line(lock=True)


def load_smollm2(threads: int = 1) -> LoadedModel:
    """SmolLM2 (the benchmarks' model); `COLLM_BENCH_MODEL=tiny` runs the same code on the tiny model (a
    quick check of the scripts, not a measurement)."""
    torch.set_num_threads(threads)
    spec = os.environ.get("COLLM_BENCH_MODEL", "smollm2")
    return load_model(
        spec, device="cpu", cache_dir=ReplicaSettings().model_cache_dir, matmul_dtype=matmul_dtype()
    )


def save_result(name: str, data: dict[str, Any]) -> Path:
    """Write bench/results/engine/<name>.json (<name>_<dtype>.json in another precision): the benchmark's
    `data` after its name, command, time and machine."""
    ENGINE_RESULTS.mkdir(parents=True, exist_ok=True)
    if matmul_dtype() != "float32":  # results in another precision do not replace the fp32 ones
        name = f"{name}_{matmul_dtype()}"
    path = ENGINE_RESULTS / f"{name}.json"
    doc = {
        "benchmark": name,
        "command": engine_command_line(),
        "measured_unix_s": time.time(),
        "machine": {
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "matmul_dtype": matmul_dtype(),
            "python": platform.python_version(),
        },
        **data,
    }
    path.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {path.relative_to(REPO) if path.is_relative_to(REPO) else path}")
    return path


def peak_rss_mb() -> float:
    """This process's peak resident set size (MB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


# --- data ------------------------------------------------------------------------------------------------
def domain_examples(domain: str, limit: int | None = None) -> list[Example]:
    """Real domain data from ../shared/data/domains converted on the fly (empty list when absent)."""
    d = SHARED_DATA / domain
    out: list[Example] = []
    if domain == "medical" and (d / "medquad_niddk_ninds_cdc.jsonl").is_file():
        for line in (d / "medquad_niddk_ninds_cdc.jsonl").read_text().splitlines():
            row = json.loads(line)
            out.append(Example(f"med-{row['id']}", row["question"], row["answer"][:600], domain="medical"))
    elif domain == "math" and (d / "gsm8k_train.jsonl").is_file():
        for i, line in enumerate((d / "gsm8k_train.jsonl").read_text().splitlines()):
            row = json.loads(line)
            out.append(Example(f"gsm-{i}", row["question"], row["answer"], domain="math"))
    random.Random(0).shuffle(out)
    return out[:limit] if limit else out


def text_corpus() -> str:
    """Text to cut prompts from: medical answers when the shared data is there, else a repeated sentence."""
    ex = domain_examples("medical", 200)
    if ex:
        return "\n\n".join(e.response for e in ex)
    return " ".join(
        f"The replica serves request number {i} while it trains its adapters." for i in range(2000)
    )


def token_prompts(loaded: LoadedModel, n: int, length: int, seed: int = 0) -> list[list[int]]:
    """`n` prompts of exactly `length` tokens cut from real text at different offsets."""
    return prompts_from_text(loaded.tokenizer, text_corpus(), n, length, seed)


def random_adapter(
    loaded: LoadedModel, seed: int, scale: float = 0.02, spec: LoraSpec | None = None
) -> AdapterWeights:
    """A random LoRA adapter for `loaded` (`collm_bench.calibrate.random_adapter`)."""
    from collm_bench import calibrate

    return calibrate.random_adapter(loaded, seed, scale, spec)


# --- timed runs --------------------------------------------------------------------------------------------
@dataclass
class Trace:
    """Events of one request with arrival times (perf_counter seconds)."""

    submitted_s: float = 0.0
    token_times: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    accepted_version: str | None = None
    finished: Any = None
    error: Any = None
    done: threading.Event = field(default_factory=threading.Event)

    def __call__(self, ev: Any) -> None:
        now = time.perf_counter()
        if ev.kind == "accepted":
            self.accepted_version = ev.adapter_version_id
        elif ev.kind == "token":
            self.token_times.extend([now] * max(1, len(ev.token_ids)))
            self.token_ids.extend(ev.token_ids)
        elif ev.kind == "finished":
            self.finished = ev
            self.done.set()
        elif ev.kind == "error":
            self.error = ev
            self.done.set()

    @property
    def ttft_s(self) -> float | None:
        return self.token_times[0] - self.submitted_s if self.token_times else None

    @property
    def tpot_s(self) -> float | None:
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)

    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]


def submit(engine: Engine, req: EngineRequest) -> Trace:
    """Submit `req` to `engine`; the trace that records its events."""
    tr = Trace(submitted_s=time.perf_counter())
    engine.submit(req, tr)
    return tr


def wait_all(traces: list[Trace], timeout_s: float = 1800.0) -> None:
    """Wait until every request of `traces` has finished or failed (TimeoutError after `timeout_s` each)."""
    for t in traces:
        if not t.done.wait(timeout_s):
            raise TimeoutError("a benchmark request did not finish")


def greedy(rid: str, ids: list[int], n: int, adapter: str | None = None, **kw: Any) -> EngineRequest:
    """A greedy request for exactly `n` tokens (`ignore_eos`)."""
    return EngineRequest(rid, ids, adapter=adapter, max_tokens=n, temperature=0.0, ignore_eos=True, **kw)
