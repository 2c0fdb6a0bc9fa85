"""The committed demo dataset and how `collm up` spreads it over the replicas."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from collm_common.data import load_dataset
from collm_data.demo import DEMO_DIR, DEMO_DOMAINS, demo_domains, site_shares, split_sites

pytestmark = pytest.mark.unit


def test_the_demo_dataset_is_committed_small_and_as_its_manifests_say() -> None:
    assert demo_domains() == sorted(d.domain for d in DEMO_DOMAINS)
    size = sum(p.stat().st_size for p in DEMO_DIR.rglob("*") if p.is_file())
    assert size <= 3 * 1024 * 1024
    assert (DEMO_DIR.parent / "README.md").is_file()
    for d in DEMO_DOMAINS:
        ds = load_dataset(DEMO_DIR / d.domain, domain=d.domain)
        manifest = json.loads((DEMO_DIR / d.domain / "manifest.json").read_text())
        assert (len(ds.train), len(ds.eval)) == (manifest["train"], manifest["eval"]) == (d.train, d.eval)
        assert not {e.id for e in ds.train} & {e.id for e in ds.eval}
        assert {e.domain for e in ds.train + ds.eval} == {d.domain}


def test_every_replica_holds_a_disjoint_share_of_every_domain(tmp_path: Path) -> None:
    dirs = site_shares(["r0", "r1", "r2"], tmp_path)
    assert sorted(dirs) == ["r0", "r1", "r2"]
    sets = [load_dataset(dirs[r]) for r in ("r0", "r1", "r2")]
    for split in ("train", "eval"):
        ids = [{e.id for e in getattr(ds, split)} for ds in sets]
        assert not (ids[0] & ids[1] or ids[0] & ids[2] or ids[1] & ids[2])
        every = {e.id for d in DEMO_DOMAINS for e in getattr(load_dataset(DEMO_DIR / d.domain), split)}
        assert set().union(*ids) == every
    for ds in sets:
        assert set(ds.domains) == {d.domain for d in DEMO_DOMAINS}
    again = site_shares(["r0", "r1", "r2"], tmp_path)  # rewritten, not appended
    assert len(load_dataset(again["r0"]).train) == len(sets[0].train)


def test_one_site_holds_everything() -> None:
    ds = load_dataset(DEMO_DIR / "math")
    assert split_sites(ds.train, 1) == [ds.train]
