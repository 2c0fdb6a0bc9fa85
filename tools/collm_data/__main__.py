"""`python -m collm_data`: convert the public domain datasets into replica data directories.

    python -m collm_data list
    python -m collm_data convert --domain math --out .collm/data/math --limit 500
    python -m collm_data convert --all --out .collm/data            # one sub-directory per domain
    python -m collm_data demo                                       # rewrite data/demo (collm_data.demo)

Output of one domain: `OUT/train/<domain>.jsonl`, `OUT/eval/<domain>.jsonl` (read by
`collm_common.data.load_dataset`, so `COLLM_DATA_DIR=OUT` points a replica at it) and `OUT/manifest.json`
(sources, counts, licences). The source defaults to `../shared/data/domains` beside the repository.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from collm_common.data import write_jsonl
from collm_data.converters import CONVERTERS, SourceMissing
from collm_data.demo import DEMO_DIR, write_demo

REPO = Path(__file__).resolve().parents[2]
DEFAULT_SOURCE = REPO.parent / "shared" / "data" / "domains"
DEFAULT_OUT = Path(".collm") / "data"


def convert_one(
    domain: str, source: Path, out: Path, limit: int | None, eval_limit: int | None
) -> dict[str, object]:
    conv = CONVERTERS[domain](source / domain, limit=limit, eval_limit=eval_limit)
    n_train = write_jsonl(out / "train" / f"{domain}.jsonl", conv.train)
    n_eval = write_jsonl(out / "eval" / f"{domain}.jsonl", conv.eval)
    manifest = {
        "domain": domain,
        "source": str((source / domain).resolve()),
        "train": n_train,
        "eval": n_eval,
        "limit": limit,
        "eval_limit": eval_limit,
        "sources": conv.sources,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return manifest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m collm_data", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    ls = sub.add_parser("list", help="domains and whether their source files are present")
    ls.add_argument("--source", type=Path, default=DEFAULT_SOURCE)
    c = sub.add_parser("convert", help="convert one domain (--domain) or every domain (--all)")
    which = c.add_mutually_exclusive_group(required=True)
    which.add_argument("--domain", choices=sorted(CONVERTERS))
    which.add_argument("--all", action="store_true", help="every domain, into OUT/<domain>")
    c.add_argument(
        "--out", type=Path, default=None, help=f"output directory (default {DEFAULT_OUT}/<domain>)"
    )
    c.add_argument("--source", type=Path, default=DEFAULT_SOURCE, help="folder holding the domain folders")
    c.add_argument("--limit", type=int, default=None, help="at most N train examples per source file")
    c.add_argument(
        "--eval-limit",
        type=int,
        default=None,
        help="at most N eval examples per source (default: limit // 5)",
    )
    dm = sub.add_parser("demo", help="rewrite the committed demo dataset (data/demo) from the sources")
    dm.add_argument("--source", type=Path, default=DEFAULT_SOURCE, help="folder holding the domain folders")
    dm.add_argument("--out", type=Path, default=DEMO_DIR, help=f"output directory (default {DEMO_DIR})")
    args = p.parse_args(argv)

    if args.cmd == "demo":
        try:
            manifests = write_demo(args.source, args.out)
        except SourceMissing as exc:
            sys.stderr.write(f"collm_data: {exc}\n")
            return 2
        for d, m in manifests.items():
            sys.stdout.write(f"{d}: {m['train']} train + {m['eval']} eval examples -> {args.out / d}\n")
        return 0

    if args.cmd == "list":
        for d in sorted(CONVERTERS):
            present = (args.source / d).is_dir()
            sys.stdout.write(f"{d:18} {'present' if present else 'missing'}  {args.source / d}\n")
        return 0

    if args.limit is not None and args.limit < 1:
        p.error("--limit must be >= 1")
    eval_limit = (
        args.eval_limit if args.eval_limit is not None else (max(1, args.limit // 5) if args.limit else None)
    )
    domains = sorted(CONVERTERS) if args.all else [args.domain]
    base_out = args.out if args.out is not None else DEFAULT_OUT
    for d in domains:
        out = base_out / d if (args.all or args.out is None) else base_out
        try:
            m = convert_one(d, args.source, out, args.limit, eval_limit)
        except SourceMissing as exc:
            sys.stderr.write(f"collm_data: {d}: {exc}\n")
            return 2
        sys.stdout.write(f"{d}: {m['train']} train + {m['eval']} eval examples -> {out}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
