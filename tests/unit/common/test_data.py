import json
from pathlib import Path

import pytest

from collm_common.data import Example, in_eval_split, load_dataset, write_jsonl

pytestmark = pytest.mark.unit


def test_jsonl_and_csv_with_aliases(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text(
        json.dumps({"instruction": "2+2?", "output": "4", "domain": "math"})
        + "\n"
        + json.dumps({"prompt": "hi", "response": "hello", "id": "x1"})
        + "\n"
    )
    (tmp_path / "b.csv").write_text("question,answer\nwhat,that\n")
    ds = load_dataset(tmp_path, eval_fraction=0.0)
    prompts = sorted(e.prompt for e in ds.train)
    assert prompts == ["2+2?", "hi", "what"]
    assert ds.eval == []
    assert "math" in ds.domains


def test_explicit_split_dirs(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "train" / "t.jsonl", [Example("1", "p", "r")])
    write_jsonl(tmp_path / "eval" / "e.jsonl", [Example("2", "p2", "r2")])
    ds = load_dataset(tmp_path)
    assert [e.id for e in ds.train] == ["1"] and [e.id for e in ds.eval] == ["2"]


def test_hash_split_is_stable_and_near_fraction() -> None:
    ids = [f"ex-{i}" for i in range(2000)]
    first = [in_eval_split(i, 0.1) for i in ids]
    assert first == [in_eval_split(i, 0.1) for i in ids]
    assert 0.07 < sum(first) / len(ids) < 0.13


def test_missing_fields_are_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text(json.dumps({"prompt": "only"}) + "\n")
    with pytest.raises(ValueError, match="needs a prompt and a response"):
        load_dataset(tmp_path)
