"""One policy on the live stack: start everything, replay the plan while rounds run, measure, stop.

Per run, in order:

1. a fresh stack through the launcher (`collm_ops.launcher.Stack`): its own nats-server and
   redis-server on free ports, the aggregator (built-in plans off: only the coordinator plans), the
   coordinator with the policy under test (and the calibration's priors), N replicas each with a private
   copy of its domain's local data and the policy's co-scheduler (`COLLM_COSCHEDULER`: collm and
   separate `slo`, fixed_ratio `fixed`, leftover `leftover`, as `collm_sim.plugins` maps them), the
   gateway; it checks that the coordinator reports the policy asked for;
2. every domain's adapter gets its v1 (a zero-B LoRA created by a replica holding the domain, exactly
   the base model's behaviour) and is made resident on every replica;
3. the load generator replays the plan (open loop, streamed, per-request SLOs sent) while the
   coordinator plans federated rounds; telemetry and round outcomes are recorded on the side, and the
   replicas' fine-tuning token counters (Prometheus) are read before and after the replay;
4. the base model's held-out loss per domain, measured by the replicas holding that domain (the
   bounded eval set the aggregator's gate also scores), so quality gains are known even for a policy
   that never publishes: it depends only on the model, the domains' held-out data and the eval bounds
   (v1 adds exactly zero), so a benchmark measures it in its first run and passes it to the others
   (`base`); it is measured after the replay so that every run's steps before the replay are the same
   (so in every run the aggregator's gate scores v1 itself when the first round collects: a
   measurement before the replay would have left that score in the replica's evaluation cache);
5. the summary (`collm_workload.goodput.summarize`) joins every served request with the held-out loss of
   the version that served it (published versions: the aggregator's records in the store);
6. the stack stops (in reverse order); its logs stay in the run directory.

Each step's wall time is kept (`phases_s`, in order: stack start, connect, v1, resident, gateway
models, arrivals, drain, base loss (first run only), read-out, stack stop) and logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx
import psutil

from collm_bench.client import ClientOptions, endpoint_url
from collm_bench.runner import run_plan
from collm_common import subjects
from collm_common.bus import Bus, BusError
from collm_common.store import AdapterStore, version_id
from collm_common.wire.control import (
    ControlReply,
    CoordinatorDecisions,
    CoordinatorStatus,
    CoordinatorStatusRequest,
    StartTraining,
    StopTraining,
    SyncAdapter,
)
from collm_common.wire.rounds import EvalReport, EvaluateCandidate, RoundOutcome
from collm_common.wire.telemetry import ReplicaTelemetry
from collm_ops.launcher import ReplicaSpec, Stack, StackConfig
from collm_ops.servers import free_port
from collm_sim.config import EngineSpec
from collm_sim.plugins import series_setup
from collm_workload.goodput import summarize
from collm_workload.quality import QualityTable
from collm_workload.records import write_records
from collm_workload.workload import PlannedRequest

from .config import ExperimentConfig
from .signals import interrupt_on_sigterm, signals_deferred, stopping

FINAL_ROUND_STATES = ("published", "held_back", "aborted")
REDIS_PREFIX = "experiment"


class LiveRunError(RuntimeError):
    pass


@dataclass
class Phases:
    """Wall seconds of each step of a run, in the order they ran."""

    t: float = field(default_factory=time.monotonic)
    seconds: dict[str, float] = field(default_factory=dict)

    def mark(self, name: str) -> None:
        """The step `name` ended now (it began at the previous mark)."""
        now = time.monotonic()
        self.seconds[name] = now - self.t
        self.t = now

    def line(self) -> str:
        return ", ".join(f"{k.replace('_', ' ')} {v:.1f}" for k, v in self.seconds.items()) + " (s)"


def stack_config(
    cfg: ExperimentConfig,
    policy: str,
    replica_data: dict[str, Path],
    run_dir: Path,
    knob_env: Mapping[str, Mapping[str, str]] | None = None,
) -> StackConfig:
    """The launcher's configuration of one run (pure apart from picking free ports); `knob_env`: more
    environment per service (coordinator, aggregator, gateway, replica), set last."""
    nats_port, redis_port, gateway_port = free_port(), free_port(), free_port()
    coordinator = {
        "COLLM_COORDINATOR_SLOW_INTERVAL_S": str(cfg.slow_interval_s),
        "COLLM_COORDINATOR_ROUND_DEADLINE_S": str(cfg.round_deadline_s),
        "COLLM_COORDINATOR_ROUNDS": cfg.rounds,
        "COLLM_COORDINATOR_WARMUP_S": str(cfg.coordinator_warmup_s),
    }
    if cfg.calibration is not None:
        coordinator["COLLM_COORDINATOR_CALIBRATION_PATH"] = str(cfg.calibration)
    # No task-metric probes: their generations are the same work under every policy, the simulator
    # models none, and the run's quality is the held-out loss (`quality_joined`).
    aggregator = {
        "COLLM_DEFAULT_PLAN": "false",
        "COLLM_EVAL_MAX_EXAMPLES": str(cfg.eval_max_examples),
        "COLLM_EVAL_MAX_TOKENS": str(cfg.eval_max_tokens),
        "COLLM_EVAL_TASK_EXAMPLES": "0",
    }
    gateway = {"COLLM_REQUEST_DEADLINE_S": str(max(cfg.request_timeout_s, 60.0))}
    # A training job scores its live copy on the held-out set before it trains (and after, and every few
    # optimizer steps); on a CPU the default 32 examples take most of a short round, so the benchmark
    # bounds every evaluation (the job's and the aggregator's gate) alike.
    # No prefix caching: the simulator models none. The batch bound is the one the simulator models (its
    # calibration's, `collm_sim.config.EngineSpec`).
    replica = {
        "COLLM_EVAL_MAX_EXAMPLES": str(cfg.eval_max_examples),
        "COLLM_EVAL_MAX_TOKENS": str(cfg.eval_max_tokens),
        "COLLM_PREFIX_CACHING": "false",
        "COLLM_MAX_BATCH": str(EngineSpec().max_batch),
    }
    coord_policy, cos = series_setup(policy)
    # Every replica logs its steps (`collm_common.step_log`) into the run's directory.
    replicas = [
        ReplicaSpec(
            rid,
            data_dir=str(replica_data[rid]),
            env={"COLLM_COSCHEDULER": cos, "COLLM_STEP_LOG_PATH": str(step_log_path(run_dir, rid))},
        )
        for rid in cfg.replica_ids()
    ]
    service_env = {
        "coordinator": coordinator,
        "aggregator": aggregator,
        "gateway": gateway,
        "replica": replica,
    }
    for service, env in (knob_env or {}).items():
        if service not in service_env:
            raise ValueError(f"knob_env: no service {service!r} (have {', '.join(service_env)})")
        service_env[service].update(env)
    return StackConfig(
        nats_url=f"nats://127.0.0.1:{nats_port}",
        redis_url=f"redis://127.0.0.1:{redis_port}/0",
        redis_prefix=REDIS_PREFIX,
        model=cfg.model,
        gateway_port=gateway_port,
        replicas=replicas,
        coordinator_policy=coord_policy,
        torch_threads=cfg.torch_threads,
        service_env=service_env,
        start_servers=True,
        run_dir=run_dir / "stack",
        ready_timeout_s=cfg.ready_timeout_s,
        metrics_port_base=0,
    )


def step_log_path(run_dir: Path, replica_id: str) -> Path:
    return run_dir / "stack" / f"steps-{replica_id}.jsonl"


@dataclass
class Observer:
    """Telemetry and round outcomes seen during a run, timestamped on this process's monotonic clock."""

    t0: float = field(default_factory=time.perf_counter)
    telemetry: list[dict[str, Any]] = field(default_factory=list)
    rounds: dict[int, dict[str, Any]] = field(default_factory=dict)
    # The coordinator's fast-loop share decisions, one row per replica whenever its share or the reason
    # for it changed (the fast loop ticks every second; unchanged rows are left out).
    shares: list[dict[str, Any]] = field(default_factory=list)
    _last_share: dict[str, tuple[float, str]] = field(default_factory=dict)
    # When the coordinator's slow loop ran (its decisions on the `slow` loop; round plans follow them).
    slow_ticks: list[float] = field(default_factory=list)

    def now(self) -> float:
        return time.perf_counter() - self.t0

    async def on_telemetry(self, t: ReplicaTelemetry, _msg: object) -> None:
        self.telemetry.append(
            {
                "t_s": self.now(),
                "replica": t.replica_id,
                "ft_share": t.ft_share,
                "ft_tokens_per_s": t.ft_tokens_per_s,
                "running": t.running,
                "queue": t.queue_len,
                "train_busy_frac": t.train_busy_frac,
                # What the replica's engine measured online (beside the calibration's figures).
                "infer_busy_frac": t.infer_busy_frac,
                "decode_step_ms": t.decode_step_ms,
                "prefill_ms_per_token": t.prefill_ms_per_token,
                "jobs": [
                    [j.adapter, j.state, j.round_id, j.tokens_done, j.token_budget, j.message]
                    for j in t.training_jobs
                ],
            }
        )

    async def on_decision(self, d: CoordinatorDecisions, _msg: object) -> None:
        if d.loop == "slow":
            self.slow_ticks.append(self.now())
            return
        if d.loop != "fast":
            return
        for r in d.replicas:
            key = (r.ft_share, r.reason)
            if self._last_share.get(r.replica_id) != key:
                self._last_share[r.replica_id] = key
                self.shares.append(
                    {
                        "t_s": self.now(),
                        "replica": r.replica_id,
                        "ft_share": r.ft_share,
                        "reason_code": r.reason_code,
                        "reason": r.reason,
                    }
                )

    async def on_round(self, o: RoundOutcome, _msg: object) -> None:
        row = self.rounds.setdefault(o.round_id, {"round_id": o.round_id, "adapter": o.adapter})
        row[f"{o.state}_t_s"] = self.now()
        row["state"] = o.state
        if o.state in FINAL_ROUND_STATES:
            row.update(
                {
                    "new_version": o.new_version,
                    "accepted": list(o.accepted),
                    "participants": list(o.participants),
                    "domain_losses_before": dict(o.domain_losses_before),
                    "domain_losses_after": dict(o.domain_losses_after),
                    "reason": o.reason,
                }
            )

    def round_counts(self, start_s: float, end_s: float) -> dict[str, int]:
        """Rounds that ended in [start_s, end_s], by final state, and rounds opened in it."""
        out = {"opened": 0, **dict.fromkeys(FINAL_ROUND_STATES, 0)}
        for row in self.rounds.values():
            opened = row.get("opened_t_s")
            if opened is not None and start_s <= opened <= end_s:
                out["opened"] += 1
            state = row.get("state")
            t = row.get(f"{state}_t_s")
            if state in FINAL_ROUND_STATES and t is not None and start_s <= t <= end_s:
                out[str(state)] += 1
        return out


