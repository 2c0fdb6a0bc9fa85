"""Admin commands for federated rounds and adapter versions (`python -m collm_aggregator.cli ...`).

    python -m collm_aggregator.cli status
    python -m collm_aggregator.cli rounds list [--adapter NAME] [--state published] [--limit 20]
    python -m collm_aggregator.cli rounds show ROUND_ID
    python -m collm_aggregator.cli rollback ADAPTER VERSION [--reason TEXT]
    python -m collm_aggregator.cli import ADAPTER PEFT_DIR [--base-model NAME] [--domains a,b]
    python -m collm_aggregator.cli export ADAPTER VERSION OUT_DIR

Everything but `export` goes through the aggregator's NATS endpoints (so it works wherever NATS is
reachable); `export` reads the version from the adapter store (digest-checked) and writes a PEFT
directory. Connection settings come from the usual `COLLM_NATS_URL`, `COLLM_REDIS_URL`,
`COLLM_REDIS_PREFIX`. Output is JSON, one document per command; errors go to stderr with exit code 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from pydantic import BaseModel

from collm_common import subjects
from collm_common.adapter_io import export_peft_dir
from collm_common.bus import Bus, BusError
from collm_common.settings import CommonSettings
from collm_common.store import AdapterStore, StoreError
from collm_common.wire.admin import (
    AdapterVersionInfo,
    AggregatorStatus,
    GetRound,
    ImportAdapter,
    ListRounds,
    RollbackAdapter,
    RoundDetail,
    RoundList,
    StatusRequest,
)


async def call(
    settings: CommonSettings, verb: str, msg: BaseModel, reply: type[Any], timeout_s: float = 60
) -> Any:
    bus = await Bus.connect(settings, "collm-admin")
    try:
        return await bus.request(subjects.aggregator(verb), msg, reply, timeout_s=timeout_s)
    finally:
        await bus.close()


async def export(settings: CommonSettings, adapter: str, version: int, out_dir: str) -> dict[str, Any]:
    store = AdapterStore.connect(settings)
    try:
        rec = await store.get_version(adapter, version)
        path = export_peft_dir(await store.get_blob(adapter, version), out_dir)
    finally:
        await store.close()
    return {"exported": rec.id, "sha256": rec.sha256, "path": str(path)}


async def run(args: argparse.Namespace) -> Any:
    s = CommonSettings(nats_connect_timeout_s=5)
    if args.cmd == "status":
        return await call(s, "status", StatusRequest(), AggregatorStatus)
    if args.cmd == "rounds" and args.sub == "list":
        return await call(
            s, "rounds", ListRounds(adapter=args.adapter, state=args.state, limit=args.limit), RoundList
        )
    if args.cmd == "rounds":
        return await call(s, "round", GetRound(round_id=args.round_id), RoundDetail)
    if args.cmd == "rollback":
        req = RollbackAdapter(adapter=args.adapter, to_version=args.version, reason=args.reason)
        return await call(s, "rollback", req, AdapterVersionInfo)
    if args.cmd == "import":
        domains = [d for d in args.domains.split(",") if d] if args.domains is not None else None
        req = ImportAdapter(adapter=args.adapter, path=args.path, base_model=args.base_model, domains=domains)
        return await call(s, "import", req, AdapterVersionInfo)
    return await export(s, args.adapter, args.version, args.out_dir)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m collm_aggregator.cli", description="CoLLM rounds and adapters"
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("status")
    rounds = sub.add_parser("rounds").add_subparsers(dest="sub", required=True)
    ls = rounds.add_parser("list")
    ls.add_argument("--adapter")
    ls.add_argument("--state")
    ls.add_argument("--limit", type=int, default=20)
    show = rounds.add_parser("show")
    show.add_argument("round_id", type=int)
    rb = sub.add_parser("rollback")
    rb.add_argument("adapter")
    rb.add_argument("version", type=int)
    rb.add_argument("--reason", default="")
    im = sub.add_parser("import")
    im.add_argument("adapter")
    im.add_argument("path")
    im.add_argument("--base-model")
    im.add_argument("--domains")
    ex = sub.add_parser("export")
    ex.add_argument("adapter")
    ex.add_argument("version", type=int)
    ex.add_argument("out_dir")
    args = p.parse_args(argv)
    try:
        result = asyncio.run(run(args))
    except (BusError, StoreError, ConnectionError, ValueError) as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 1
    doc = result.model_dump(mode="json") if isinstance(result, BaseModel) else result
    sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
