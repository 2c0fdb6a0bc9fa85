"""The replica's local dataset: every example loaded once, into its split; persisted samples in one place."""

from __future__ import annotations

from pathlib import Path

from collm_common.data import Example, in_eval_split, write_jsonl
from collm_replica.engine import Engine, EngineConfig
from collm_replica.models import LoadedModel
from collm_replica.samples import SAMPLES_FILE, append_samples, load_local_dataset, samples_dir
from collm_replica.settings import ReplicaSettings

FRACTION = 0.2


def ex(i: str) -> Example:
    return Example(i, f"question {i}", f"answer {i}", domain="med")


def ids_by_hash(prefix: str, n: int, want_eval: bool) -> list[str]:
    out = []
    k = 0
    while len(out) < n:
        i = f"{prefix}{k}"
        if in_eval_split(i, FRACTION) == want_eval:
            out.append(i)
        k += 1
    return out


def settings(data: Path) -> ReplicaSettings:
    return ReplicaSettings(replica_id="rd", model="tiny", data_dir=data, eval_fraction=FRACTION)


def test_split_directories_keep_their_split_and_samples_are_loaded_once_by_hash(tmp_path: Path) -> None:
    data = tmp_path / "data"
    # Training files whose ids would hash into the eval split, and eval files whose ids would hash into
    # train: the explicit directories must win for them, whatever the hash says.
    train_ids = ids_by_hash("t", 6, want_eval=True) + ids_by_hash("u", 6, want_eval=False)
    eval_ids = ids_by_hash("e", 3, want_eval=False)
    write_jsonl(data / "train" / "med.jsonl", [ex(i) for i in train_ids])
    write_jsonl(data / "eval" / "med.jsonl", [ex(i) for i in eval_ids])
    s = settings(data)
    # Samples received while running: persisted in the one documented place, split by hash like
    # `Engine.add_examples` split them when they arrived (one redelivered twice).
    sample_train = ids_by_hash("s", 2, want_eval=False)
    sample_eval = ids_by_hash("s", 2, want_eval=True)
    path = samples_dir(s) / SAMPLES_FILE
    assert path.parent == data / "samples"
    append_samples(path, [ex(i) for i in sample_train + sample_eval])
    append_samples(path, [ex(sample_eval[0])])

    ds = load_local_dataset(s)
    train = [e.id for e in ds.train]
    held = [e.id for e in ds.eval]
    assert sorted(train) == sorted(train_ids + sample_train)
    assert sorted(held) == sorted(eval_ids + sample_eval)
    assert len(train) == len(set(train)) and len(held) == len(set(held))  # each loaded exactly once


def test_flat_directory_splits_by_hash_and_loads_samples_once(tmp_path: Path) -> None:
    data = tmp_path / "flat"
    ids = ids_by_hash("f", 5, want_eval=False) + ids_by_hash("g", 3, want_eval=True)
    write_jsonl(data / "med.jsonl", [ex(i) for i in ids])
    s = settings(data)
    samples = ids_by_hash("s", 2, want_eval=False) + ids_by_hash("s", 1, want_eval=True)
    append_samples(samples_dir(s) / SAMPLES_FILE, [ex(i) for i in samples])
    ds = load_local_dataset(s)
    every = [e.id for e in ds.train + ds.eval]
    assert sorted(every) == sorted(set(ids + samples)) and len(every) == len(set(every))
    assert all(in_eval_split(e.id, FRACTION) for e in ds.eval)
    assert not any(in_eval_split(e.id, FRACTION) for e in ds.train)


def test_runtime_samples_land_where_a_restart_puts_them(tmp_path: Path, tiny: LoadedModel) -> None:
    data = tmp_path / "data"
    write_jsonl(data / "train" / "med.jsonl", [ex(i) for i in ids_by_hash("t", 4, want_eval=True)])
    s = settings(data)
    eng = Engine(tiny, EngineConfig(eval_fraction=FRACTION), dataset=load_local_dataset(s))
    new = [ex(i) for i in ids_by_hash("s", 3, want_eval=False) + ids_by_hash("s", 3, want_eval=True)]
    append_samples(samples_dir(s) / SAMPLES_FILE, new)
    eng.add_examples(new)
    eng.add_examples(new[:2])  # redelivered: not added twice
    eng._iteration()
    again = load_local_dataset(s)
    assert sorted(e.id for e in eng.dataset.train) == sorted(e.id for e in again.train)
    assert sorted(e.id for e in eng.dataset.eval) == sorted(e.id for e in again.eval)
    assert eng.snapshot().local_samples == 10