def parse_counter(text: str, name: str, by: str = "replica") -> dict[str, float]:
    """{value of label `by`: sum of the samples with it} of a Prometheus counter family in exposition
    text (pure)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in (name, f"{name}_total"):
                key = s.labels.get(by, "")
                out[key] = out.get(key, 0.0) + float(s.value)
    return out


async def read_ft_counters(stack: Stack) -> dict[str, dict[str, float]]:
    """Per replica: `ft_tokens` (its `collm_replica_ft_tokens_total`, tokens its co-executed fine-tuning
    processed), per limit the serving iterations whose training that limit bounded, and `busy_s_<work>`,
    the seconds its engine spent on inference, training and evaluation, `forward_s`, the seconds of its
    inference iterations spent in the model's forward passes, and `inference_tokens`, the prompt tokens
    it prefilled and the output tokens it generated."""
    out: dict[str, dict[str, float]] = {}
    urls = {n: u for n, u in stack.metrics_urls().items() if n.startswith("replica-")}
    async with httpx.AsyncClient(timeout=5.0, trust_env=False) as http:
        for name, url in sorted(urls.items()):
            r = await http.get(url)
            r.raise_for_status()
            tokens = sum(parse_counter(r.text, "collm_replica_ft_tokens").values())
            limits = parse_counter(r.text, "collm_replica_ft_limit_iterations", by="limit")
            busy = parse_counter(r.text, "collm_replica_busy_seconds", by="work")
            forward = sum(parse_counter(r.text, "collm_replica_inference_forward_seconds").values())
            served = sum(parse_counter(r.text, "collm_replica_prefill_tokens").values()) + sum(
                parse_counter(r.text, "collm_replica_generated_tokens").values()
            )
            out[name.removeprefix("replica-")] = {
                "ft_tokens": tokens,
                "forward_s": forward,
                "inference_tokens": served,
                **limits,
                **{f"busy_s_{work}": s for work, s in busy.items()},
            }
    return out


async def coordinator_policy(bus: Bus) -> str:
    st = await bus.request(
        subjects.coordinator("status"), CoordinatorStatusRequest(), CoordinatorStatus, timeout_s=10
    )
    return st.policy


async def create_adapters(bus: Bus, store: AdapterStore, cfg: ExperimentConfig) -> None:
    """v1 of each domain adapter, created by a replica holding the domain (as replicas create them: a
    zero-B LoRA of the loaded base model), tagged with its domain so the aggregator's gate evaluates it
    on that domain's held-out data."""
    for d in sorted(cfg.domains):
        holders = cfg.replicas_of(d)
        if not holders:
            raise LiveRunError(f"no replica holds domain {d!r}")
        ctl = subjects.replica(holders[0], "control")
        if await store.current(d) is None:
            await bus.request(ctl, StartTraining(adapter=d, token_budget=1), ControlReply, timeout_s=120)
            await bus.request(ctl, StopTraining(adapter=d), ControlReply, timeout_s=60)
        await store.set_meta(d, {"domains": d})


