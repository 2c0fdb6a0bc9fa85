"""Adaptation out of the box: the stack `collm up` starts, its adapters' held-out loss over a long window.

    flock /tmp/collm-heavy.lock .venv/bin/python -m collm_bench adaptation run --minutes 15 --load-frac 0
    flock /tmp/collm-heavy.lock .venv/bin/python -m collm_bench adaptation run --minutes 15 --load-frac 0.5
    .venv/bin/python -m collm_bench adaptation report [RESULT.json ...]     # table and PNG again

The first leaves the stack otherwise idle, the second replays a trace at half capacity.

`run` starts exactly what `collm up` starts with no options (`collm_ops.cli.stack_config`: two replicas
with SmolLM2, each holding its share of every demo domain, the collm policy), on its own NATS and Redis
on free ports, and waits until it is ready (time 0). With `--load-frac F > 0` it replays the Azure
conversation trace (the experiments' length scaling and SLO rule, from the calibration file) through the
gateway at F x the estimated capacity, every request naming a demo adapter (equal mix); otherwise the
stack only trains. After `--minutes` it reads every adapter version with its creation time and quality
record and every round from the stack, stops it, and writes the compact result
`bench/results/adaptation/<name>.json` (`collm_bench.adaptation`), its table and its figure beside it,
`<name>.png`. Run it under the machine's heavy-work lock, on an otherwise idle
machine.

With `--chaos` the launcher also supervises the stack (as `collm up` does) and a chaos loop SIGKILLs a
random process of it (replicas, gateway, coordinator, aggregator, NATS, Redis) every 30-90 s
(`collm_bench.chaos.kill_schedule`, `--chaos-seed`), measuring each kill's time to full service, while
training samples are uploaded every 10 s (`collm_bench.chaos_run`). After the window it waits for full
service, checks that every accepted sample reached a replica's data and every stored adapter blob its
sha256, and writes `bench/results/faults/chaos.json` (`collm_bench.chaos`), with the served loss at the
end beside that of the result `--baseline` (the same run without chaos):

    .venv/bin/python -m collm_bench adaptation run --minutes 20 --load-frac 0.5 --name load0.5-20min
    .venv/bin/python -m collm_bench adaptation run --minutes 20 --load-frac 0.5 --chaos \
        --name load0.5-20min-chaos --baseline bench/results/adaptation/load0.5-20min.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from collm_bench.groups import CALIBRATION, REPO, RESULTS, add_run_dir, command_line
from collm_bench.host import host_info

if TYPE_CHECKING:
    from collm_common.settings import CommonSettings

ADAPTATION_RESULTS = RESULTS / "adaptation"


def default_stack_config(run_dir: Path) -> Any:
    """What `collm up` with no options starts, on its own NATS and Redis on free ports, state and logs in
    `run_dir`, no metrics ports."""
    from collm_ops.cli import build_parser, stack_config
    from collm_ops.servers import free_port

    args = build_parser().parse_args(
        [
            "up",
            "--port", str(free_port()),
            "--nats-url", f"nats://127.0.0.1:{free_port()}",
            "--redis-url", f"redis://127.0.0.1:{free_port()}/0",
            "--run-dir", str(run_dir),
            "--metrics-port-base", "-1",
        ]
    )  # fmt: skip
    cfg = stack_config(args)
    cfg.log_dir = run_dir / "logs"
    return cfg


def load_plan(load_frac: float, window_s: float) -> dict[str, Any]:
    """Rate and SLO of the replay: the experiments' length policy and SLO rule on the conv trace."""
    from collm_bench.experiment.config import ExperimentConfig
    from collm_bench.experiment.rates import capacity_estimate_rps
    from collm_bench.experiment.setup import lengths, resolve_sources, slo_for
    from collm_common.calibration import Calibration
    from collm_workload.traces import fit_lengths

    hc = ExperimentConfig(traces=("conv",))
    cal = Calibration.load(CALIBRATION)
    source = resolve_sources(hc)[0]
    slo = slo_for(hc, source, cal, max_batch=16)
    fitted = fit_lengths(list(source.requests[:2000]), lengths(hc))
    mean_in = sum(r.input_tokens for r in fitted) / len(fitted)
    mean_out = sum(r.output_tokens for r in fitted) / len(fitted)
    cost = cal.cost
    capacity = capacity_estimate_rps(
        cost.prefill_ms_per_token, cost.decode_ms(16), 16, cost.lora_overhead_frac_per_adapter, mean_in,
        mean_out, replicas=2,
    )  # fmt: skip
    return {
        "trace": source.label(hc),
        "load_frac": load_frac,
        "capacity_estimate_rps": round(capacity, 4),
        "rate_rps": round(load_frac * capacity, 4),
        "window_s": window_s,
        "slo_ttft_ms": slo.ttft_ms,
        "slo_tpot_ms": slo.tpot_ms,
        "mean_input_tokens": round(mean_in, 1),
        "mean_output_tokens": round(mean_out, 1),
        "hc": hc,
    }


