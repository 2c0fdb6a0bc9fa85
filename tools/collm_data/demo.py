"""The demo dataset that `collm up` trains on out of the box, and how it is spread over the replicas.

`DEMO_DOMAINS` fixes what `python -m collm_data demo` converts from the public datasets (the project's own
converters, `collm_data.converters`): a few hundred instruction/response pairs per domain with a
held-out split, written to `data/demo/<domain>/{train,eval}/<domain>.jsonl` with a `manifest.json`
(counts, source files, licences). The result is committed; `data/README.md` gives each source, licence
and attribution.

`site_shares` lays the demo data out as sites: replica i of n holds the examples whose id hashes to i,
for every domain, in train and eval alike. Every domain is then held by every site (each with its own,
disjoint part), so each domain's adapter is trained by federated rounds over all replicas, and no example
is on two sites.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from collm_common.data import Example, load_dataset, write_jsonl
from collm_data.converters import CONVERTERS

REPO = Path(__file__).resolve().parents[2]
DEMO_DIR = REPO / "data" / "demo"


@dataclass(frozen=True)
class DemoDomain:
    domain: str
    train: int  # training pairs kept (per source file of the domain)
    eval: int  # held-out pairs kept


DEMO_DOMAINS = (
    DemoDomain("math", train=400, eval=100),
    DemoDomain("medical", train=400, eval=100),
    DemoDomain("customer_support", train=400, eval=100),
)


def write_demo(source: Path, out: Path = DEMO_DIR) -> dict[str, dict[str, object]]:
    """Convert every demo domain from `source` (the folder holding the domain folders) into `out`."""
    manifests: dict[str, dict[str, object]] = {}
    for d in DEMO_DOMAINS:
        conv = CONVERTERS[d.domain](source / d.domain, limit=d.train, eval_limit=d.eval)
        n_train = write_jsonl(out / d.domain / "train" / f"{d.domain}.jsonl", conv.train)
        n_eval = write_jsonl(out / d.domain / "eval" / f"{d.domain}.jsonl", conv.eval)
        manifest: dict[str, object] = {
            "domain": d.domain,
            "train": n_train,
            "eval": n_eval,
            "command": "python -m collm_data demo",
            "sources": conv.sources,
        }
        (out / d.domain / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
        manifests[d.domain] = manifest
    return manifests


def site_of(example_id: str, n_sites: int) -> int:
    """The site (0..n_sites-1) that holds an example: a stable hash of its id."""
    h = int.from_bytes(hashlib.sha256(f"collm.demo.site:{example_id}".encode()).digest()[:8], "big")
    return h % n_sites


def split_sites(examples: Sequence[Example], n_sites: int) -> list[list[Example]]:
    sites: list[list[Example]] = [[] for _ in range(n_sites)]
    for e in examples:
        sites[site_of(e.id, n_sites)].append(e)
    return sites


def site_shares(replica_ids: Sequence[str], out: Path, demo: Path = DEMO_DIR) -> dict[str, Path]:
    """Write each replica's share of the demo data under `out/<replica>/{train,eval}/<domain>.jsonl`
    (rewritten on every call) and return replica id -> its data directory."""
    n = len(replica_ids)
    dirs = {rid: out / rid for rid in replica_ids}
    for domain_dir in sorted(p for p in demo.iterdir() if (p / "train").is_dir()):
        ds = load_dataset(domain_dir, domain=domain_dir.name)
        for split, examples in (("train", ds.train), ("eval", ds.eval)):
            for rid, share in zip(replica_ids, split_sites(examples, n), strict=True):
                write_jsonl(dirs[rid] / split / f"{domain_dir.name}.jsonl", share)
    return dirs


def demo_domains(demo: Path = DEMO_DIR) -> list[str]:
    return sorted(p.name for p in demo.iterdir() if (p / "train").is_dir()) if demo.is_dir() else []