async def make_resident(bus: Bus, cfg: ExperimentConfig) -> None:
    """Every adapter's current version resident on every replica before the first request."""
    for rid in cfg.replica_ids():
        for d in sorted(cfg.domains):
            reply = await bus.request(
                subjects.replica(rid, "control"), SyncAdapter(adapter=d), ControlReply, timeout_s=60
            )
            if not reply.ok:
                raise LiveRunError(f"{rid} could not load {d}: {reply.message}")


async def base_losses(bus: Bus, store: AdapterStore, cfg: ExperimentConfig) -> dict[str, float]:
    """Held-out loss of the base model per domain, example-weighted over the replicas holding it (all
    replicas score at once). Each replica scores it beside the adapter's current version (the base model
    is the evaluation's `current_version` None): the current version is never pruned, while v1 (the base
    model's behaviour) can be after a long run's publications."""
    current = {d: await store.current(d) or 1 for d in sorted(cfg.domains)}

    async def one(rid: str, d: str) -> tuple[str, EvalReport]:
        req = EvaluateCandidate(
            adapter=d,
            candidate_key="",
            candidate_sha256="",
            candidate_version=current[d],
            score_current=True,
            current_version=None,
            max_examples=cfg.eval_max_examples,
            max_tokens=cfg.eval_max_tokens,
        )
        return d, await bus.request(subjects.replica(rid, "evaluate"), req, EvalReport, timeout_s=300)

    reports = await asyncio.gather(*(one(r, d) for d in sorted(cfg.domains) for r in cfg.replicas_of(d)))
    sums: dict[str, list[float]] = {}
    for d, rep in reports:
        for loss in rep.losses:
            if loss.domain == d and loss.num_examples > 0 and loss.current_loss is not None:
                acc = sums.setdefault(d, [0.0, 0.0])
                acc[0] += loss.current_loss * loss.num_examples
                acc[1] += loss.num_examples
    return {d: total / n for d, (total, n) in sums.items()}


