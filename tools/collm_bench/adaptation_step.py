"""collm's control live under a step in load: `collm up`'s stack, the demo adapters training, the replay's
rate stepping through fractions of the capacity estimate.

    flock /tmp/collm-heavy.lock .venv/bin/python -m collm_bench adaptation step \
        --load-fracs 0.3,0.7,0.3 --step-minutes 5

The stack is the one `adaptation run` starts (`collm up` with no options: two SmolLM2 replicas, the demo
domains, the collm policy, its default attainment target). Phase k's replay (the Azure conversation
trace, the experiments' length scaling and SLO rule, every request naming a demo adapter) starts at
k x step seconds at its own rate, from the trace's start, as the simulated step does
(`frontier.step`); a phase still draining overlaps the next. Watched on the side: every replica's
telemetry (its fine-tuning share, fine-tuning tokens per second over each interval) and the
coordinator's status every `--poll-s` (headroom, spend). Per minute of arrivals: attainment of the
requests that arrived in it (the loadgen's records, each judged against the SLO it was sent), mean
headroom and spend, and the replicas' summed share; fine-tuning tokens over the window. The result,
`bench/results/frontier/<name>.json`, has the simulated step's schema, so `frontier.step`'s table and
figure draw it (`python -m collm_bench readme --plots`). Run it under the machine's heavy-work lock,
on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from collm_bench.adaptation_run import default_stack_config, load_plan, start_loadgen, stop_on_sigterm
from collm_bench.frontier import step
from collm_bench.groups import REPO, RESULTS, add_run_dir, command_line, prog


@dataclass
class Watch:
    """What the side watcher saw, times in seconds since the stack was ready: telemetry rows (t, replica,
    share, fine-tuning tokens in the interval) and coordinator rows (t, headroom, spend)."""

    t0_unix_s: float
    telemetry: list[tuple[float, str, float, float]] = field(default_factory=list)
    coordinator: list[tuple[float, float, float]] = field(default_factory=list)

    async def on_telemetry(self, t: Any, _msg: object) -> None:
        self.telemetry.append(
            (t.ts_unix_s - self.t0_unix_s, t.replica_id, t.ft_share, t.ft_tokens_per_s * t.interval_s)
        )


def control_ticks(watch: Watch) -> list[tuple[float, float, float, float]]:
    """The coordinator's polled headroom and spend, each with the replicas' summed share then: every
    replica's latest telemetry share at or before the poll."""
    rows = sorted(watch.telemetry)
    out = []
    for t, headroom, spend in watch.coordinator:
        latest: dict[str, float] = {}
        for tt, rid, share, _ in rows:
            if tt > t:
                break
            latest[rid] = share
        out.append((t, headroom, spend, sum(latest.values())))
    return out


def load_arrivals(phase_dirs: Sequence[Path], t0_unix_s: float) -> list[tuple[float, bool]]:
    """Every phase's requests as (arrival in seconds since the stack was ready, met its SLO)."""
    from collm_workload.goodput import is_good
    from collm_workload.records import read_records

    out = []
    for d in phase_dirs:
        offset_s = json.loads((d / "summary.json").read_text())["run"]["started_unix_s"] - t0_unix_s
        out += [(offset_s + r.scheduled_s, is_good(r)) for r in read_records(d / "requests.jsonl")]
    return out


async def _watch(
    settings: Any, gateway_url: str, plans: Sequence[Mapping[str, Any]], step_s: float, run_dir: Path,
    watch: Watch, poll_s: float,
) -> list[Any]:  # fmt: skip
    """Start each phase's replay at its time and watch telemetry and the coordinator until the last phase's
    window ends; the load generators' processes (still draining)."""
    from collm_common import subjects
    from collm_common.bus import Bus
    from collm_common.wire.control import CoordinatorStatus, CoordinatorStatusRequest
    from collm_common.wire.telemetry import ReplicaTelemetry

    bus = await Bus.connect(settings, "collm-bench-step")
    gens: list[Any] = []
    try:
        await bus.subscribe(subjects.telemetry_all(), ReplicaTelemetry, watch.on_telemetry)
        end_s = step_s * len(plans)
        while (now_s := time.time() - watch.t0_unix_s) < end_s:
            while len(gens) < len(plans) and now_s >= len(gens) * step_s:
                k = len(gens)
                (run_dir / f"phase{k}").mkdir(parents=True, exist_ok=True)
                print(f"step: phase {k} at {plans[k]['rate_rps']:.3f} req/s", flush=True)
                gens.append(start_loadgen(gateway_url, dict(plans[k]), run_dir / f"phase{k}" / "loadgen"))
            try:
                st = await bus.request(
                    subjects.coordinator("status"), CoordinatorStatusRequest(), CoordinatorStatus, timeout_s=5
                )
                watch.coordinator.append((st.ts_unix_s - watch.t0_unix_s, st.headroom, st.spend))
            except Exception as e:  # noqa: BLE001 - a missed poll is a gap in the series, not a failure
                print(f"step: coordinator status: {e}", flush=True)
            await asyncio.sleep(poll_s)
    finally:
        await bus.close()
    return gens


