"""The `collm` command: run and operate a CoLLM stack.

    collm up [--replicas N] [--model smollm2|tiny|PATH] [--policy P] [--no-demo] [--port 8000] ...
                                                  (own NATS closed: RUN_DIR/nats-auth/operator.env)
    collm status [--once] [--interval 2]          live table of the cluster (Ctrl-C quits)
    collm adapters list | versions NAME | rollback NAME VERSION [--reason TEXT]
    collm rounds list [--adapter A] [--state S] [--limit 20] | show ROUND_ID
    collm micro ls|info|stats [NAME]               what `nats micro ls|info|stats` shows
    collm wire types | encode TYPE [JSON] | decode [TYPE]    msgpack payloads for the NATS CLI
    collm health http URL | micro NAME [--meta k=v]          container health probes

Every command takes `--json` (machine-readable output) and the connection options `--nats-url`,
`--redis-url`, `--redis-prefix`, whose defaults come from the same `COLLM_*` variables the services
read (`COLLM_NATS_URL`, ...). Exit codes: 0 success, 1 failure (the reason on stderr), 2 bad usage.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import sys
import time
from pathlib import Path
from typing import IO, Any

from collm_common.settings import CommonSettings
from collm_coordinator.core.config import COSCHEDULER_FOR_POLICY, POLICIES
from collm_data.demo import DEMO_DIR, demo_domains, site_shares
from collm_ops.launcher import ReplicaSpec, StackConfig, run_forever
from collm_ops.micro import gather
from collm_ops.stack_config import default_torch_threads, usable_cpus


def _env_defaults() -> CommonSettings:
    """Connection defaults from COLLM_* (the services' own settings class); class defaults if invalid."""
    try:
        return CommonSettings()
    except Exception as exc:  # a malformed COLLM_* variable: say so, keep going with the defaults
        sys.stderr.write(f"collm: ignoring invalid COLLM_* settings: {exc}\n")
        return CommonSettings.model_construct()


def _settings(args: argparse.Namespace) -> CommonSettings:
    return CommonSettings(
        nats_url=args.nats_url,
        redis_url=args.redis_url,
        redis_prefix=args.redis_prefix,
        nats_connect_timeout_s=max(1.0, args.timeout * 3),
        nats_user=getattr(args, "nats_user", None),
        nats_password=getattr(args, "nats_password", None),
    )


def _print_json(doc: Any) -> None:
    print(json.dumps(doc, indent=2, default=str))


def _fail(message: str) -> int:
    sys.stderr.write(f"error: {message}\n")
    return 1


# --- up -------------------------------------------------------------------------------------------------
class UsageError(ValueError):
    """Options that cannot make a stack (exit status 2, the message on stderr)."""


def stack_config(args: argparse.Namespace, log: IO[str] | None = None) -> StackConfig:
    """The stack that `collm up` runs for these options (also what `collm_bench adaptation run` starts). With
    neither `--data` nor `--no-demo`, every replica gets its share of the demo data (`collm_data.demo`),
    written under the run directory."""
    data_dirs: dict[str, str] = {}
    for item in args.data or []:
        rid, _, path = item.partition("=")
        if not path:
            raise UsageError(f"--data expects REPLICA=DIR, got {item!r}")
        data_dirs[rid] = path
    ids = [f"r{i}" for i in range(args.replicas)]
    unknown = set(data_dirs) - set(ids)
    if unknown:
        raise UsageError(f"--data names unknown replicas {sorted(unknown)} (replicas are {ids})")
    if not args.no_demo and not data_dirs:
        domains = demo_domains()
        if not domains:
            raise UsageError(f"the demo dataset is missing ({DEMO_DIR}); run with --no-demo or --data")
        shares = site_shares(ids, Path(args.run_dir) / "demo-data")
        data_dirs = {rid: str(path) for rid, path in shares.items()}
        if log is not None:
            log.write(
                f"demo: replicas {', '.join(ids)} each hold their own share of the {', '.join(domains)} "
                f"data ({DEMO_DIR}); the adapters {', '.join(domains)} appear within the first minute and "
                f"improve by federated rounds (http://{args.host}:{args.port}/dashboard, "
                "`collm rounds list`)\n"
            )
    cosched = COSCHEDULER_FOR_POLICY[args.policy]
    return StackConfig(
        nats_url=args.nats_url,
        redis_url=args.redis_url,
        redis_prefix=args.redis_prefix,
        model=args.model,
        gateway_host=args.host,
        gateway_port=args.port,
        replicas=[ReplicaSpec(rid, data_dirs.get(rid), env={"COLLM_COSCHEDULER": cosched}) for rid in ids],
        coordinator_policy=args.policy,
        torch_threads=args.torch_threads or default_torch_threads(len(ids), usable_cpus()),
        run_dir=Path(args.run_dir),
        log_json=args.log_json,
        metrics_port_base=None if args.metrics_port_base < 0 else args.metrics_port_base,
        otlp_endpoint=args.otlp_endpoint,
        closed_bus=not args.open_bus,
        closed_store=not args.open_store,
        env={} if args.fixed_ratio_k is None else {"COLLM_FIXED_RATIO_K": str(args.fixed_ratio_k)},
    )


def _up(args: argparse.Namespace) -> int:
    try:
        cfg = stack_config(args, sys.stdout)
    except UsageError as exc:
        sys.stderr.write(f"{exc}\n")
        return 2
    if args.json:
        from collm_ops.launcher import describe

        print(describe(cfg))
    return run_forever(cfg)


# --- micro ----------------------------------------------------------------------------------------------
def _micro(args: argparse.Namespace) -> int:
    verb = {"ls": "PING", "info": "INFO", "stats": "STATS"}[args.verb]
    try:
        replies = asyncio.run(
            gather(
                args.nats_url, verb, args.name, args.timeout, user=args.nats_user, password=args.nats_password
            )
        )
    except Exception as exc:  # cannot reach NATS
        return _fail(f"NATS at {args.nats_url}: {type(exc).__name__}: {exc}")
    if args.json or verb != "PING":
        print(json.dumps(replies, indent=2))
        return 0
    if not replies:
        print("no services answered")
        return 1
    print(f"{'NAME':<20} {'VERSION':<9} {'ID':<24} METADATA")
    for r in replies:
        meta = ",".join(f"{k}={v}" for k, v in sorted((r.get("metadata") or {}).items()))
        print(f"{r.get('name', ''):<20} {r.get('version', ''):<9} {r.get('id', ''):<24} {meta}")
    return 0


# --- status ---------------------------------------------------------------------------------------------
async def _status_loop(args: argparse.Namespace) -> int:
    from collm_common.bus import Bus
    from collm_ops.status import gather_status, read_supervision, render_status, status_document

    bus = await Bus.connect(_settings(args), "collm-status")
    tty = sys.stdout.isatty()
    try:
        while True:
            snapshot = await gather_status(bus, args.timeout)
            snapshot.supervision = read_supervision(Path(args.run_dir))
            if args.json:
                doc = json.dumps(status_document(snapshot), indent=2 if args.once else None)
                print(doc, flush=True)
            else:
                text = render_status(snapshot)
                if tty and not args.once:
                    sys.stdout.write("\x1b[2J\x1b[H")  # clear, cursor home: one frame per refresh
                    text += f"\n\nrefreshing every {args.interval:g}s, Ctrl-C quits"
                elif not args.once:
                    text += "\n" + "-" * 40
                print(text, flush=True)
            if args.once:
                return 0
            await asyncio.sleep(args.interval)
    finally:
        await bus.close(drain_timeout_s=2.0)  # Ctrl-C must quit promptly, whatever was in flight


def _status(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(_status_loop(args))
    except KeyboardInterrupt:
        return 0
    except ConnectionError as exc:
        from collm_ops.status import read_supervision, supervision_lines

        # NATS down: what the local launcher knows of its processes (NATS's own restarts included).
        for line in supervision_lines(read_supervision(Path(args.run_dir))):
            print(line)
        return _fail(str(exc))


# --- adapters and rounds --------------------------------------------------------------------------------
async def _adapters_async(args: argparse.Namespace) -> int:
    from collm_common.bus import BusError
    from collm_common.store import AdapterStore, StoreError
    from collm_ops import adapters as ad

    if args.verb == "rollback":
        try:
            info = await ad.rollback(_settings(args), args.name, args.version, args.reason, args.timeout * 30)
        except (BusError, ConnectionError) as exc:
            return _fail(f"rollback of {args.name} to v{args.version}: {exc}")
        if args.json:
            _print_json(info.model_dump(mode="json"))
        else:
            print(ad.render_version_info(info))
        return 0
    settings = _settings(args)
    # The services' own client: COLLM_REDIS_URL, or the primary the Sentinels name (COLLM_REDIS_SENTINELS).
    store = AdapterStore.connect(settings)
    where = f"Sentinels {settings.redis_sentinels}" if settings.redis_sentinels else args.redis_url
    try:
        if args.verb == "list":
            items = await ad.list_adapters(store)
            if args.json:
                from dataclasses import asdict

                _print_json([asdict(i) for i in items])
            else:
                print(ad.render_adapters(items))
        else:
            rows = await ad.adapter_versions(store, args.name)
            if args.json:
                _print_json(rows)
            else:
                print(ad.render_versions(rows))
        return 0
    except StoreError as exc:
        return _fail(str(exc))
    except (OSError, ValueError) as exc:
        return _fail(f"adapter store at {where}: {type(exc).__name__}: {exc}")
    finally:
        with contextlib.suppress(Exception):
            await store.close()


def _adapters(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(_adapters_async(args))
    except Exception as exc:  # redis connection errors surface here
        return _fail(f"{type(exc).__name__}: {exc}")


async def _rounds_async(args: argparse.Namespace) -> int:
    from collm_common.bus import BusError
    from collm_ops import adapters as ad

    try:
        if args.verb == "list":
            result: Any = await ad.rounds_list(
                _settings(args), args.adapter, args.state, args.limit, args.timeout * 10
            )
            text = ad.render_rounds(result)
        else:
            result = await ad.round_detail(_settings(args), args.round_id, args.timeout * 10)
            text = ad.render_round(result)
    except (BusError, ConnectionError) as exc:
        return _fail(str(exc))
    if args.json:
        _print_json(result.model_dump(mode="json"))
    else:
        print(text)
    return 0


def _rounds(args: argparse.Namespace) -> int:
    return asyncio.run(_rounds_async(args))


# --- wire -----------------------------------------------------------------------------------------------
def _wire(args: argparse.Namespace) -> int:
    from collm_ops import wire_tools

    try:
        if args.verb == "types":
            rows = wire_tools.types_table()
            if args.json:
                _print_json(dict(rows))
            else:
                from collm_ops.table import render_table

                print(render_table(("TYPE", "SUBJECT"), rows))
            return 0
        if args.verb == "encode":
            text = args.message if args.message is not None else sys.stdin.read()
            sys.stdout.buffer.write(wire_tools.encode_json(args.type, text))
            sys.stdout.buffer.flush()
            return 0
        data = sys.stdin.buffer.read()
        _print_json(wire_tools.decode_bytes(data, args.type))
        return 0
    except (ValueError, json.JSONDecodeError) as exc:
        return _fail(str(exc))


# --- health ---------------------------------------------------------------------------------------------
def _health(args: argparse.Namespace) -> int:
    from collm_ops.health import http_ok, micro_ok

    if args.verb == "http":
        ok, why = http_ok(args.target, args.timeout)
    else:
        meta = {}
        for item in args.meta or []:
            k, sep, v = item.partition("=")
            if not sep:
                sys.stderr.write(f"--meta expects KEY=VALUE, got {item!r}\n")
                return 2
            meta[k] = v
        s = _settings(args)
        ok, why = micro_ok(args.nats_url, args.target, meta, args.timeout, s.nats_user, s.nats_password)
    if args.json:
        print(json.dumps({"healthy": ok, "detail": why, "ts_unix_s": time.time()}))
    else:
        print(("healthy: " if ok else "unhealthy: ") + why)
    return 0 if ok else 1


# --- parser ---------------------------------------------------------------------------------------------
def _common_options() -> argparse.ArgumentParser:
    """The connection and output options every subcommand takes after its name (`collm status
    --nats-url ...`); SUPPRESS keeps a value given before the subcommand from being overwritten by a
    default."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--nats-url", default=argparse.SUPPRESS)
    common.add_argument("--redis-url", default=argparse.SUPPRESS)
    common.add_argument("--redis-prefix", default=argparse.SUPPRESS)
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="JSON output")
    common.add_argument(
        "--timeout", type=float, default=argparse.SUPPRESS, help="seconds to wait for each answer (1)"
    )
    return common


def _add_up_stack(up: argparse.ArgumentParser) -> None:
    """`collm up`: what the stack runs (replicas, model, gateway, policy, data)."""
    up.add_argument("--replicas", type=int, default=2, help="number of replicas (ids r0, r1, ...)")
    up.add_argument(
        "--model", default="smollm2", help="smollm2 (default), tiny, an HF directory or a .gguf file"
    )
    up.add_argument("--host", default="127.0.0.1", help="gateway bind address")
    up.add_argument("--port", type=int, default=8000, help="gateway port")
    up.add_argument(
        "--policy",
        default="collm",
        choices=POLICIES,
        help="the policy the whole stack runs: the coordinator's, and the replicas' co-scheduler that goes "
        "with it (collm and separate: slo; fixed_ratio: fixed; leftover: leftover)",
    )
    up.add_argument(
        "--fixed-ratio-k",
        type=int,
        default=None,
        help="K of the fixed-ratio baseline for the coordinator and the replicas alike "
        "(COLLM_FIXED_RATIO_K; default 5)",
    )
    up.add_argument(
        "--data",
        action="append",
        metavar="REPLICA=DIR",
        help="local dataset of a replica (replaces the demo data)",
    )
    up.add_argument(
        "--no-demo",
        action="store_true",
        help="no demo data: the bare server (replicas without local data train nothing)",
    )
    up.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="torch threads per replica (default: the usable CPUs divided among the replicas, at least 1)",
    )


def _add_up_servers(up: argparse.ArgumentParser) -> None:
    """`collm up`: its own NATS and Redis, logs, metrics and traces."""
    up.add_argument(
        "--run-dir",
        default=".collm/run",
        help="where own NATS/Redis keep their data and their users (nats-auth/, redis-auth/, mode 0600)",
    )
    up.add_argument(
        "--open-bus",
        action="store_true",
        help="start own NATS without users (anyone on the host may publish anything); by default it runs "
        "the users and permissions of deploy/nats/auth.conf, and the operator's login is "
        "RUN_DIR/nats-auth/operator.env",
    )
    up.add_argument(
        "--open-store",
        action="store_true",
        help="start own Redis without users (anyone on the host may rewrite the adapter catalogue); by "
        "default it runs the ACL users of deploy/redis/users.acl, and the operator's login is "
        "RUN_DIR/redis-auth/operator.env",
    )
    up.add_argument("--log-json", action="store_true", help="JSON log lines instead of text")
    up.add_argument(
        "--metrics-port-base",
        type=int,
        default=0,
        help="Prometheus ports of coordinator, aggregator and replicas: 0 free ports (printed), N "
        "consecutive ports from N, -1 none (the gateway's /metrics is on its HTTP port)",
    )
    up.add_argument(
        "--otlp-endpoint", default=None, help="export traces over OTLP/HTTP, e.g. http://127.0.0.1:4318"
    )


def _add_status(sub: Any, common: argparse.ArgumentParser) -> None:
    status = sub.add_parser("status", parents=[common], help="live table of the cluster (Ctrl-C quits)")
    status.add_argument("--once", action="store_true", help="print one frame and exit")
    status.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
    status.add_argument(
        "--run-dir",
        default=".collm/run",
        help="the run directory of a local `collm up`: its supervision.json (processes, restarts) is shown",
    )
    status.set_defaults(func=_status)


def _add_adapters_and_rounds(sub: Any, common: argparse.ArgumentParser) -> None:
    adapters = sub.add_parser("adapters", help="adapter versions (store) and rollback (aggregator)")
    averbs = adapters.add_subparsers(dest="verb", required=True)
    averbs.add_parser("list", parents=[common], help="every adapter with its current version")
    versions = averbs.add_parser("versions", parents=[common], help="every version of one adapter")
    versions.add_argument("name")
    rb = averbs.add_parser(
        "rollback", parents=[common], help="republish the content of NAME@vVERSION as a new version"
    )
    rb.add_argument("name")
    rb.add_argument("version", type=int)
    rb.add_argument("--reason", default="", help="recorded with the rollback")
    adapters.set_defaults(func=_adapters)

    rounds = sub.add_parser("rounds", help="federated rounds (aggregator records)")
    rverbs = rounds.add_subparsers(dest="verb", required=True)
    rlist = rverbs.add_parser("list", parents=[common], help="recent rounds, newest first")
    rlist.add_argument("--adapter")
    rlist.add_argument("--state", help="opened, collecting, ..., published, held_back, aborted")
    rlist.add_argument("--limit", type=int, default=20)
    rshow = rverbs.add_parser("show", parents=[common], help="one round: plan, updates, evaluations")
    rshow.add_argument("round_id", type=int)
    rounds.set_defaults(func=_rounds)


def _add_micro_and_wire(sub: Any, common: argparse.ArgumentParser) -> None:
    micro = sub.add_parser("micro", parents=[common], help="NATS micro services: ls, info, stats")
    micro.add_argument("verb", choices=["ls", "info", "stats"])
    micro.add_argument("name", nargs="?", default=None, help="service name, e.g. collm-replica")
    micro.set_defaults(func=_micro, timeout=0.5)

    wire = sub.add_parser("wire", help="msgpack payloads for the NATS CLI")
    wverbs = wire.add_subparsers(dest="verb", required=True)
    wverbs.add_parser("types", parents=[common], help="message types and where they travel")
    enc = wverbs.add_parser(
        "encode", parents=[common], help="JSON (argument or stdin) -> msgpack bytes on stdout"
    )
    enc.add_argument("type", help="a type from `collm wire types` (control: any control command)")
    enc.add_argument("message", nargs="?", default=None, help="JSON object (default: read stdin)")
    dec = wverbs.add_parser(
        "decode", parents=[common], help="msgpack bytes on stdin (as `nats ... --raw` prints them) -> JSON"
    )
    dec.add_argument("type", nargs="?", default=None, help="validate as this type (default: raw map)")
    wire.set_defaults(func=_wire)


def _add_health(sub: Any, common: argparse.ArgumentParser) -> None:
    health = sub.add_parser("health", help="health probes for containers (exit 0 when healthy)")
    hverbs = health.add_subparsers(dest="verb", required=True)
    hhttp = hverbs.add_parser("http", parents=[common], help="HTTP 200 from URL")
    hhttp.add_argument("target", metavar="URL")
    hmicro = hverbs.add_parser("micro", parents=[common], help="a NATS micro service answers PING")
    hmicro.add_argument("target", metavar="NAME")
    hmicro.add_argument("--meta", action="append", metavar="KEY=VALUE", help="required metadata")
    health.set_defaults(func=_health, timeout=2.0)


def build_parser() -> argparse.ArgumentParser:
    env = _env_defaults()
    p = argparse.ArgumentParser(prog="collm", description="Run and operate a CoLLM stack.")
    p.add_argument("--nats-url", default=env.nats_url, help="NATS URL (default: $COLLM_NATS_URL or local)")
    p.add_argument("--redis-url", default=env.redis_url, help="Redis URL of the adapter store")
    p.add_argument("--redis-prefix", default=env.redis_prefix, help="key prefix of the adapter store")
    p.set_defaults(nats_user=env.nats_user, nats_password=env.nats_password, json=False, timeout=1.0)
    common = _common_options()
    sub = p.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", parents=[common], help="start the whole stack as local processes")
    _add_up_stack(up)
    _add_up_servers(up)
    up.set_defaults(func=_up)
    _add_status(sub, common)
    _add_adapters_and_rounds(sub, common)
    _add_micro_and_wire(sub, common)
    _add_health(sub, common)
    return p


def main(argv: list[str] | None = None) -> int:
    # Connection failures are reported once, as `error: ...`; not as the client library's tracebacks.
    logging.getLogger("nats").setLevel(logging.CRITICAL)
    logging.getLogger("collm_common.bus").setLevel(logging.ERROR)
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