def start_loadgen(gateway_url: str, plan: dict[str, Any], out: Path) -> subprocess.Popen[bytes]:
    """The replay of `plan` (`load_plan`) through the gateway as a `collm_bench loadgen` process writing its
    records to `out`, its output to `out.parent / "loadgen.log"`."""
    hc = plan["hc"]
    cmd = [
        sys.executable, "-m", "collm_bench", "loadgen",
        "--url", gateway_url,
        "--trace", "conv",
        "--rate", str(plan["rate_rps"]),
        "--duration", str(plan["window_s"]),
        "--input-scale", str(hc.input_scale),
        "--output-scale", str(hc.output_scale),
        "--max-output-tokens", str(hc.max_output_tokens),
        "--max-context-tokens", str(hc.max_context_tokens),
        "--domains-dir", str(REPO / "data" / "demo"),
        "--slo-ttft-ms", str(plan["slo_ttft_ms"]),
        "--slo-tpot-ms", str(plan["slo_tpot_ms"]),
        "--send-slo",
        "--drain-timeout-s", "120",
        "--progress-interval-s", "60",
        "--out", str(out),
    ]  # fmt: skip
    return subprocess.Popen(cmd, stdout=(out.parent / "loadgen.log").open("wb"), stderr=subprocess.STDOUT)


async def _read_stack(settings: CommonSettings) -> dict[str, Any]:
    """Every adapter's versions and quality records (store) and every round (the aggregator)."""
    from collm_common import subjects
    from collm_common.bus import Bus
    from collm_common.store import AdapterStore
    from collm_common.wire.admin import ListRounds, RoundList

    store = AdapterStore.from_url(settings.redis_url, settings.redis_prefix)
    adapters: dict[str, Any] = {}
    try:
        for name in await store.list_adapters():
            versions = await store.list_versions(name)
            adapters[name] = {
                "versions": [
                    {"version": v.version, "created_unix_s": v.created_unix_s, "source": v.source}
                    for v in versions
                ],
                "quality": {v.version: await store.quality(name, v.version) for v in versions},
                "task": {v.version: await store.task_quality(name, v.version) for v in versions},
            }
    finally:
        await store.close()
    bus = await Bus.connect(settings, "collm-bench-adaptation")
    try:
        rounds = await bus.request(
            subjects.aggregator("rounds"), ListRounds(limit=1000), RoundList, timeout_s=10
        )
    finally:
        await bus.close()
    return {"adapters": adapters, "rounds": [r.model_dump() for r in rounds.rounds]}


def stop_on_sigterm(*_: object) -> None:
    raise KeyboardInterrupt  # the stack and the load generator are stopped on the way out


@dataclass
class _Window:
    """One run of the stack for the window: when it became ready (time 0), what was read from it at the
    end, and the chaos loop with what was checked after it (when `--chaos`)."""

    t0: float
    snap: dict[str, Any]
    monkey: Any
    chaos_extra: dict[str, Any]


def run(args: argparse.Namespace, command: str) -> int:
    """Run the default stack for the window (with load and chaos as asked), write the result, print its
    table and draw its figure."""
    from collm_bench import adaptation
    from collm_ops.launcher import Stack

    signal.signal(signal.SIGTERM, stop_on_sigterm)

    name = args.name or ("idle" if args.load_frac <= 0 else f"load{args.load_frac:g}")
    run_dir = Path(args.run_dir) / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir.mkdir(parents=True, exist_ok=True)
    window_s = args.minutes * 60.0
    plan = load_plan(args.load_frac, window_s) if args.load_frac > 0 else None
    cfg = default_stack_config(run_dir)
    admin_key = secrets.token_urlsafe(24)
    if args.chaos:
        cfg.service_env.setdefault("gateway", {})["COLLM_ADMIN_KEY"] = admin_key
    stack = Stack(cfg)
    print(f"adaptation: starting the default stack (logs in {cfg.log_dir})", flush=True)
    win = _run_window(stack, args, plan, run_dir, admin_key)
    from collm_replica.settings import ReplicaSettings  # the replicas' precision, from this environment

    replica = ReplicaSettings()
    precision = {"matmul_dtype": replica.matmul_dtype, "small_step_f16_rows": replica.small_step_f16_rows}
    result: dict[str, Any] = {
        "schema": adaptation.RESULT_SCHEMA,
        "name": name,
        "title": f"collm up: demo adapters, {'idle' if plan is None else f'{args.load_frac:g} x capacity'}",
        "command": command,
        "started_unix_s": round(win.t0, 1),
        "window_s": window_s,
        "ready_s": round(stack.ready_s or 0.0, 1),
        "adapters": {},
        "rounds": adaptation.round_summary(win.snap["rounds"], win.t0),
        "serving": None,
        "host": host_info() | precision,
    }
    for adapter, a in sorted(win.snap["adapters"].items()):
        points = adaptation.version_points(a["versions"], a["quality"], adapter, win.t0, a.get("task"))
        result["adapters"][adapter] = {
            "versions": points,
            "summary": adaptation.adapter_summary(points, window_s),
        }
    if plan is not None:
        result["serving"] = _serving(plan, run_dir / "loadgen" / "summary.json")
    ADAPTATION_RESULTS.mkdir(parents=True, exist_ok=True)
    path = ADAPTATION_RESULTS / f"{name}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"adaptation: wrote {path.relative_to(REPO)}", flush=True)
    if win.monkey is not None:
        _write_chaos(args, result, run_dir, win.monkey, win.chaos_extra)
    return report_one(path)