def run(args: argparse.Namespace, command: str) -> int:
    from collm_coordinator.core import CoreConfig
    from collm_ops.launcher import Stack

    signal.signal(signal.SIGTERM, stop_on_sigterm)
    fracs = [float(x) for x in args.load_fracs.split(",")]
    step_s = args.step_minutes * 60.0
    run_dir = Path(args.run_dir) / f"{args.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir.mkdir(parents=True, exist_ok=True)
    plans = [load_plan(f, step_s) for f in fracs]
    stack = Stack(default_stack_config(run_dir))
    print(f"step: starting the default stack (logs in {run_dir / 'logs'})", flush=True)
    stack.start()
    watch = Watch(time.time())
    gens: list[Any] = []
    try:
        gens = asyncio.run(
            _watch(stack.operator_settings(), stack.gateway_url, plans, step_s, run_dir, watch, args.poll_s)
        )
        for g in gens:
            g.wait(timeout=300)
    finally:
        for g in gens:
            if g.poll() is None:
                g.terminate()
        stack.stop()
    arrivals = load_arrivals([run_dir / f"phase{k}" / "loadgen" for k in range(len(plans))], watch.t0_unix_s)
    series = step.step_series(arrivals, control_ticks(watch), [p["rate_rps"] for p in plans], step_s)
    tokens = sum(x[3] for x in watch.telemetry if 0 <= x[0] < step_s * len(plans))
    target = CoreConfig().attainment_target
    first = plans[0]
    doc = {
        "schema": step.SCHEMA,
        "trace": {"name": "conv", "label": f"live, `collm up`, {first['trace']}"},
        "config": {
            "replicas": len({x[1] for x in watch.telemetry}),
            "load_fractions": fracs,
            "step_s": step_s,
            "capacity_estimate_rps": first["capacity_estimate_rps"],
            "rates_rps": [p["rate_rps"] for p in plans],
            "slo": {"ttft_ms": first["slo_ttft_ms"], "tpot_ms": first["slo_tpot_ms"]},
            "default_target": target,
            "seed": None,
        },
        "runs": [
            {
                "knob": f"target {target:g} (default)",
                "core": {},
                "ft_tokens": round(tokens),
                "attainment": step.window_attainment(arrivals, step_s * len(plans)),
                "series": series,
            }
        ],
        "command": command,
    }
    out = RESULTS / "frontier" / f"{args.name}.json"
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"step: wrote {out.relative_to(REPO)}\n\n{step.table(doc)}", flush=True)
    print(f"step: figure {step.plot(doc, out.with_suffix('.png')).relative_to(REPO)}", flush=True)
    return 0


def main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog=prog("adaptation", "step"), description=__doc__.split("\n\n")[0])
    p.add_argument("--load-fracs", default="0.3,0.7,0.3", help="fractions of the capacity estimate, in turn")
    p.add_argument("--step-minutes", type=float, default=5.0, help="minutes of each load")
    p.add_argument("--poll-s", type=float, default=5.0, help="seconds between coordinator status polls")
    p.add_argument("--name", default="live-step-conv-2r", help="result file bench/results/frontier/NAME.json")
    add_run_dir(p, str(REPO / ".collm" / "bench-step"))
    args = p.parse_args(list(argv))
    return run(args, command_line(["adaptation", "step", *argv], lock=True))
