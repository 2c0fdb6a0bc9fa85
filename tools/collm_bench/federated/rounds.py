"""Federated rounds on the real stack: does federation beat training alone; how fast is a new version live?

Starts its own nats-server and redis-server on free ports, three real replicas (`python -m collm_replica`,
SmolLM2 by default), each holding a different real domain converted from ../shared/data/domains by
`collm_data`, and the real aggregator (`python -m collm_aggregator`, built-in plans off: this script plans
rounds the way the coordinator does, through `open_round`). Per round it runs, concurrently:

* `shared`: one adapter trained by all three replicas (federated), evaluated on all three domains' held-out
  sets (the mixed eval set);
* `local-<replica>`: the same starting point trained by one replica alone: the local-only baseline and,
  on the replica's own domain, the per-domain adapter; evaluated on all three domains like `shared`. These
  rounds open `--baseline-offset-s` after `shared` (same duration, same budget), so that their
  evaluations do not queue in front of the shared round's on the replicas (a replica evaluates one
  candidate at a time).

Rounds train until their deadline (`--token-budget 0`, participants send `--deadline-margin-s` before it)
or up to a token budget per participant. Every loss comes from the round outcomes (federated evaluation:
each replica scores its own held-out examples; losses are example-weighted): (a) federated = `shared`,
(b) local-only = `local-*`, (c) no training = the v1 adapters (B = 0, the base model), i.e. round 1's
losses "before". Also measured per shared round: the time from the round's deadline, and from the close
of collection (deadline or last update), to the new version being served by every replica (1-token
generate requests report the exact version that serves them), split into aggregation, federated
evaluation + publication, and the replicas' swap; and the bytes sent per round (update blobs up, the new
version down to every replica) against the raw size of the participants' training data.

    flock /tmp/collm-heavy.lock .venv/bin/python -m collm_bench federated rounds \
        [--rounds 5] [--model smollm2]

Writes bench/results/federated/rounds_<model>_<strategy>[_server_lr_<x>].json and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from collm_bench.groups import (
    RESULTS,
    add_domain_data,
    add_eval_dtype,
    add_lr,
    add_model,
    add_run_dir,
    command_line,
    prog,
)
from collm_common import subjects
from collm_common.bus import Bus, BusError
from collm_common.settings import CommonSettings
from collm_common.store import AdapterStore
from collm_common.wire import decode
from collm_common.wire.admin import AggregatorStatus, GetRound, RoundDetail, StatusRequest
from collm_common.wire.control import ControlReply, StartTraining, StopTraining
from collm_common.wire.inference import GENERATE_EVENT, Accepted, GenerateRequest, SamplingParams
from collm_common.wire.rounds import (
    EvalReport,
    EvaluateCandidate,
    ParticipantPlan,
    RoundOutcome,
    RoundPlan,
)
from collm_common.wire.telemetry import ReplicaTelemetry
from collm_data.__main__ import convert_one
from collm_ops.servers import start_nats, start_redis

FEDERATED_RESULTS = RESULTS / "federated"
FINAL = ("published", "held_back", "aborted")


def spawn(module: str, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("COLLM_")}
    full.update({"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "COLLM_LOG_JSON": "false", **env})
    return subprocess.Popen(
        [sys.executable, "-m", module], env=full, stdout=log.open("wb"), stderr=subprocess.STDOUT
    )


async def wait_until(probe, timeout_s: float, what: str):  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        v = await probe()
        if v:
            return v
        await asyncio.sleep(0.2)
    raise TimeoutError(f"timed out waiting for {what}")


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.run_dir = Path(args.run_dir or f"/tmp/collm-fedbench-{uuid.uuid4().hex[:6]}")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.domains = args.domains.split(",")
        self.replicas = {f"r{i}": d for i, d in enumerate(self.domains)}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.events: dict[int, RoundOutcome] = {}
        self.prefix = f"fb{uuid.uuid4().hex[:6]}"

    # --- setup ---------------------------------------------------------------------------------------
    def prepare_data(self) -> dict[str, int]:
        raw = {}
        for rid, d in self.replicas.items():
            out = self.run_dir / f"data-{rid}"
            convert_one(d, Path(self.args.source), out, self.args.train_examples, self.args.eval_examples)
            raw[rid] = sum(p.stat().st_size for p in (out / "train").glob("*.jsonl"))
        return raw

    def start(self) -> None:
        self.nats = start_nats(workdir=self.run_dir / "nats")
        self.redis = start_redis(workdir=self.run_dir / "redis")
        common = {
            "COLLM_NATS_URL": self.nats.url,
            "COLLM_REDIS_URL": self.redis.url,
            "COLLM_REDIS_PREFIX": self.prefix,
        }
        for rid in self.replicas:
            self.procs[rid] = spawn(
                "collm_replica",
                {
                    **common,
                    "COLLM_REPLICA_ID": rid,
                    "COLLM_MODEL": self.args.model,
                    "COLLM_DATA_DIR": str(self.run_dir / f"data-{rid}"),
                    "COLLM_TORCH_THREADS": "1",
                    "COLLM_FT_SHARE_DEFAULT": "1.0",
                    "COLLM_TRAIN_MAX_SEQ_LEN": str(self.args.max_seq_len),
                    "COLLM_PUBLISH_EVERY_STEPS": "1000",
                    "COLLM_EVAL_MAX_EXAMPLES": "8",
                    "COLLM_ROUND_DEADLINE_MARGIN_S": str(self.args.deadline_margin_s),
                    "COLLM_EVAL_MATMUL_DTYPE": self.args.eval_dtype,
                    "COLLM_TELEMETRY_INTERVAL_S": "1",
                    # Defaults otherwise: 8 resident adapters (7 adapters x versions live here), the
                    # default SLOs (training runs in layer-sized pieces, so no guard starves it).
                },
                self.run_dir / f"{rid}.log",
            )
        self.procs["aggregator"] = spawn(
            "collm_aggregator",
            {
                **common,
                "COLLM_DEFAULT_PLAN": "false",
                "COLLM_STRATEGY": self.args.strategy,
                "COLLM_SERVER_LR": self.args.server_lr,
                "COLLM_EVAL_MAX_EXAMPLES": str(self.args.eval_examples),
                "COLLM_EVAL_MAX_TOKENS": str(self.args.eval_max_tokens),
                "COLLM_EVAL_PRESCORE_CURRENT": "false" if self.args.no_prescore else "true",
                "COLLM_EVAL_TIMEOUT_S": "600",
                "COLLM_RETENTION_VERSIONS": str(self.args.rounds + 2),  # scored again after the run
                "COLLM_CONTROL_TIMEOUT_S": "60",
            },
            self.run_dir / "aggregator.log",
        )

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
        self.nats.stop()
        self.redis.stop()

    async def connect(self) -> None:
        self.bus = await Bus.connect(
            CommonSettings(nats_url=self.nats.url, nats_connect_timeout_s=10), "fedbench"
        )
        self.store = AdapterStore.from_url(self.redis.url, self.prefix)

        async def on_event(o: RoundOutcome, _m: object) -> None:
            if o.state in FINAL:
                self.events[o.round_id] = o

        await self.bus.subscribe(subjects.round_events_all(), RoundOutcome, on_event)

        async def up(subject: str, reply: type) -> bool:
            try:
                await self.bus.request(subject, StatusRequest(), reply, timeout_s=3)
                return True
            except BusError:
                return False

        for rid in self.replicas:
            await wait_until(
                lambda rid=rid: up(subjects.replica(rid, "status"), ReplicaTelemetry), 600, f"{rid} up"
            )
        await wait_until(lambda: up(subjects.aggregator("status"), AggregatorStatus), 120, "aggregator up")

    async def create_v1(self, adapters: dict[str, tuple[list[str], list[str]]]) -> None:
        """`shared@v1` is created by a replica (as replicas do); every other adapter starts from the very
        same content, so federated, local-only and per-domain runs share one starting point."""
        rid = next(iter(self.replicas))
        ctl = subjects.replica(rid, "control")
        await self.bus.request(
            ctl, StartTraining(adapter="shared", token_budget=1), ControlReply, timeout_s=120
        )
        await self.bus.request(ctl, StopTraining(adapter="shared"), ControlReply, timeout_s=60)
        rec = await self.store.get_version("shared", 1)
        blob = await self.store.get_blob("shared", 1)
        for name, (domains, _who) in adapters.items():
            if name != "shared":
                await self.store.publish(
                    name, blob, expected_current=None, base_model=rec.base_model, source="create"
                )
            await self.store.set_meta(name, {"domains": ",".join(domains)})

    # --- rounds -------------------------------------------------------------------------------------------
    async def open(self, adapter: str, participants: list[str], deadline_s: float) -> int:
        now = time.time()
        plan = RoundPlan(
            adapter=adapter,
            base_version=await self.store.current(adapter) or 1,
            participants=[
                ParticipantPlan(
                    replica_id=r, token_budget=self.args.token_budget or 10**8, learning_rate=self.args.lr
                )
                for r in participants
            ],
            quorum=len(participants),
            opened_unix_s=now,
            deadline_unix_s=now + deadline_s,
            policy="bench",
        )
        out = await self.bus.request(subjects.aggregator("open_round"), plan, RoundOutcome, timeout_s=30)
        if out.state != "opened":
            raise RuntimeError(f"round for {adapter} not opened: {out.reason}")
        return out.round_id

    async def served(self, rid: str, adapter: str) -> str | None:
        req = GenerateRequest(
            request_id=uuid.uuid4().hex,
            prompt="hi",
            adapter=adapter,
            sampling=SamplingParams(max_tokens=1, temperature=0.0),
        )
        try:
            async with self.bus.stream(subjects.replica(rid, "generate"), req) as replies:
                ev = decode(GENERATE_EVENT, (await replies.next(30)).data)
        except BusError:
            return None
        return ev.adapter_version_id if isinstance(ev, Accepted) else None

    async def watch_serving(self, round_id: int, adapter: str, timeout_s: float) -> float | None:
        """Unix time at which every replica serves the version this round published (None: it did not)."""
        o = await wait_until(lambda: _value(self.events.get(round_id)), timeout_s, f"round {round_id}")
        if o.state != "published":
            return None
        want = f"{adapter}@v{o.new_version}"
        pending = set(self.replicas)
        while pending:
            for rid in list(pending):
                if await self.served(rid, adapter) == want:
                    pending.discard(rid)
            if pending:
                await asyncio.sleep(0.02)
        return time.time()

    async def round_bytes(self, round_id: int, replicas_receiving: int) -> dict[str, int]:
        detail = await self.bus.request(
            subjects.aggregator("round"), GetRound(round_id=round_id), RoundDetail, timeout_s=30
        )
        # As the aggregator recorded each update when it arrived (the blobs are deleted when the round ends).
        up = sum(u.size_bytes for u in detail.updates)
        down = 0
        if detail.outcome.new_version:
            rec = await self.store.get_version(detail.outcome.adapter, detail.outcome.new_version)
            down = rec.size_bytes * replicas_receiving
        return {"updates_up": up, "version_down": down}

    async def round_tokens(self, round_id: int) -> dict[str, int]:
        detail = await self.bus.request(
            subjects.aggregator("round"), GetRound(round_id=round_id), RoundDetail, timeout_s=30
        )
        return {u.update.replica_id: u.update.num_tokens for u in detail.updates}

    async def score(self, adapter: str, version: int) -> dict[str, dict[str, float]]:
        """Held-out loss of a stored version on every replica's own domain (federated, as in a round, on
        the larger quality set): per domain, the example-weighted loss and the examples and tokens scored."""
        req = EvaluateCandidate(
            adapter=adapter,
            candidate_key="",
            candidate_sha256="",
            candidate_version=version,
            score_current=False,
            max_examples=self.args.quality_examples,
            max_tokens=self.args.quality_max_tokens,
        )
        reports = await asyncio.gather(
            *(
                self.bus.request(subjects.replica(rid, "evaluate"), req, EvalReport, timeout_s=900)
                for rid in self.replicas
            )
        )
        out: dict[str, dict[str, float]] = {}
        for rep in reports:
            for d in rep.losses:
                cur = out.setdefault(d.domain, {"loss_sum": 0.0, "examples": 0, "tokens": 0})
                cur["loss_sum"] += d.candidate_loss * d.num_examples
                cur["examples"] += d.num_examples
                cur["tokens"] += d.num_tokens
        return {
            dom: {"loss": v["loss_sum"] / v["examples"], "examples": v["examples"], "tokens": v["tokens"]}
            for dom, v in out.items()
            if v["examples"]
        }

    async def quality(self, adapters: list[str], versions: dict[str, list[int]]) -> dict[str, dict]:
        """Every version of every adapter the run produced, scored after the rounds (off their critical
        path) on each replica's larger quality set."""
        out: dict[str, dict] = {}
        for name in adapters:
            out[name] = {}
            for v in sorted(set(versions[name])):
                out[name][str(v)] = await self.score(name, v)
                print(f"  quality {name}@v{v}: {fmt({d: x['loss'] for d, x in out[name][str(v)].items()})}")
        return out

    async def run(self) -> dict:
        raw = self.prepare_data()
        self.start()
        try:
            await self.connect()
            t_ready = time.time()
            adapters = {"shared": ([], list(self.replicas))}
            for rid in self.replicas:
                adapters[f"local-{rid}"] = ([], [rid])
            await self.create_v1(adapters)
            report: dict = {
                "model": self.args.model,
                "strategy": self.args.strategy,
                "server_lr": self.args.server_lr,
                "domains": self.replicas,
                "raw_train_bytes": raw,
                "token_budget": self.args.token_budget,
                "lr": self.args.lr,
                "eval_examples": self.args.eval_examples,
                "eval_max_tokens": self.args.eval_max_tokens,
                "eval_dtype": self.args.eval_dtype,
                "deadline_s": self.args.deadline_s,
                "deadline_margin_s": self.args.deadline_margin_s,
                "baseline_offset_s": self.args.baseline_offset_s,
                "prescore_current": not self.args.no_prescore,
                "command": command_line(lock=True),
                "startup_s": t_ready,
                "rounds": [],
            }
            for rnd in range(1, self.args.rounds + 1):
                t0 = time.time()
                ids = {"shared": await self.open("shared", adapters["shared"][1], self.args.deadline_s)}
                await asyncio.sleep(self.args.baseline_offset_s)
                for name, (_d, who) in adapters.items():
                    if name != "shared":
                        ids[name] = await self.open(name, who, self.args.deadline_s)
                serving_at = await self.watch_serving(ids["shared"], "shared", self.args.deadline_s + 900)
                for rid_ in ids.values():
                    await wait_until(
                        lambda rid_=rid_: _value(self.events.get(rid_)),
                        self.args.deadline_s + 900,
                        f"round {rid_}",
                    )
                outs = {name: self.events[i] for name, i in ids.items()}
                shared = outs["shared"]
                tl = shared.timeline
                row = {
                    "round": rnd,
                    "wall_s": time.time() - t0,
                    "outcomes": {n: o.model_dump(mode="json") for n, o in outs.items()},
                    "bytes": await self.round_bytes(ids["shared"], len(self.replicas)),
                    "tokens": {n: await self.round_tokens(i) for n, i in ids.items()},
                    "version_after": {n: o.new_version or o.base_version for n, o in outs.items()},
                }
                if "aggregating" in tl:
                    close = tl["aggregating"]
                    deadline = shared.deadline_unix_s or close
                    row["latency_s"] = {
                        "close_to_candidate": tl.get("evaluating", close) - close,
                        "candidate_to_published": tl.get("published", tl.get("held_back", close))
                        - tl.get("evaluating", close),
                        "published_to_all_serving": (serving_at - tl["published"])
                        if serving_at and "published" in tl
                        else None,
                        "close_to_all_serving": (serving_at - close) if serving_at else None,
                        "deadline_to_close": close - deadline,
                        "deadline_to_all_serving": (serving_at - deadline) if serving_at else None,
                    }
                report["rounds"].append(row)
                print_round(row, self.replicas)
            versions = {n: [1] + [r["version_after"][n] for r in report["rounds"]] for n in adapters}
            report["quality_examples"] = self.args.quality_examples
            report["quality_max_tokens"] = self.args.quality_max_tokens
            report["quality"] = await self.quality(list(adapters), versions)
            return report
        finally:
            with_logs = self.run_dir
            self.stop()
            print(f"logs in {with_logs}")


