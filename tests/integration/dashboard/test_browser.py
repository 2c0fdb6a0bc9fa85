"""The dashboard in a real headless browser, on the real stack.

The launcher's `Stack` runs the aggregator, the coordinator, two replicas of the tiny model with small
local datasets and the gateway; the coordinator plans rounds of adapter `dash` (its v1 is in the store
before the start) as soon as both replicas report. Chromium from the distribution (`/usr/bin/chromium`,
driven by Playwright; no browser is ever downloaded) opens `/dashboard` and must show both replicas and,
once a round has published one, the new version, without a reload and without a console error. Then
the gateway restarts: a fresh gateway has seen none of the round's events, so the round in its snapshot
comes from the aggregator's round records.

With `COLLM_DASHBOARD_SCREENSHOT=<path>` the test also sends a little traffic, waits for one more
version, and saves a screenshot of the page there (how docs/dashboard.png is made).
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from collm_ops.launcher import ReplicaSpec, Stack, StackConfig
from collm_ops.servers import free_port, start_nats, start_redis
from tests.integration import seed

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ADAPTER = "dash"
SCREENSHOT = os.environ.get("COLLM_DASHBOARD_SCREENSHOT")

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        not CHROMIUM.exists(), reason="no /usr/bin/chromium (apt-get install chromium) to run the browser"
    ),
]

REPLICA_ENV = {
    "COLLM_TELEMETRY_INTERVAL_S": "0.5",
    "COLLM_ADAPTER_SYNC_INTERVAL_S": "1",
    "COLLM_TRAIN_MICRO_TOKENS": "32",
    "COLLM_TRAIN_BATCH_TOKENS": "64",
    "COLLM_TRAIN_MAX_SEQ_LEN": "48",
    "COLLM_EVAL_MAX_EXAMPLES": "6",
    "COLLM_PUBLISH_EVERY_STEPS": "2",
    "COLLM_ROUND_DEADLINE_MARGIN_S": "1",
    "COLLM_FT_SHARE_DEFAULT": "0.9",
}
COORDINATOR_ENV = {
    "COLLM_COORDINATOR_FAST_INTERVAL_S": "0.5",
    "COLLM_COORDINATOR_WARMUP_S": "1",
    "COLLM_COORDINATOR_SLOW_INTERVAL_S": "12",
    "COLLM_COORDINATOR_ROUND_DEADLINE_S": "11",
    "COLLM_COORDINATOR_ADAPTERS": json.dumps({ADAPTER: [ADAPTER]}),
    "COLLM_COORDINATOR_PROBE_BUDGET_TOKENS": "128",
    "COLLM_COORDINATOR_STORE_REFRESH_S": "1",
}
AGGREGATOR_ENV = {
    "COLLM_DEFAULT_PLAN": "false",
    "COLLM_EVAL_MAX_EXAMPLES": "6",
    "COLLM_EVAL_TIMEOUT_S": "60",
    "COLLM_CONTROL_TIMEOUT_S": "30",
}


def write_dataset(d: Path, n_train: int = 24, n_eval: int = 6) -> None:
    for split, n in (("train", n_train), ("eval", n_eval)):
        (d / split).mkdir(parents=True, exist_ok=True)
        with (d / split / f"{ADAPTER}.jsonl").open("w") as f:
            for i in range(n):
                row = {
                    "id": f"{split}-{i}",
                    "prompt": f"dash question {i}",
                    "response": f"dash answer {i % 3}",
                }
                f.write(json.dumps({**row, "domain": ADAPTER}) + "\n")


async def seed_v1(redis_url: str, prefix: str) -> None:
    await seed.seed_v1(redis_url, prefix, ADAPTER)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("dashboard")
    nats = start_nats(workdir=tmp / "nats")
    redis = start_redis(workdir=tmp / "redis")
    logs = io.StringIO()
    replicas = []
    for rid in ("r0", "r1"):
        write_dataset(tmp / f"data-{rid}")
        replicas.append(ReplicaSpec(rid, str(tmp / f"data-{rid}")))
    cfg = StackConfig(
        nats_url=nats.url,
        redis_url=redis.url,
        redis_prefix="dash",
        model="tiny",
        gateway_port=free_port(),
        replicas=replicas,
        start_servers=False,
        run_dir=tmp / "run",
        ready_timeout_s=180,
        service_env={"replica": REPLICA_ENV, "coordinator": COORDINATOR_ENV, "aggregator": AGGREGATOR_ENV},
    )
    asyncio.run(seed_v1(redis.url, "dash"))
    s = Stack(cfg, log_sink=logs)
    try:
        s.start()
    except Exception:
        print(logs.getvalue()[-5000:])
        nats.stop()
        redis.stop()
        raise
    try:
        yield s
    except Exception:
        print(logs.getvalue()[-5000:])
        raise
    finally:
        s.stop()
        nats.stop()
        redis.stop()
        if SCREENSHOT:
            print(logs.getvalue()[-3000:])


class Traffic:
    """A few chat completions a second against the gateway (so the replicas' latencies show)."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        body: dict[str, Any] = {
            "model": ADAPTER,
            "messages": [{"role": "user", "content": "dash question 1"}],
            "max_tokens": 8,
            "temperature": 0,
        }
        with httpx.Client(base_url=self.base_url, timeout=30) as http:
            while not self.stop.is_set():
                try:
                    http.post("/v1/chat/completions", json=body)
                except httpx.HTTPError:
                    pass
                self.stop.wait(0.3)

    def __enter__(self) -> Traffic:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(30)


