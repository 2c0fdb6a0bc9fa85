"""Supervision figures: one replica of a real `collm up` SIGKILLed while streams run through the gateway.

Starts `python -m collm_ops up` (the launcher with supervision on, as `make up` runs it) with two
replicas of the given model (SmolLM2 by default) on free ports, with its own nats-server and
redis-server, the services' default settings, and no demo data (`--no-demo`, where the command has
it: no training competes with serving). Once every replica serves, it keeps `--concurrency` streams in
flight (closed loop) plus a short probe stream every 0.2 s (at most 2 in flight), SIGKILLs replica
r0's process (its pid from the launcher's `<run_dir>/supervision.json`), and measures with the
scenario of tests/integration/faults/supervision.py: (a) the kill until requests sent after it are
accepted by r1 and until they get their first token there, and how long new requests wait for their
first token during the outage, (b) the kill to the first token r0 generates again after supervision
restarted it, (c) every request's fate: completed, moved to r1 before its first token and completed,
ended with a clear error, or lost. Then stops `collm up` with SIGTERM.

Writes a compact summary to bench/results/faults/supervision.json and prints a table. Runs from the
repository root (it imports `tests`).

    flock /tmp/collm-heavy.lock .venv/bin/python -m collm_bench faults supervise
    flock /tmp/collm-heavy.lock .venv/bin/python -m collm_bench faults supervise --model tiny --concurrency 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from collm_bench.groups import REPO, RESULTS, add_max_tokens, add_model, add_out, command_line, prog
from collm_ops.servers import free_port
from collm_replica.naming import served_name

if TYPE_CHECKING:
    from tests.integration.faults.report import FaultReport
    from tests.integration.faults.supervision import SupervisedTarget

RESULT = RESULTS / "faults" / "supervision.json"


class CollmUp:
    """`python -m collm_ops up` as a child process on free ports, in its own run directory."""

    def __init__(self, tmp: Path, model: str, replicas: int) -> None:
        self.tmp = tmp
        self.model = model
        self.replicas = tuple(f"r{i}" for i in range(replicas))
        self.port = free_port()
        self.run_dir = tmp / "run"
        self.log_path = tmp / "collm-up.log"
        help_text = subprocess.run(
            [sys.executable, "-m", "collm_ops", "up", "--help"], capture_output=True, text=True, check=True
        ).stdout
        self.cmd = [
            sys.executable, "-m", "collm_ops",
            "--nats-url", f"nats://127.0.0.1:{free_port()}",
            "--redis-url", f"redis://127.0.0.1:{free_port()}/0",
            "--redis-prefix", f"sup{uuid.uuid4().hex[:6]}",
            "up", "--replicas", str(replicas), "--model", model, "--port", str(self.port),
            "--run-dir", str(self.run_dir),
            *(["--no-demo"] if "--no-demo" in help_text else []),
        ]  # fmt: skip
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float) -> float:
        t0 = time.monotonic()
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                self.cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO
            )
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"collm up exited with {self.proc.returncode}:\n{self.log_tail()}")
            if self.ready():
                return time.monotonic() - t0
            time.sleep(1.0)
        raise TimeoutError(f"collm up not ready in {timeout_s:.0f}s:\n{self.log_tail()}")

    def ready(self) -> bool:
        try:
            r = httpx.get(f"{self.url}/readyz", timeout=2.0)
        except httpx.HTTPError:
            return False
        return (
            r.status_code == 200
            and set(self.replicas) <= set(r.json().get("replicas", []))
            and self.status().get("supervising") is True
        )

    def status(self) -> dict[str, Any]:
        try:
            return json.loads((self.run_dir / "supervision.json").read_text())
        except (OSError, ValueError):
            return {}

    def service(self, rid: str) -> dict[str, Any]:
        return self.status().get("services", {}).get(f"replica-{rid}", {})

    def stop(self) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            return self.proc.wait()

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def launcher_lines(self) -> list[str]:
        """The launcher's own lines about supervision (exits, restarts, crash loops)."""
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        keep = re.compile(r"launcher \| .*(exited|restarted|CRASH LOOP|supervising)")
        return [ln.strip() for ln in text.splitlines() if keep.search(ln)][:20]

    def target(self) -> SupervisedTarget:
        """The supervision scenario's view of this stack: its URL, model, replicas, kill and restarts."""
        from tests.integration.faults.supervision import SupervisedTarget

        async def crash(rid: str) -> None:
            pid = self.service(rid).get("pid")
            if not pid:
                raise RuntimeError(f"no pid for replica {rid} in {self.run_dir / 'supervision.json'}")
            os.kill(int(pid), signal.SIGKILL)

        def restarts(rid: str) -> int:
            return int(self.service(rid).get("restarts") or 0)

        return SupervisedTarget(self.url, served_name(self.model), self.replicas, crash, restarts)


