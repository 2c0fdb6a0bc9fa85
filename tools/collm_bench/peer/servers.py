"""The servers a peer comparison drives, each started for its turn and stopped after it: llama.cpp's
`llama-server` on a model file, CoLLM as `collm up --no-demo` starts it (serving only), and CoLLM as
`collm up` starts it with its demo (every replica holding its share of the demo domains, their adapters
training by federated rounds).

Each is a context manager that yields the server's base URL once it answers (llama-server's `/health`,
the stack's `/readyz` with every replica) and stops the server on exit whatever happened; the training
stack's (`collm_training`) yields it once its replicas have trained, with a reading of their fine-tuning
counters (`Training`).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from collm_ops.servers import free_port

SLOT_ROUND_TOKENS = 64  # llama-server's per-slot context is rounded up to a multiple of this


def slot_context(prompt_tokens: int, output_tokens: int) -> int:
    """A slot's context: a request's prompt and output with a margin (the BOS token, the prompt's few extra
    tokens when its text is tokenised again), rounded up to `SLOT_ROUND_TOKENS`."""
    return SLOT_ROUND_TOKENS * math.ceil((prompt_tokens + output_tokens + 16) / SLOT_ROUND_TOKENS)


def llama_server_command(
    binary: Path, model: Path, port: int, threads: int, parallel: int, slot_tokens: int
) -> list[str]:
    """`llama-server` on `model` at 127.0.0.1:`port`: `threads` threads, `parallel` slots of `slot_tokens`
    context each (the whole context `parallel` x `slot_tokens`), continuous batching."""
    return [
        str(binary),
        "-m", str(model),
        "--host", "127.0.0.1",
        "--port", str(port),
        "-t", str(threads),
        "-np", str(parallel),
        "-c", str(parallel * slot_tokens),
        "--cont-batching",
    ]  # fmt: skip


def _answers(url: str) -> bool:
    """Whether `url` answers 200."""
    try:
        return httpx.get(url, timeout=2.0, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


@contextlib.contextmanager
def llama_server(cmd: Sequence[str], port: int, log: Path, ready_timeout_s: float = 300.0) -> Iterator[str]:
    """Run `cmd` (a `llama_server_command` on `port`) in its own session, its output in `log`; yield its
    base URL once `/health` answers 200; SIGTERM it on exit (SIGKILL after 30 s)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as f:
        proc = subprocess.Popen(list(cmd), stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_timeout_s
        while not _answers(f"{url}/health"):
            if proc.poll() is not None:
                tail = log.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"llama-server exited with {proc.returncode}:\n{tail}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"llama-server not ready in {ready_timeout_s:.0f} s (log: {log})")
            time.sleep(0.5)
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def llama_server_version(binary: Path) -> str:
    """The first line of `llama-server --version` that names the version (its build number and commit)."""
    out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, check=False)
    lines = [ln.strip() for ln in (out.stdout + out.stderr).splitlines() if ln.startswith("version")]
    return lines[0] if lines else "unknown"


def collm_up_config(model: str, run_dir: Path, demo: bool = False) -> Any:
    """The `StackConfig` that `collm up --model MODEL` runs (`collm_ops.cli.stack_config`): with `demo`, its
    demo (each replica's share of the demo data written under RUN_DIR) and its Prometheus ports (free
    ones, as `collm up` takes them: the fine-tuning counters are read there); else `--no-demo` and no
    metrics ports. On its own NATS, Redis and gateway ports, in a fresh RUN_DIR (what an earlier run left
    there is removed), its services logging under RUN_DIR/logs."""
    from collm_ops.cli import build_parser, stack_config

    shutil.rmtree(run_dir, ignore_errors=True)
    flags = {
        "--model": model,
        "--port": str(free_port()),
        "--nats-url": f"nats://127.0.0.1:{free_port()}",
        "--redis-url": f"redis://127.0.0.1:{free_port()}/0",
        "--run-dir": str(run_dir),
    }
    mode = [] if demo else ["--no-demo", "--metrics-port-base", "-1"]
    cfg = stack_config(build_parser().parse_args(["up", *mode, *(x for kv in flags.items() for x in kv)]))
    cfg.log_dir = run_dir / "logs"
    return cfg


@contextlib.contextmanager
def collm_serving(cfg: Any) -> Iterator[str]:
    """The stack of `cfg` (`collm_up_config`) started with the launcher; yield its gateway URL once it is
    ready; stop it on exit."""
    from collm_ops.launcher import Stack

    with Stack(cfg) as stack:
        yield stack.gateway_url


Counters = Mapping[str, Mapping[str, float]]  # per replica, its counters (`experiment.live.read_ft_counters`)


def trained_tokens(before: Counters, after: Counters) -> int:
    """The fine-tuning tokens the replicas trained between two readings of their counters
    (`experiment.live.counter_deltas`), all replicas together."""
    from collm_bench.experiment.live import counter_deltas

    return round(sum(counter_deltas(before, after)["ft_tokens"].values()))


@dataclass(frozen=True)
class Training:
    """A running stack whose replicas train: its gateway URL, how long after it was ready its replicas had
    first trained, and `read`, a reading of their counters now."""

    url: str
    wait_s: float
    read: Callable[[], Counters]


def wait_trained(read: Callable[[], Counters], timeout_s: float, poll_s: float, log_dir: Path) -> float:
    """Poll `read` until the replicas have trained some token; the seconds it took (TimeoutError, naming
    `log_dir`, when they have not in `timeout_s`)."""
    t0 = time.monotonic()
    while trained_tokens({}, read()) <= 0:
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(
                f"collm-train: no replica trained a token within {timeout_s:.0f} s of being ready "
                f"(coordinator and replica logs: {log_dir})"
            )
        time.sleep(poll_s)
    return time.monotonic() - t0


@contextlib.contextmanager
def collm_training(cfg: Any, start_timeout_s: float, poll_s: float = 2.0) -> Iterator[Training]:
    """The stack of `cfg` (`collm_up_config(..., demo=True)`) started with the launcher; once every replica
    is ready and the replicas have trained (`wait_trained`), yield it (`Training`); stop it on exit."""
    from collm_bench.experiment.live import read_ft_counters
    from collm_ops.launcher import Stack

    with Stack(cfg) as stack:

        def read() -> Counters:
            return asyncio.run(read_ft_counters(stack))

        yield Training(stack.gateway_url, wait_trained(read, start_timeout_s, poll_s, cfg.log_dir), read)
