"""The sampler's fields on fixed logits, each against an independent reference: numpy written from the
OpenAI/vLLM definitions, and transformers' logits processors where their definition is the same."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from collm_replica.sampling import (
    Sampler,
    SamplingConfig,
    apply_penalties,
    filter_probs,
    token_logprobs,
)

V = 12
LOGITS = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.5, 0.0, 1.5, -0.5, 2.5, 1.0, -3.0, 0.25])


def kept(probs: torch.Tensor) -> set[int]:
    return {int(i) for i in torch.nonzero(probs > 0).flatten()}


def hf_kept(warper: object, logits: torch.Tensor) -> set[int]:
    out = warper(torch.zeros(1, 1, dtype=torch.long), logits.clone().unsqueeze(0))  # type: ignore[operator]
    return {int(i) for i in torch.nonzero(torch.isfinite(out[0])).flatten()}


def test_presence_and_frequency_penalties_match_openai_definition() -> None:
    counts = torch.zeros(V)
    counts[3], counts[0], counts[8] = 2, 1, 5
    cfg = SamplingConfig(presence_penalty=0.7, frequency_penalty=-0.3)
    got = apply_penalties(LOGITS, cfg, counts, None)
    c = counts.numpy()
    want = LOGITS.numpy() - (c * -0.3 + (c > 0) * 0.7)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-6)


def test_repetition_penalty_matches_transformers() -> None:
    seen_ids = [0, 1, 3, 4, 11]
    seen = torch.zeros(V, dtype=torch.bool)
    seen[seen_ids] = True
    got = apply_penalties(LOGITS, SamplingConfig(repetition_penalty=1.8), None, seen)
    ref = RepetitionPenaltyLogitsProcessor(1.8)(torch.tensor([seen_ids]), LOGITS.clone().unsqueeze(0))[0]
    np.testing.assert_allclose(got.numpy(), ref.numpy(), rtol=1e-6)


def test_logit_bias_adds_to_listed_ids() -> None:
    got = apply_penalties(LOGITS, SamplingConfig(logit_bias={2: 100.0, 3: -100.0}), None, None)
    want = LOGITS.clone()
    want[2] += 100.0
    want[3] -= 100.0
    assert torch.equal(got, want)
    # +100 makes a token all but certain: greedy and sampling both pick it.
    s = Sampler(SamplingConfig(temperature=1.0, logit_bias={10: 100.0}, seed=3), [], V)
    assert {s.sample(LOGITS) for _ in range(20)} == {10}


@pytest.mark.parametrize("k", [1, 3, 7, V])
def test_top_k_matches_transformers(k: int) -> None:
    probs = torch.softmax(LOGITS, dim=-1)
    assert kept(filter_probs(probs, k, 1.0, 0.0)) == hf_kept(TopKLogitsWarper(k), LOGITS)


@pytest.mark.parametrize("p", [0.05, 0.3, 0.6, 0.9, 0.99])
def test_top_p_matches_transformers(p: float) -> None:
    probs = torch.softmax(LOGITS, dim=-1)
    assert kept(filter_probs(probs, 0, p, 0.0)) == hf_kept(TopPLogitsWarper(p), LOGITS)


@pytest.mark.parametrize("m", [0.01, 0.1, 0.3, 0.9])
def test_min_p_matches_transformers(m: float) -> None:
    probs = torch.softmax(LOGITS, dim=-1)
    assert kept(filter_probs(probs, 0, 1.0, m)) == hf_kept(MinPLogitsWarper(m), LOGITS)


def test_top_k_off_values_keep_everything() -> None:
    probs = torch.softmax(LOGITS, dim=-1)
    for k in (0, -1):
        assert kept(filter_probs(probs, k, 1.0, 0.0)) == set(range(V))


def test_filters_compose_min_p_then_top_k_then_top_p_on_the_remaining_mass() -> None:
    probs = torch.softmax(LOGITS, dim=-1).numpy()
    order = np.argsort(-probs)
    top4 = set(order[:4].tolist())
    # top_p over the 4 kept tokens, renormalised: the smallest prefix reaching 0.8 of their mass.
    p4 = probs[order[:4]] / probs[order[:4]].sum()
    n = int(np.searchsorted(np.cumsum(p4), 0.8) + 1)
    want = set(order[:n].tolist())
    assert want < top4
    assert kept(filter_probs(torch.tensor(probs), 4, 0.8, 0.0)) == want


def test_sampled_frequencies_follow_the_filtered_distribution() -> None:
    cfg = SamplingConfig(temperature=0.7, top_k=3, seed=11)
    s = Sampler(cfg, [], V)
    draws = [s.sample(LOGITS) for _ in range(3000)]
    p = torch.softmax(LOGITS / 0.7, dim=-1).numpy()
    top3 = np.argsort(-p)[:3]
    want = p[top3] / p[top3].sum()
    freq = np.array([draws.count(int(t)) for t in top3]) / len(draws)
    assert set(draws) <= set(top3.tolist())
    np.testing.assert_allclose(freq, want, atol=0.04)


def test_greedy_takes_argmax_of_penalised_logits() -> None:
    s = Sampler(SamplingConfig(temperature=0.0, frequency_penalty=2.0), [], V)
    assert s.sample(LOGITS) == 3
    s.observe(3)  # 3.0 - 2.0 = 1.0 < 2.5 (token 8)
    assert s.sample(LOGITS) == 8


def test_repetition_penalty_counts_prompt_and_output() -> None:
    s = Sampler(SamplingConfig(temperature=0.0, repetition_penalty=10.0), [3], V)
    assert s.sample(LOGITS) == 8  # 3 is in the prompt: 3.0 / 10 = 0.3
    s.observe(8)
    assert s.sample(LOGITS) == 0  # 8 generated: 2.5 / 10; next best is 2.0


def test_seeded_sampling_reproducible_and_unprocessed_logits_untouched() -> None:
    cfg = SamplingConfig(temperature=1.2, top_p=0.9, min_p=0.05, presence_penalty=0.5, seed=42)
    before = LOGITS.clone()
    runs = []
    for _ in range(2):
        s = Sampler(cfg, [1, 2], V)
        out = []
        for _ in range(30):
            t = s.sample(LOGITS)
            s.observe(t)
            out.append(t)
        runs.append(out)
    assert runs[0] == runs[1]
    assert torch.equal(LOGITS, before)


def test_logprobs_are_of_the_raw_distribution() -> None:
    lp = token_logprobs(LOGITS, 5, 3)
    ref = LOGITS.numpy() - math.log(np.exp(LOGITS.numpy()).sum())
    assert lp.token_id == 5
    assert lp.logprob == pytest.approx(ref[5], rel=1e-5)
    assert [t for t, _ in lp.top] == np.argsort(-ref)[:3].tolist()
    for t, v in lp.top:
        assert v == pytest.approx(ref[t], rel=1e-5)
    assert token_logprobs(LOGITS, 5, 0).top == []
