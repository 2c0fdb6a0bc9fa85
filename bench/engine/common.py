"""Shared pieces of the engine benchmarks: model, prompts from real text, timed request runs, results."""

from __future__ import annotations

import json
import os
import platform
import random
import resource
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from collm_bench import calibrate
from collm_bench.calibrate import prompts_from_text
from collm_common.data import Example
from collm_common.lora import AdapterWeights, LoraSpec
from collm_replica.engine import Engine, EngineRequest
from collm_replica.models import LoadedModel, load_model
from collm_replica.settings import ReplicaSettings

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results" / "engine"
SHARED_DATA = ROOT.parent / "shared" / "data" / "domains"


def matmul_dtype() -> str:
    """The products' precision of the benchmarks' engines: the replica's setting (`COLLM_MATMUL_DTYPE`)."""
    return ReplicaSettings().matmul_dtype


def command_line() -> str:
    env = "" if matmul_dtype() == "float32" else f"COLLM_MATMUL_DTYPE={matmul_dtype()} "
    return (
        env
        + "flock /tmp/collm-heavy.lock .venv/bin/python "
        + " ".join([str(Path(sys.argv[0]).resolve().relative_to(ROOT)), *sys.argv[1:]])
    )


def load_smollm2(threads: int = 1) -> LoadedModel:
    """SmolLM2 (the benchmarks' model); `COLLM_BENCH_MODEL=tiny` runs the same code on the tiny model (a
    quick check of the scripts, not a measurement)."""
    torch.set_num_threads(threads)
    spec = os.environ.get("COLLM_BENCH_MODEL", "smollm2")
    return load_model(
        spec, device="cpu", cache_dir=ReplicaSettings().model_cache_dir, matmul_dtype=matmul_dtype()
    )


def save_result(name: str, data: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    if matmul_dtype() != "float32":  # results in another precision do not replace the fp32 ones
        name = f"{name}_{matmul_dtype()}"
    path = RESULTS / f"{name}.json"
    doc = {
        "benchmark": name,
        "command": command_line(),
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
    print(f"wrote {path.relative_to(ROOT)}")
    return path


def peak_rss_mb() -> float:
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
    tr = Trace(submitted_s=time.perf_counter())
    engine.submit(req, tr)
    return tr


def wait_all(traces: list[Trace], timeout_s: float = 1800.0) -> None:
    for t in traces:
        if not t.done.wait(timeout_s):
            raise TimeoutError("a benchmark request did not finish")


def greedy(rid: str, ids: list[int], n: int, adapter: str | None = None, **kw: Any) -> EngineRequest:
    return EngineRequest(rid, ids, adapter=adapter, max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    if not s:
        return float("nan")
    k = max(0, min(len(s) - 1, int(round(q / 100 * (len(s) - 1)))))
    return s[k]
