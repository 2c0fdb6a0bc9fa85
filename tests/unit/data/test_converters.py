"""Dataset converters: on small synthetic files written here, and on ../shared/data when it is present."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from collm_common.data import load_dataset
from collm_data.__main__ import main
from collm_data.converters import (
    CONVERTERS,
    SourceMissing,
    convert_code,
    convert_customer_support,
    convert_math,
    convert_medical,
    gsm8k_response,
    substitute,
    truncate_words,
)

pytestmark = pytest.mark.unit


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


@pytest.fixture
def domains(tmp_path: Path) -> Path:
    root = tmp_path / "domains"
    write_jsonl(
        root / "math" / "gsm8k_train.jsonl",
        [
            {"question": f"What is {i}+{i}?", "answer": f"{i}+{i} = <<{i}+{i}={2 * i}>>{2 * i}\n#### {2 * i}"}
            for i in range(10)
        ],
    )
    write_jsonl(
        root / "math" / "gsm8k_test.jsonl", [{"question": "What is 1+2?", "answer": "1+2=<<1+2=3>>3\n#### 3"}]
    )
    write_jsonl(
        root / "medical" / "medquad_niddk_ninds_cdc.jsonl",
        [
            {
                "id": f"{i:03d}-1",
                "focus": f"Topic{i % 7}",
                "question": f"What is (are) Topic{i % 7} ?",
                "answer": "It is a condition. " * 5,
            }
            for i in range(40)
        ]
        + [{"id": "bad", "focus": "X", "question": "", "answer": "no question"}],
    )
    cs = root / "customer_support"
    cs.mkdir(parents=True)
    for name, n in (("banking77_train.csv", 6), ("banking77_test.csv", 2)):
        with (cs / name).open("w", newline="", encoding="utf-8") as f:
            w = csv.writer(f)
            w.writerow(["text", "category"])
            for i in range(n):
                w.writerow([f"Where is my card {i}?", "card_arrival"])
    write_jsonl(
        root / "code" / "humaneval.jsonl",
        [
            {
                "task_id": f"HumanEval/{i}",
                "prompt": f"def f{i}(x):\n",
                "canonical_solution": "    return x\n",
                "test": "",
                "entry_point": f"f{i}",
            }
            for i in range(12)
        ],
    )
    advising = [
        {
            "sql": ['SELECT * FROM COURSE WHERE DEPARTMENT = "department0" AND NUMBER = number0 ;'],
            "variables": [
                {"name": "department0", "example": "EECS", "location": "sql-only", "type": "department"},
                {"name": "number0", "example": "595", "location": "both", "type": "number"},
            ],
            "query-split": "train",
            "sentences": [
                {
                    "question-split": "train",
                    "text": "Can undergrads take number0 ?",
                    "variables": {"department0": "", "number0": "550"},
                },
                {
                    "question-split": "test",
                    "text": "Is number0 open ?",
                    "variables": {"department0": "MATH", "number0": "101"},
                },
                {
                    "question-split": "exclude",
                    "text": "number0 ?",
                    "variables": {"department0": "", "number0": "1"},
                },
            ],
        }
    ]
    (root / "code" / "text2sql_advising.json").write_text(json.dumps(advising), encoding="utf-8")
    return root


def test_gsm8k_response_drops_calculator_annotations() -> None:
    assert gsm8k_response("48/2 = <<48/2=24>>24 clips.\n#### 72") == "48/2 = 24 clips.\nThe answer is 72."


def test_truncate_words_cuts_at_a_sentence_end() -> None:
    text = "One two three. Four five six seven. Eight nine ten eleven twelve."
    assert truncate_words(text, 100) == text
    assert truncate_words(text, 9) == "One two three. Four five six seven."
    assert truncate_words("a b c d e f", 3) == "a b c ..."


def test_substitute_whole_tokens_longest_first() -> None:
    assert substitute("number0 and number01", {"number0": "5", "number01": "7"}) == "5 and 7"


def test_math(domains: Path) -> None:
    c = convert_math(domains / "math")
    assert (len(c.train), len(c.eval)) == (10, 1)
    assert c.eval[0].response == "1+2=3\nThe answer is 3." and c.eval[0].domain == "math"
    limited = convert_math(domains / "math", limit=3, eval_limit=1)
    assert len(limited.train) == 3
    assert [e.id for e in limited.train] == [e.id for e in convert_math(domains / "math", limit=3).train]


def test_medical_splits_by_topic_and_skips_incomplete_rows(domains: Path) -> None:
    c = convert_medical(domains / "medical", eval_fraction=0.3)
    assert len(c.train) + len(c.eval) == 40
    train_topics = {e.prompt for e in c.train}
    assert not train_topics & {e.prompt for e in c.eval}  # no topic on both sides
    assert c.eval and c.train


def test_customer_support(domains: Path) -> None:
    c = convert_customer_support(domains / "customer_support")
    assert (len(c.train), len(c.eval)) == (6, 2)
    assert c.train[0].prompt.startswith("Classify") and c.train[0].response == "card_arrival"


def test_code_substitutes_sql_variables_and_drops_excluded(domains: Path) -> None:
    c = convert_code(domains / "code")
    sql = [e for e in c.train + c.eval if e.id.startswith("advising")]
    assert len(sql) == 2
    train_sql = next(e for e in c.train if e.id.startswith("advising"))
    assert "550" in train_sql.prompt and 'DEPARTMENT = "EECS" AND NUMBER = 550' in train_sql.response
    test_sql = next(e for e in c.eval if e.id.startswith("advising"))
    assert 'DEPARTMENT = "MATH" AND NUMBER = 101' in test_sql.response
    assert len([e for e in c.train + c.eval if e.id.startswith("humaneval")]) == 12


def test_limited_selection_does_not_correlate_with_the_hash_split(tmp_path: Path) -> None:
    from collm_common.data import in_eval_split

    root = tmp_path / "math"
    write_jsonl(root / "gsm8k_train.jsonl", [{"question": f"q{i}", "answer": f"a {i}"} for i in range(2000)])
    write_jsonl(root / "gsm8k_test.jsonl", [{"question": "q", "answer": "a"}])
    kept = convert_math(root, limit=100).train
    share = sum(in_eval_split(e.id, 0.1) for e in kept) / len(kept)
    assert 0.02 < share < 0.25  # about the split's 10%, not 100% (a selection by the same hash)


def test_missing_source_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(SourceMissing):
        convert_math(tmp_path)


def test_cli_writes_a_dataset_that_load_dataset_reads(domains: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    assert main(["convert", "--all", "--source", str(domains), "--out", str(out), "--limit", "5"]) == 0
    for d in CONVERTERS:
        ds = load_dataset(out / d)
        assert 0 < len(ds.train) and ds.domains == [d]
        manifest = json.loads((out / d / "manifest.json").read_text())
        assert manifest["domain"] == d and manifest["limit"] == 5
    ds = load_dataset(out / "math")
    assert (len(ds.train), len(ds.eval)) == (5, 1)
    assert (
        main(["convert", "--domain", "math", "--source", str(tmp_path / "nowhere"), "--out", str(out / "x")])
        == 2
    )
    assert "not found" in capsys.readouterr().err


def test_real_domains_convert(shared_data: Path, tmp_path: Path) -> None:
    out = tmp_path / "real"
    assert (
        main(
            ["convert", "--all", "--source", str(shared_data / "domains"), "--out", str(out), "--limit", "50"]
        )
        == 0
    )
    for d in CONVERTERS:
        ds = load_dataset(out / d)
        assert len(ds.train) >= 50 and len(ds.eval) >= 10, d
        assert all(e.prompt and e.response and e.domain == d for e in ds.train + ds.eval)