def table(summary: dict[str, Any]) -> str:
    f = summary["fates"]
    goals = summary["goals"]
    rows = [
        ("(a) kill -> a new request accepted by the other replica", summary["first_new_accepted_s"],
         f"<= {goals['first_new_served_s']} s"),
        ("(a) kill -> a new request's first token from the other replica", summary["first_new_served_s"],
         f"<= {goals['first_new_served_s']} s"),
        ("(a) first-token wait of new requests during the outage, p50 / max",
         "{p50} / {max}".format(**summary["ttft_s"]["outage"]), ""),
        ("(b) kill -> victim restarted by supervision", summary["restarted_s"], ""),
        ("(b) kill -> victim serving again (its first token)", summary["serving_again_s"],
         f"<= {goals['serving_again_s']} s"),
        ("(c) completed", f["completed"], ""),
        ("(c) moved before the first token, completed", f["moved_and_completed"], ""),
        ("(c) ended with a clear error", f["clear_error"], ""),
        ("(c) lost silently", f["lost"], "0"),
    ]  # fmt: skip
    lines = ["| measure | value | goal |", "|---|---|---|"]
    lines += [f"| {name} | {value if value is not None else '-'} | {goal} |" for name, value, goal in rows]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The flags of `faults supervise`."""
    ap = argparse.ArgumentParser(
        prog=prog("faults", "supervise"),
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model(ap, "smollm2")
    ap.add_argument("--concurrency", type=int, default=16, help="streams kept in flight")
    add_max_tokens(ap, 64)
    ap.add_argument("--ready-timeout-s", type=float, default=600.0)
    ap.add_argument(
        "--client-timeout-s", type=float, default=180.0, help="a request unanswered by then is lost"
    )
    add_out(ap, RESULT)
    return ap


@dataclass(frozen=True)
class KillRun:
    """One run: the stack, how long it took to be ready, the scenario's report, r0's pid before the kill
    and after the restart, the launcher's supervision lines, and `collm up`'s exit code."""

    up: CollmUp
    ready_s: float
    report: FaultReport
    pids: list[Any]  # as supervision.json gives them
    launcher_lines: list[str]
    exit_code: int | None


def kill_under_load(args: argparse.Namespace) -> KillRun:
    """Start `collm up`, run the supervision scenario against it (r0 killed), and stop it."""
    from tests.integration.faults.supervision import supervised_replica_kill

    with tempfile.TemporaryDirectory(prefix="collm-supervise-") as tmp:
        up = CollmUp(Path(tmp), args.model, replicas=2)
        try:
            ready_s = up.start(args.ready_timeout_s)
            print(f"collm up ready in {ready_s:.1f}s: {' '.join(up.cmd[1:])}", flush=True)
            pid0 = up.service("r0").get("pid")
            report = asyncio.run(
                supervised_replica_kill(
                    up.target(),
                    victim="r0",
                    concurrency=args.concurrency,
                    max_tokens=args.max_tokens,
                    streams_only=True,
                    warm_s=5.0,
                    # The services' defaults: a request may wait 60 s for its first token; a client
                    # that gave up sooner would count a slow answer as lost.
                    client_timeout_s=args.client_timeout_s,
                )
            )
            pid1 = up.service("r0").get("pid")
            lines = up.launcher_lines()
        finally:
            code = up.stop()
    return KillRun(up, ready_s, report, [pid0, pid1], lines, code)


def summary_of(args: argparse.Namespace, run: KillRun) -> dict[str, Any]:
    """The compact summary written to the result file."""
    report = run.report
    d = report.details
    return {
        "command": command_line(),
        "collm_up": " ".join(["python", *run.up.cmd[1:]]),
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count()},
        "model": args.model,
        "load": {
            "streams": args.concurrency, "max_tokens": args.max_tokens,
            "probes": "8-token streams every 0.2 s, at most 2 in flight",
        },
        "ready_s": round(run.ready_s, 1),
        "goals": {"first_new_served_s": 2.0, "serving_again_s": 60.0, "lost": 0},
        "first_new_accepted_s": d["first_new_accepted_s"],
        "first_new_served_s": d["first_new_served_s"],
        "restarted_s": d["restarted_s"],
        "serving_again_s": d["serving_again_s"],
        "fates": d["fates"],
        "requests": {
            "sent": report.sent, "after_kill": d["sent_after_kill"], "ok_after_kill": d["ok_after_kill"],
        },
        "kill": {
            "moment": d["kill_moment"], "victim_streams": d["victim_streams_at_kill"], "pids": run.pids,
        },
        "gateway_retries": d["gateway_retries"],
        "during_outage": d["during_outage"],
        "probe_ttft_s": d["probe_ttft_s"],
        "ttft_s": d["ttft_s"],
        "error_messages": d["error_messages"],
        "checks": report.checks,
        "failed_checks": report.failed_checks,
        "launcher_log": run.launcher_lines,
        "collm_up_exit_code": run.exit_code,
    }  # fmt: skip


def main(argv: Sequence[str]) -> int:
    """Kill r0 of a supervised `collm up` under load, write the summary, print its table; 1 when a check
    failed."""
    args = build_parser().parse_args(argv)
    run = kill_under_load(args)
    summary = summary_of(args, run)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1, default=str))
    print(table(summary))
    print(f"checks failed: {run.report.failed_checks or 'none'}; collm up exit code {run.exit_code}")
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes)")
    return 0 if not run.report.failed_checks else 1