async def quality_table(store: AdapterStore, cfg: ExperimentConfig, base: dict[str, float]) -> QualityTable:
    """Base losses measured at the start; every version's losses as the aggregator recorded them (v1,
    the zero-B adapter, is the base model when the store has no record of it)."""
    table = QualityTable(base=dict(base))
    for d in sorted(cfg.domains):
        for rec in await store.list_versions(d):
            losses = await store.quality(d, rec.version)
            if losses:
                table.versions[version_id(d, rec.version)] = dict(losses)
            elif rec.version == 1 and d in base:
                table.versions[version_id(d, 1)] = {d: base[d]}
    return table


async def wait_models(url: str, names: Sequence[str], timeout_s: float = 60.0) -> None:
    """Until the gateway lists every adapter (its model cache refreshes every few seconds)."""
    end = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=5.0, trust_env=False) as http:
        while time.monotonic() < end:
            with contextlib.suppress(httpx.HTTPError):
                r = await http.get(f"{url}/v1/models")
                have = {m["id"] for m in r.json().get("data", [])}
                if set(names) <= have:
                    return
            await asyncio.sleep(0.5)
    raise LiveRunError(f"the gateway did not list the adapters {list(names)} within {timeout_s:.0f}s")


@dataclass
class Replay:
    """The plan's replay: the load generator's result, its window on the observer's clock and on the
    machine's monotonic clock, and the CPU seconds used during it."""

    result: Any
    window_s: tuple[float, float]
    window_monotonic_s: tuple[float, float]
    cpu_s_by_process: dict[str, float]
    machine_cpu_s: dict[str, float]


