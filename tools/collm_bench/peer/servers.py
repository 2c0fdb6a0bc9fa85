"""The servers a peer comparison drives, each started for its turn and stopped after it: llama.cpp's
`llama-server` on a model file, and CoLLM as `collm up --no-demo` starts it (serving only).

Both are context managers that yield the server's base URL once it answers (llama-server's `/health`,
the stack's `/readyz` with every replica), and stop the server on exit whatever happened.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
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


def collm_up_config(model: str, run_dir: Path) -> Any:
    """The `StackConfig` that `collm up --no-demo --model MODEL` runs (`collm_ops.cli.stack_config`), on its
    own NATS, Redis and gateway ports, without metrics ports, in a fresh RUN_DIR (what an earlier run left
    there is removed), its services logging under RUN_DIR/logs."""
    from collm_ops.cli import build_parser, stack_config

    shutil.rmtree(run_dir, ignore_errors=True)
    flags = {
        "--model": model,
        "--port": str(free_port()),
        "--nats-url": f"nats://127.0.0.1:{free_port()}",
        "--redis-url": f"redis://127.0.0.1:{free_port()}/0",
        "--run-dir": str(run_dir),
        "--metrics-port-base": "-1",
    }
    cfg = stack_config(
        build_parser().parse_args(["up", "--no-demo", *(x for kv in flags.items() for x in kv)])
    )
    cfg.log_dir = run_dir / "logs"
    return cfg


@contextlib.contextmanager
def collm_serving(cfg: Any) -> Iterator[str]:
    """The stack of `cfg` (`collm_up_config`) started with the launcher; yield its gateway URL once it is
    ready; stop it on exit."""
    from collm_ops.launcher import Stack

    with Stack(cfg) as stack:
        yield stack.gateway_url