async def _value(v):  # type: ignore[no-untyped-def]
    return v


def float_or_none(x: str) -> float | None:
    try:
        return float(x)
    except ValueError:
        return None


def mean(d: dict[str, float]) -> float | None:
    return sum(d.values()) / len(d) if d else None


def print_round(row: dict, replicas: dict[str, str]) -> None:
    outs = row["outcomes"]
    sh = outs["shared"]
    head = f"round {row['round']} ({row['wall_s']:.0f}s)  shared: {sh['state']} v{sh['new_version']}"
    print(f"{head} ({sh['reason']})")
    print(f"  shared (federated)  after: {fmt(sh['domain_losses_after'])}")
    print(f"                      before: {fmt(sh['domain_losses_before'])}")
    for rid in replicas:
        lo = outs[f"local-{rid}"]
        print(f"  local-{rid:3} ({lo['state']:9}) after: {fmt(lo['domain_losses_after'])}")
    if "latency_s" in row:
        print(
            "  latency_s "
            + json.dumps({k: (round(v, 3) if v is not None else None) for k, v in row["latency_s"].items()})
        )
    print(f"  bytes {row['bytes']} tokens {row['tokens']}", flush=True)


def fmt(d: dict[str, float]) -> str:
    m = mean(d)
    return " ".join(f"{k}={v:.3f}" for k, v in sorted(d.items())) + (
        f" | mean={m:.3f}" if m is not None else ""
    )