def wait_ready(url: str, timeout_s: float = 60.0) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("the restarted gateway did not become ready")


def test_the_dashboard_shows_replicas_and_a_new_version_live_in_a_browser(stack: Stack) -> None:
    from playwright.sync_api import sync_playwright

    url = stack.gateway_url
    problems: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.on(
                "console",
                lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None,
            )
            page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
            page.goto(f"{url}/dashboard")
            page.wait_for_selector('[data-replica="r0"]', timeout=15_000)
            page.wait_for_selector('[data-replica="r1"]', timeout=15_000)
            page.wait_for_selector(f'[data-version-id="{ADAPTER}@v1"]', timeout=15_000)
            assert page.locator("#status").inner_text() == "live"
            page.evaluate("window.__sameDocument = true")  # gone if the page reloads

            page.wait_for_selector(f'[data-version-id="{ADAPTER}@v2"]', timeout=150_000)
            assert page.evaluate("window.__sameDocument === true"), "the page reloaded"
            page.wait_for_selector('#rounds tr[data-round-id][data-state="published"]', timeout=15_000)
            assert page.locator('#coordinator table[id="shares"] tr[data-decision-replica]').count() >= 1
            if SCREENSHOT:
                with Traffic(url):
                    page.wait_for_selector(f'[data-version-id="{ADAPTER}@v3"]', timeout=120_000)
                    time.sleep(3)
                    page.screenshot(path=SCREENSHOT, full_page=True)
            assert problems == []
        finally:
            browser.close()

    # A gateway that saw none of the round's events: its snapshot has the round from the aggregator's
    # records, and the new version with its held-out loss from the adapter store.
    stack.restart("gateway")
    wait_ready(url)
    snap = httpx.get(f"{url}/dashboard/state", timeout=10).json()
    published = [r for r in snap["rounds"] if r["state"] == "published" and r["adapter"] == ADAPTER]
    assert published and set(published[0]["participants"]) <= {"r0", "r1"} and published[0]["duration_s"] > 0
    (dash,) = [a for a in snap["adapters"] if a["name"] == ADAPTER]
    v2 = next(v for v in dash["versions"] if v["version"] == 2)
    assert v2["source"] == "round" and v2["quality"].get(ADAPTER) is not None