async def _watch(bus: Bus, obs: Observer, policy: str) -> str:
    """Subscribe `obs` to telemetry, round outcomes and the coordinator's decisions; the coordinator's
    policy, a LiveRunError when it is not `policy`'s."""
    await bus.subscribe(subjects.telemetry_all(), ReplicaTelemetry, obs.on_telemetry)
    await bus.subscribe(subjects.round_events_all(), RoundOutcome, obs.on_round)
    await bus.subscribe(subjects.coordinator_decisions(), CoordinatorDecisions, obs.on_decision)
    seen = await coordinator_policy(bus)
    expected = series_setup(policy)[0]
    if seen != expected:
        raise LiveRunError(f"the coordinator runs policy {seen!r}, not {expected!r}")
    return seen


async def _prepare(
    bus: Bus, store: AdapterStore, cfg: ExperimentConfig, stack: Stack, phases: Phases
) -> None:
    """Every domain's v1, resident on every replica and listed by the gateway (step 2 of the module
    docstring)."""
    await create_adapters(bus, store, cfg)
    phases.mark("v1")
    await make_resident(bus, cfg)
    phases.mark("resident")
    await wait_models(stack.gateway_url, sorted(cfg.domains))
    phases.mark("gateway_models")


async def _replay(
    cfg: ExperimentConfig,
    plan: Sequence[PlannedRequest],
    stack: Stack,
    obs: Observer,
    progress: IO[str],
    phases: Phases,
) -> Replay:
    """Replay `plan` against the gateway (step 3 of the module docstring), timing its arrivals and drain
    (`phases`)."""
    opts = ClientOptions(
        url=endpoint_url(stack.gateway_url, "chat"),
        send_slo=True,
        ignore_eos=True,
        request_timeout_s=cfg.request_timeout_s,
    )
    cpu_pids = {**stack.pids(), **{srv.name: srv.proc.pid for srv in stack.servers}}
    cpu_before = {**cpu_seconds(cpu_pids), "load generator": own_cpu_seconds()}
    machine_before = psutil.cpu_times()
    replay_start = obs.now()
    replay_start_monotonic = time.monotonic()
    result = await run_plan(
        plan,
        opts,
        drain_timeout_s=cfg.drain_s,
        progress_interval_s=10.0,
        progress_out=progress,
        duration_s=cfg.duration_s,
    )
    replay_end = obs.now()
    replay_end_monotonic = time.monotonic()
    cpu_after = {**cpu_seconds(cpu_pids), "load generator": own_cpu_seconds()}
    machine_after = psutil.cpu_times()
    # The replay's arrivals end at the plan's last scheduled time; what follows is the drain.
    replay_s = time.monotonic() - phases.t
    arrivals_s = min(replay_s, plan[-1].scheduled_s if plan else 0.0)
    phases.seconds["arrivals"] = arrivals_s
    phases.seconds["drain"] = replay_s - arrivals_s
    phases.t += replay_s
    return Replay(
        result,
        (replay_start, replay_end),
        (replay_start_monotonic, replay_end_monotonic),
        {n: round(cpu_after[n] - cpu_before[n], 2) for n in cpu_after if n in cpu_before},
        machine_cpu_delta(machine_before, machine_after),
    )


async def _coordinator_status(bus: Bus) -> CoordinatorStatus | None:
    with contextlib.suppress(BusError):
        return await bus.request(
            subjects.coordinator("status"), CoordinatorStatusRequest(), CoordinatorStatus, timeout_s=10
        )
    return None