def main(argv: Sequence[str]) -> int:
    """Run the rounds, write the result file."""
    p = argparse.ArgumentParser(prog=prog("federated", "rounds"), description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    add_model(p, "smollm2")
    add_domain_data(p, train_examples=300, eval_examples=24)
    p.add_argument(
        "--eval-max-tokens", type=int, default=4096, help="held-out tokens per domain per version (gate)"
    )
    p.add_argument("--no-prescore", action="store_true", help="score current and candidate after the close")
    p.add_argument("--quality-examples", type=int, default=24, help="held-out examples per domain (quality)")
    p.add_argument(
        "--quality-max-tokens", type=int, default=4096, help="held-out tokens per domain (quality)"
    )
    p.add_argument(
        "--token-budget", type=int, default=0, help="training tokens per participant (0: until the deadline)"
    )
    add_lr(p)
    p.add_argument("--max-seq-len", type=int, default=192)
    p.add_argument("--deadline-s", type=float, default=45.0)
    p.add_argument("--deadline-margin-s", type=float, default=5.0, help="replicas send this long before it")
    p.add_argument("--baseline-offset-s", type=float, default=10.0, help="local-only rounds open this later")
    add_eval_dtype(p)
    p.add_argument("--strategy", default="product_svd", choices=("product_svd", "fedavg"))
    p.add_argument(
        "--server-lr",
        default="1.0",
        help="the aggregator's COLLM_SERVER_LR: a number (1 = plain averaging) or 'participants'",
    )
    add_run_dir(p, None)
    args = p.parse_args(argv)
    report = asyncio.run(Bench(args).run())
    FEDERATED_RESULTS.mkdir(parents=True, exist_ok=True)
    lr = "" if float_or_none(args.server_lr) == 1.0 else f"_server_lr_{args.server_lr}"
    out = FEDERATED_RESULTS / f"rounds_{args.model}_{args.strategy}{lr}.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return 0
