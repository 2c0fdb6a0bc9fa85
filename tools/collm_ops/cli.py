"""The `collm` command.

collm up [--replicas N] [--model smollm2|tiny|PATH] [--port 8000] [--policy collm] ...
collm micro ls|info|stats [NAME]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from collm_ops.launcher import ReplicaSpec, StackConfig, run_forever
from collm_ops.micro import gather


def _up(args: argparse.Namespace) -> int:
    data_dirs: dict[str, str] = {}
    for item in args.data or []:
        rid, _, path = item.partition("=")
        if not path:
            sys.stderr.write(f"--data expects REPLICA=DIR, got {item!r}\n")
            return 2
        data_dirs[rid] = path
    ids = [f"r{i}" for i in range(args.replicas)]
    unknown = set(data_dirs) - set(ids)
    if unknown:
        sys.stderr.write(f"--data names unknown replicas {sorted(unknown)} (replicas are {ids})\n")
        return 2
    cfg = StackConfig(
        nats_url=args.nats_url,
        redis_url=args.redis_url,
        redis_prefix=args.redis_prefix,
        model=args.model,
        gateway_host=args.host,
        gateway_port=args.port,
        replicas=[ReplicaSpec(rid, data_dirs.get(rid)) for rid in ids],
        coordinator_policy=args.policy,
        torch_threads=args.torch_threads,
        run_dir=Path(args.run_dir),
        log_json=args.log_json,
    )
    return run_forever(cfg)


def _micro(args: argparse.Namespace) -> int:
    verb = {"ls": "PING", "info": "INFO", "stats": "STATS"}[args.verb]
    replies = asyncio.run(gather(args.nats_url, verb, args.name, args.timeout))
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="collm", description="Operate a CoLLM stack.")
    p.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    sub = p.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start the whole stack as local processes (Ctrl-C stops it)")
    up.add_argument("--replicas", type=int, default=2, help="number of replicas (ids r0, r1, ...)")
    up.add_argument(
        "--model", default="smollm2", help="smollm2 (default), tiny, an HF directory or a .gguf file"
    )
    up.add_argument("--host", default="127.0.0.1", help="gateway bind address")
    up.add_argument("--port", type=int, default=8000, help="gateway port")
    up.add_argument(
        "--policy", default="collm", help="coordinator policy: collm, separate, fixed_ratio, leftover"
    )
    up.add_argument("--data", action="append", metavar="REPLICA=DIR", help="local dataset of a replica")
    up.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    up.add_argument("--redis-prefix", default="collm")
    up.add_argument("--torch-threads", type=int, default=1, help="torch threads per replica")
    up.add_argument("--run-dir", default=".collm/run", help="where own NATS/Redis keep their data")
    up.add_argument("--log-json", action="store_true", help="JSON log lines instead of text")
    up.set_defaults(func=_up)

    micro = sub.add_parser("micro", help="NATS micro services: ls, info, stats")
    micro.add_argument("verb", choices=["ls", "info", "stats"])
    micro.add_argument("name", nargs="?", default=None, help="service name, e.g. collm-replica")
    micro.add_argument("--timeout", type=float, default=0.5)
    micro.add_argument("--json", action="store_true")
    micro.set_defaults(func=_micro)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