def counter_deltas(
    before: Mapping[str, Mapping[str, float]], after: Mapping[str, Mapping[str, float]]
) -> dict[str, dict[str, Any]]:
    """The replicas' counters over the replay (`read_ft_counters` after less before), by what they
    count: `ft_tokens`, `forward_s`, `inference_tokens`, `busy_s` (by work) and `limits` (the rest)."""
    delta = {
        r: {k: v - before.get(r, {}).get(k, 0.0) for k, v in a.items()} for r, a in sorted(after.items())
    }
    ft = {r: d.pop("ft_tokens", 0.0) for r, d in delta.items()}
    forward = {r: d.pop("forward_s", 0.0) for r, d in delta.items()}
    served = {r: d.pop("inference_tokens", 0.0) for r, d in delta.items()}
    busy = {
        r: {k.removeprefix("busy_s_"): d.pop(k) for k in list(d) if k.startswith("busy_s_")}
        for r, d in delta.items()
    }
    return {
        "ft_tokens": ft,
        "forward_s": forward,
        "inference_tokens": served,
        "busy_s": busy,
        "limits": delta,
    }


async def _drive(
    cfg: ExperimentConfig,
    policy: str,
    plan: Sequence[PlannedRequest],
    stack: Stack,
    out_dir: Path,
    progress: IO[str],
    base: dict[str, float] | None,
    phases: Phases,
) -> dict[str, Any]:
    operator = stack.operator_settings(nats_connect_timeout_s=10)
    bus = await Bus.connect(operator, "collm-experiment")
    store = AdapterStore.from_url(operator.redis_url, operator.redis_prefix)
    obs = Observer()
    try:
        seen = await _watch(bus, obs, policy)
        phases.mark("connect")
        t_prep = obs.now()
        await _prepare(bus, store, cfg, stack, phases)
        prep_s = obs.now() - t_prep
        ft_before = await read_ft_counters(stack)
        replay = await _replay(cfg, plan, stack, obs, progress, phases)
        ft_after = await read_ft_counters(stack)
        base_measured = base is None
        if base is None:
            base = await base_losses(bus, store, cfg)
            phases.mark("base_loss")
        status = await _coordinator_status(bus)
        table = await quality_table(store, cfg, base)
        current = {d: await store.current(d) for d in sorted(cfg.domains)}
        phases.mark("read_out")
    finally:
        await store.close()
        await bus.close()
    write_records(out_dir / "requests.jsonl", replay.result.records)
    summary = summarize(replay.result.records, None, table, cfg.timeline_bin_s)
    counters = counter_deltas(ft_before, ft_after)
    replay_start, replay_end = replay.window_s
    return {
        "policy": policy,
        "coordinator_policy": seen,
        "coscheduler": series_setup(policy)[1],
        "summary": summary,
        "ft_tokens": sum(counters["ft_tokens"].values()),
        "ft_tokens_by_replica": counters["ft_tokens"],
        # Per replica, serving iterations during the replay by what bounded their training.
        "ft_limits_by_replica": counters["limits"],
        # Per replica, seconds of the replay its engine spent on inference, training and evaluation.
        "busy_s_by_replica": counters["busy_s"],
        # Per replica, seconds of that inference spent in the model's forward passes: the calibration
        # times only these, the rest of an iteration (sampling, detokenising, streaming) it leaves out.
        "forward_s_by_replica": counters["forward_s"],
        # Per replica, prompt tokens prefilled and output tokens generated during the replay.
        "inference_tokens_by_replica": counters["inference_tokens"],
        # Per process of the stack (and this one, the load generator), CPU seconds during the replay, and
        # the whole machine's (all cores: busy, idle, and stolen by the hypervisor).
        "cpu_s_by_process": replay.cpu_s_by_process,
        "machine_cpu_s": replay.machine_cpu_s,
        "rounds": obs.round_counts(replay_start, replay_end),
        "round_log": sorted(obs.rounds.values(), key=lambda r: r["round_id"]),
        "base_losses": base,
        "base_losses_measured": base_measured,
        "quality_table": {"base": table.base, "versions": table.versions},
        "current_versions": current,
        "final_current_gain": current_gain(table, current),
        "telemetry": obs.telemetry,
        "share_decisions": obs.shares,
        "replay_window_s": [replay_start, replay_end],
        # The coordinator's slow ticks from the replay's start (it starts with the stack, before the
        # replay, so its first round plan comes `warmup_s` less that head start into the replay).
        "coordinator_slow_ticks_s": [t - replay_start for t in obs.slow_ticks],
        # The same on the machine's monotonic clock, the replicas' engine clock (their step logs' `t_s`).
        "replay_window_monotonic_s": list(replay.window_monotonic_s),
        "prep_s": prep_s,
        "interrupted": replay.result.interrupted,
        "coordinator_status": status.model_dump(mode="json") if status is not None else None,
    }


