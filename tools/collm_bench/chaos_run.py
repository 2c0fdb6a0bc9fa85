"""The chaos loop of `python -m collm_bench adaptation run --chaos` (I/O; the pure rules are `chaos.py`).

`ChaosRun` runs in its own thread beside the benchmark's window, against a started `Stack` that
supervises its processes:

* kills: at each time of the schedule (`chaos.kill_schedule`), SIGKILL the process named (its pid from
  the launcher's supervision status), then measure the time to full service: the supervisor runs a new
  process in its place, `/readyz` lists every replica, and a short chat completion on a demo adapter
  answers 200 (polled every 0.5 s, at most `recovery_timeout_s`; None when it never did);
* samples: every `samples_every_s` one training sample (`POST /v1/samples`, admin key) for a demo domain,
  with its own `sample_id`; the ids answered 200 are the accepted ones;
* `samples_landed(run_dir)`: after the window, the sample ids in the replicas' local data
  (`<data_dir>/samples/collm-samples.jsonl`, where a replica writes a sample before acknowledging it).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

PROBE = {"messages": [{"role": "user", "content": "ping"}], "max_tokens": 2}


class ChaosRun:
    """See module docstring. `stack`: a started `collm_ops.launcher.Stack` (supervising)."""

    def __init__(
        self,
        stack: Any,
        schedule: Sequence[tuple[float, str]],
        t0_unix_s: float,
        admin_key: str,
        domains: Sequence[str],
        samples_every_s: float = 10.0,
        recovery_timeout_s: float = 180.0,
    ) -> None:
        self.stack = stack
        self.schedule = list(schedule)
        self.t0 = t0_unix_s
        self.url = stack.gateway_url
        self.admin = {"Authorization": f"Bearer {admin_key}"}
        self.domains = list(domains)
        self.samples_every_s = samples_every_s
        self.recovery_timeout_s = recovery_timeout_s
        self.replicas = {r.replica_id for r in stack.config.replicas}
        self.kills: list[dict[str, Any]] = []
        self.accepted: list[str] = []
        self.refused: Counter[str] = Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), name="chaos", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 240.0) -> None:
        """Stop after the kill in progress has recovered (or its wait has ended)."""
        self._stop.set()
        self._thread.join(timeout_s)

    async def _main(self) -> None:
        async with httpx.AsyncClient(timeout=10.0) as http:
            await asyncio.gather(self._kill_loop(http), self._sample_loop(http))

    async def _sleep_until(self, at_unix_s: float) -> bool:
        while not self._stop.is_set():
            left = at_unix_s - time.time()
            if left <= 0:
                return True
            await asyncio.sleep(min(left, 0.5))
        return False

    def _services(self) -> dict[str, Any]:
        return dict(self.stack.supervision_status().get("services", {}))

    async def _kill_loop(self, http: httpx.AsyncClient) -> None:
        for at_s, target in self.schedule:
            if not await self._sleep_until(self.t0 + at_s):
                return
            pid = self._services().get(target, {}).get("pid")
            entry: dict[str, Any] = {"t_s": round(time.time() - self.t0, 1), "target": target, "pid": pid}
            if not pid:
                entry["skipped"] = "not running at its turn"
                self.kills.append(entry)
                continue
            os.kill(int(pid), signal.SIGKILL)
            killed = time.monotonic()
            entry["recovery_s"] = await self._recovered(http, target, int(pid), killed)
            self.kills.append(entry)

    async def _recovered(
        self, http: httpx.AsyncClient, target: str, old_pid: int, killed_s: float
    ) -> float | None:
        while time.monotonic() - killed_s < self.recovery_timeout_s:
            st = self._services().get(target, {})
            if st.get("pid") not in (None, old_pid) and st.get("state") == "running":
                if await self.ready(http) and await self.probe(http):
                    return round(time.monotonic() - killed_s, 2)
            await asyncio.sleep(0.5)
        return None

    async def ready(self, http: httpx.AsyncClient) -> bool:
        try:
            r = await http.get(f"{self.url}/readyz")
            return r.status_code == 200 and self.replicas <= set(r.json().get("replicas", []))
        except (httpx.HTTPError, ValueError):
            return False

    async def probe(self, http: httpx.AsyncClient) -> bool:
        try:
            r = await http.post(
                f"{self.url}/v1/chat/completions", json={"model": self.domains[0], **PROBE}, timeout=30.0
            )
            return r.status_code == 200
        except httpx.HTTPError:
            return False

    async def _sample_loop(self, http: httpx.AsyncClient) -> None:
        i = 0
        while not self._stop.is_set():
            domain = self.domains[i % len(self.domains)]
            sid = f"chaos-{int(self.t0)}-{i}"
            sample = {"sample_id": sid, "domain": domain, "prompt": f"Question {i} about {domain}?",
                      "response": f"Answer {i} for {domain}."}  # fmt: skip
            body = {"samples": [sample]}
            try:
                r = await http.post(f"{self.url}/v1/samples", json=body, headers=self.admin)
                if r.status_code == 200:
                    self.accepted.append(sid)
                else:
                    self.refused[str(r.status_code)] += 1
            except httpx.HTTPError as exc:
                self.refused[type(exc).__name__] += 1
            i += 1
            await self._sleep_until(time.time() + self.samples_every_s)


def samples_landed(run_dir: Path) -> set[str]:
    """Every sample id in the replicas' local sample files under `run_dir`."""
    ids: set[str] = set()
    for path in run_dir.rglob("collm-samples.jsonl"):
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                ids.add(str(json.loads(line)["id"]))
            except (ValueError, KeyError, TypeError):
                continue
    return ids