def _run_window(
    stack: Any, args: argparse.Namespace, plan: dict[str, Any] | None, run_dir: Path, admin_key: str
) -> _Window:
    """Start the stack, run the chaos loop and the replay as asked for `--minutes`, read the stack's
    adapters and rounds, then stop the load generator and the stack."""
    window_s = args.minutes * 60.0
    stack.start()
    t0 = time.time()
    print(f"adaptation: ready in {stack.ready_s:.1f} s; {args.minutes:g} min window", flush=True)
    gen = None
    monkey = None
    chaos_extra: dict[str, Any] = {}
    try:
        if args.chaos:
            monkey = _start_chaos(stack, t0, window_s, args.chaos_seed, admin_key)
        if plan is not None:
            print(f"adaptation: replaying at {plan['rate_rps']:.3f} req/s", flush=True)
            gen = start_loadgen(stack.gateway_url, plan, run_dir / "loadgen")
        while time.time() - t0 < window_s:
            time.sleep(min(30.0, window_s - (time.time() - t0)))
            print(f"adaptation: {(time.time() - t0) / 60:.1f} min", flush=True)
        if monkey is not None:
            monkey.stop()
            chaos_extra = asyncio.run(_after_chaos(stack, monkey, run_dir))
        snap = asyncio.run(_read_stack(stack.operator_settings()))
        if gen is not None:
            gen.wait(timeout=300)
    finally:
        if gen is not None and gen.poll() is None:
            gen.terminate()
        stack.stop()
    return _Window(t0, snap, monkey, chaos_extra)


def _serving(plan: dict[str, Any], summary_path: Path) -> dict[str, Any]:
    """The replay's settings and what the load generator's summary says of it."""
    s = json.loads(summary_path.read_text())
    lat = s["latency_ms"]
    return {
        k: plan[k]
        for k in ("trace", "load_frac", "capacity_estimate_rps", "rate_rps", "slo_ttft_ms", "slo_tpot_ms")
    } | {
        "requests": s["counts"]["submitted"],
        "completed": s["counts"]["completed"],
        "attainment": s["attainment"],
        "goodput_rps": s["goodput_rps"],
        "ttft_ms_p50": lat["ttft"]["p50"],
        "ttft_ms_p99": lat["ttft"]["p99"],
        "tpot_ms_p50": lat["tpot"]["p50"],
        "tpot_ms_p99": lat["tpot"]["p99"],
        "by_status": s["counts"]["by_status"],
    }


def _start_chaos(stack: Any, t0: float, window_s: float, seed: int, admin_key: str) -> Any:
    from collm_bench.chaos import kill_schedule
    from collm_bench.chaos_run import ChaosRun
    from collm_data.demo import DEMO_DOMAINS

    stack.supervise()
    targets = sorted(n for n, st in stack.supervision_status()["services"].items() if st.get("pid"))
    schedule = kill_schedule(seed, window_s, targets)
    print(f"adaptation: chaos over {', '.join(targets)}: {len(schedule)} kills", flush=True)
    monkey = ChaosRun(stack, schedule, t0, admin_key, [d.domain for d in DEMO_DOMAINS])
    monkey.start()
    return monkey