def own_cpu_seconds() -> float:
    """This process's user plus system CPU seconds (its threads; not its children, the stack)."""
    t = psutil.Process().cpu_times()
    return t.user + t.system


def machine_cpu_delta(before: Any, after: Any) -> dict[str, float]:
    """Seconds of CPU (summed over the machine's cores) between two `psutil.cpu_times()`: busy (not idle,
    not waiting for I/O), idle, and stolen (a virtual machine's cores running someone else)."""
    total = sum(after) - sum(before)
    idle = (after.idle - before.idle) + (getattr(after, "iowait", 0.0) - getattr(before, "iowait", 0.0))
    steal = getattr(after, "steal", 0.0) - getattr(before, "steal", 0.0)
    return {"busy": round(total - idle - steal, 2), "idle": round(idle, 2), "steal": round(steal, 2)}


def cpu_seconds(pids: Mapping[str, int]) -> dict[str, float]:
    """User plus system CPU seconds each process (with its children) has used so far; a process that has
    gone is left out."""
    out: dict[str, float] = {}
    for name, pid in pids.items():
        try:
            proc = psutil.Process(pid)
            procs = [proc, *proc.children(recursive=True)]
        except psutil.Error:
            continue
        total = 0.0
        for p in procs:
            with contextlib.suppress(psutil.Error):
                t = p.cpu_times()
                total += t.user + t.system
        out[name] = total
    return out


def current_gain(table: QualityTable, current: dict[str, int | None]) -> float | None:
    """Mean over domains of base loss - loss of the adapter's current version at the end of the run."""
    gains = []
    for d, v in current.items():
        base = table.base_loss(d)
        if v is None or base is None:
            continue
        loss, _ = table.served_loss(version_id(d, v), d)
        if loss is not None:
            gains.append(base - loss)
    return sum(gains) / len(gains) if gains else None


def run_live(
    cfg: ExperimentConfig,
    policy: str,
    plan: Sequence[PlannedRequest],
    replica_data: dict[str, Path],
    run_dir: Path,
    progress: IO[str],
    base: dict[str, float] | None = None,
    knob_env: Mapping[str, Mapping[str, str]] | None = None,
) -> dict[str, Any]:
    """Run `plan` against a fresh stack under `policy`; return the run's results (see `_drive`). `base`:
    the base model's held-out loss per domain, measured by an earlier run (None: this run measures it).
    `knob_env`: more environment per service (`stack_config`).

    SIGINT and SIGTERM raise KeyboardInterrupt while it runs (`signals.interrupt_on_sigterm`, main
    thread): the stack stops before the interruption goes on, whatever step it came in, and a second
    signal does not cut its stop short (`signals.stopping`)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    scfg = stack_config(cfg, policy, replica_data, run_dir, knob_env)
    t0 = time.monotonic()
    phases = Phases(t=t0)
    with interrupt_on_sigterm(), (run_dir / "stack.log").open("w", encoding="utf-8") as log:
        stack = Stack(scfg, log_sink=log)
        with stopping(stack):
            try:
                stack.start()
            except Exception as exc:
                raise LiveRunError(f"the stack did not start ({exc}); logs: {run_dir / 'stack.log'}") from exc
            ready_s = time.monotonic() - t0
            phases.mark("stack_start")
            try:
                out = asyncio.run(_drive(cfg, policy, plan, stack, run_dir, progress, base, phases))
            finally:
                with signals_deferred():
                    phases.t = time.monotonic()
                    stack.stop()
                phases.mark("stack_stop")
                progress.write(f"[experiment] {policy} phases: {phases.line()}\n")
                progress.flush()
    out["phases_s"] = dict(phases.seconds)
    out["stack_ready_s"] = ready_s
    out["wall_s"] = time.monotonic() - t0
    out["run_dir"] = str(run_dir)
    (run_dir / "result.json").write_text(json.dumps(out, indent=1, default=str) + "\n", encoding="utf-8")
    return out
