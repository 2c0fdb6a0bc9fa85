"""Incremental detokenization never emits a broken UTF-8 character."""

from __future__ import annotations

from collm_replica.models import LoadedModel
from collm_replica.sampling import IncrementalDetokenizer


def test_incremental_detok_is_exact_and_never_splits_characters(tiny: LoadedModel) -> None:
    text = "caf\u00e9 \u4f60\u597d \U0001f600 hello na\u00efve \u00e9\u00e9"
    ids = tiny.tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tiny.tokenizer)
    deltas = [detok.push(t) for t in ids]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    assert len(ids) > len([d for d in deltas if d])  # some tokens were partial characters, held back