async def _after_chaos(stack: Any, monkey: Any, run_dir: Path) -> dict[str, Any]:
    """Wait for full service and for the accepted samples to land (at most 3 minutes each), then check
    every stored adapter blob against its sha256."""
    import httpx

    from collm_bench.chaos_run import samples_landed
    from collm_common.store import AdapterStore, CorruptBlob, NotFound

    t = time.monotonic()
    async with httpx.AsyncClient(timeout=10.0) as http:
        while time.monotonic() - t < 180 and not (await monkey.ready(http) and await monkey.probe(http)):
            await asyncio.sleep(1.0)
    settled_s = round(time.monotonic() - t, 1)
    accepted = set(monkey.accepted)
    while time.monotonic() - t < 360 and not accepted <= samples_landed(run_dir):
        await asyncio.sleep(2.0)
    landed = samples_landed(run_dir)
    settings = stack.operator_settings()
    store = AdapterStore.from_url(settings.redis_url, settings.redis_prefix)
    checked = mismatch = 0
    try:
        for name in await store.list_adapters():
            for rec in await store.list_versions(name):
                if rec.pruned:
                    continue
                checked += 1
                try:
                    await store.get_blob(name, rec.version)
                except (CorruptBlob, NotFound):
                    mismatch += 1
    finally:
        await store.close()
    return {
        "settled_s": settled_s,
        "samples": {"accepted": len(accepted), "lost": len(accepted - landed),
                    "refused": dict(monkey.refused)},
        "versions": {"checked": checked, "digest_mismatch": mismatch},
    }  # fmt: skip


def _write_chaos(
    args: argparse.Namespace, result: dict[str, Any], run_dir: Path, monkey: Any, extra: dict[str, Any]
) -> None:
    from collm_bench import chaos

    records = [
        json.loads(line)
        for line in (run_dir / "loadgen" / "requests.jsonl").read_text().splitlines()
        if line.strip()
    ]
    base_adapters = json.loads(Path(args.baseline).read_text())["adapters"] if args.baseline else {}
    quality = {
        name: {
            "base": a["summary"]["base_loss"],
            "chaos": a["summary"]["final_loss"],
            "no_chaos": base_adapters.get(name, {}).get("summary", {}).get("final_loss"),
        }
        for name, a in result["adapters"].items()
    }
    summary: dict[str, Any] = {
        "schema": chaos.RESULT_SCHEMA,
        "command": result["command"],
        "baseline": args.baseline,
        "window_s": result["window_s"],
        "seed": args.chaos_seed,
        "serving": result["serving"],
        "requests": chaos.fates(records),
        "kills": monkey.kills,
        "recovery": chaos.recovery(monkey.kills),
        "rounds_published": result["rounds"]["by_state"].get("published", 0),
        "quality": quality,
        **extra,
    }
    summary["goals"] = chaos.verdicts(summary)
    out = RESULTS / "faults" / "chaos.json"
    out.write_text(json.dumps(summary, indent=1) + "\n")
    print(chaos.table(summary))
    print(f"goals: {summary['goals']}")
    print(f"adaptation: wrote {out.relative_to(REPO)}", flush=True)


def _shown(path: Path) -> Path:
    """`path` relative to the repository when it lies in it, else as given."""
    return path.relative_to(REPO) if path.is_absolute() and path.is_relative_to(REPO) else path


def report_one(path: Path) -> int:
    """Print the table of one result file and draw its figure beside it."""
    from collm_bench import adaptation

    result = json.loads(path.read_text())
    print(adaptation.table(result))
    fig = adaptation.plot(result, path.with_suffix(".png"))
    print(f"figure: {_shown(fig)}")
    return 0


def main(argv: Sequence[str]) -> int:
    """`run` (argv[0]): run the stack and write the result; `report`: the tables and figures again."""
    p = argparse.ArgumentParser(prog="python -m collm_bench adaptation", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run the default stack for a window and write the result")
    r.add_argument("--minutes", type=float, default=15.0)
    r.add_argument("--load-frac", type=float, default=0.0, help="trace rate / estimated capacity (0: idle)")
    r.add_argument("--name", default=None, help="result name (default: idle or load<F>)")
    add_run_dir(r, str(REPO / ".collm" / "bench-adaptation"))
    r.add_argument("--chaos", action="store_true", help="SIGKILL a random process every 30-90 s")
    r.add_argument("--chaos-seed", type=int, default=1, help="the kill schedule's seed")
    r.add_argument("--baseline", default=None, help="the same run's result without chaos (quality)")
    rep = sub.add_parser("report", help="print the table and draw the figure of result files")
    rep.add_argument("results", nargs="*", type=Path)
    args = p.parse_args(argv)
    if args.cmd == "run":
        return run(args, command_line(["adaptation", *argv], lock=True))
    paths = args.results or sorted(ADAPTATION_RESULTS.glob("*.json"))
    for path in paths:
        print(f"## {_shown(path)}")
        report_one(path.resolve())
    return 0
