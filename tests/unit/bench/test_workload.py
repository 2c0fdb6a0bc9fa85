"""Prompt building, domain mix, model mapping, the request plan, SSE decoding and request bodies."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from collm_bench.client import ClientOptions, SSEDecoder, endpoint_url, error_message, request_body
from collm_common.data import Example
from collm_workload.prompts import PromptBuilder, PromptError, parse_mix, read_domain_dir
from collm_workload.records import RequestRecord, read_records, write_records
from collm_workload.tokens import CharEstimateCounter, HFTokenizerCounter
from collm_workload.traces import LengthPolicy, TraceRequest
from collm_workload.workload import ArrivalSpec, ModelMap, Slo, draw_domains, plan_requests, request_shapes

pytestmark = pytest.mark.unit


class WordTokenizer:
    """A whitespace tokenizer with the encode/decode surface of a Hugging Face tokenizer (test double)."""

    chat_template = "<user> {content} <assistant>"

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}
        self.inverse: dict[int, str] = {}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = []
        for w in text.split():
            if w not in self.vocab:
                self.vocab[w] = len(self.vocab)
                self.inverse[self.vocab[w]] = w
            ids.append(self.vocab[w])
        return ids

    def decode(self, ids: list[int]) -> str:
        return " ".join(self.inverse[i] for i in ids)

    def apply_chat_template(self, messages: list[dict[str, str]], **_: object) -> list[int]:
        return self.encode(self.chat_template.format(content=messages[0]["content"]))


def corpus(domain: str, n: int = 30) -> list[Example]:
    return [
        Example(f"{domain}-{i}", f"{domain} question number {i} about things?", " ".join(["word"] * (20 + i)))
        for i in range(n)
    ]


def test_read_domain_dir_handles_the_raw_public_layouts(tmp_path: Path) -> None:
    d = tmp_path / "customer_support"
    d.mkdir()
    (d / "banking77_train.csv").write_text("text,category\nWhere is my card?,card_arrival\nLost pin,pin\n")
    (d / "schema.csv").write_text("Table, Field, Type\nCOURSE, id, int, extra\n")  # not prompt/response
    (d / "humaneval.jsonl").write_text(json.dumps({"prompt": "def f():", "canonical_solution": " return 1"}))
    exs = read_domain_dir(d, "customer_support")
    assert [(e.prompt, e.response) for e in exs] == [
        ("Where is my card?", "card_arrival"),
        ("Lost pin", "pin"),
        ("def f():", " return 1"),
    ]
    assert all(e.domain == "customer_support" for e in exs)


def test_read_domain_dir_reads_collm_data_format(tmp_path: Path) -> None:
    d = tmp_path / "legal"
    (d / "train").mkdir(parents=True)
    (d / "eval").mkdir()
    (d / "train" / "a.jsonl").write_text(json.dumps({"id": "x", "prompt": "p1", "response": "r1"}) + "\n")
    (d / "eval" / "b.jsonl").write_text(json.dumps({"prompt": "p2", "response": "r2"}) + "\n")
    assert sorted(e.prompt for e in read_domain_dir(d, "legal")) == ["p1", "p2"]
    with pytest.raises(PromptError, match="no prompt/response"):
        read_domain_dir(_empty(tmp_path), "empty")
    with pytest.raises(PromptError, match="does not exist"):
        read_domain_dir(tmp_path / "missing", "missing")


def _empty(tmp_path: Path) -> Path:
    d = tmp_path / "empty"
    d.mkdir()
    (d / "x.csv").write_text("a,b\n1,2\n")
    return d


def test_parse_mix() -> None:
    assert parse_mix("medical=0.5,math=0.5", []) == {"medical": 0.5, "math": 0.5}
    assert parse_mix("medical=3,math=1", []) == {"medical": 0.75, "math": 0.25}
    assert parse_mix("medical,math", []) == {"medical": 0.5, "math": 0.5}
    assert parse_mix(None, ["a", "b"]) == {"a": 0.5, "b": 0.5}
    assert parse_mix("a=1,b=0", []) == {"a": 1.0}
    for bad in ("a=x", "a=-1", "a=0"):
        with pytest.raises(PromptError):
            parse_mix(bad, [])


@pytest.mark.parametrize("target", [60, 200, 1000])
def test_builder_hits_the_target_with_the_estimate(target: int) -> None:
    counter = CharEstimateCounter(chars_per_token=4.0)
    b = PromptBuilder({"medical": corpus("medical")}, counter)
    built = b.build("medical", target, np.random.default_rng(0))
    assert target * 0.95 <= built.estimated_tokens <= target
    assert built.estimated_tokens == round(len(built.text) / 4.0)
    assert built.text.startswith("Answer the last question.") and built.text.endswith("\nAnswer:")


def test_builder_with_a_tokenizer_is_exact_and_counts_the_chat_template() -> None:
    counter = HFTokenizerCounter(WordTokenizer(), "words")
    assert counter.chat_overhead() == 2  # "<user>" and "<assistant>"
    b = PromptBuilder({"math": corpus("math")}, counter)
    for target in (40, 150, 500):
        built = b.build("math", target, np.random.default_rng(target))
        # Whitespace tokens add up exactly: only the cut piece's trailing separator may be off by one.
        assert target - 2 <= built.estimated_tokens <= target
        assert built.estimated_tokens == counter.count(built.text) + 2


def test_builder_short_target_cuts_the_question() -> None:
    counter = CharEstimateCounter(chars_per_token=4.0)
    b = PromptBuilder({"math": corpus("math")}, counter)
    built = b.build("math", 3, np.random.default_rng(0))
    assert len(built.text) == 12 and built.text.startswith("Question:")
    assert b.build("math", 1, np.random.default_rng(0)).text


def test_builder_is_deterministic_per_seed_and_domain_checked() -> None:
    b = PromptBuilder({"math": corpus("math")}, CharEstimateCounter())
    one = b.build("math", 300, np.random.default_rng(5)).text
    assert one == b.build("math", 300, np.random.default_rng(5)).text
    assert one != b.build("math", 300, np.random.default_rng(6)).text
    with pytest.raises(PromptError, match="no text for domain"):
        b.build("law", 10, np.random.default_rng(0))


def test_model_map() -> None:
    m = ModelMap({"medical": "medical-lora", "math": ""}, "collm-{domain}", base_model="collm-base")
    assert m.model_for("medical") == "medical-lora"
    assert m.model_for("math") == "collm-base"
    assert m.model_for("code") == "collm-code"
    assert ModelMap(template="", base_model="b").model_for("code") == "b"
    with pytest.raises(PromptError, match="no base model"):
        ModelMap(template="").model_for("code")


def test_plan_follows_the_mix_and_repeats_with_the_seed() -> None:
    builder = PromptBuilder({"medical": corpus("medical"), "math": corpus("math")}, CharEstimateCounter())
    shapes = [TraceRequest(i * 0.1, 50, 8) for i in range(2000)]
    slo = Slo(1000, 100)
    by_domain = {"math": Slo(500, 50)}
    plan = plan_requests(shapes, {"medical": 0.75, "math": 0.25}, builder, ModelMap(), slo, by_domain, seed=1)
    counts = Counter(p.domain for p in plan)
    assert [p.domain for p in plan] == draw_domains(len(shapes), {"math": 1, "medical": 3}, seed=1)
    assert counts["medical"] / len(plan) == pytest.approx(0.75, abs=0.03)
    assert all(p.model == p.domain for p in plan)
    assert all(
        (p.slo_ttft_ms, p.slo_tpot_ms) == ((500, 50) if p.domain == "math" else (1000, 100)) for p in plan
    )
    assert [p.request_id for p in plan[:2]] == ["r000000", "r000001"]
    assert plan[5].scheduled_s == pytest.approx(0.5) and plan[5].max_tokens == 8
    again = plan_requests(
        shapes, {"medical": 0.75, "math": 0.25}, builder, ModelMap(), slo, by_domain, seed=1
    )
    assert [(p.domain, p.prompt) for p in again] == [(p.domain, p.prompt) for p in plan]


def test_request_shapes_synthetic_and_trace() -> None:
    trace = [TraceRequest(float(i), 1000 + i, 10 + i) for i in range(50)]
    lengths = LengthPolicy(max_input_tokens=1002)
    shapes = request_shapes(ArrivalSpec("poisson", 10.0, rate_rps=2.0, seed=3), trace, lengths)
    assert shapes[0].arrival_s == 0.0 and max(s.arrival_s for s in shapes) < 10.0
    # Lengths come from the trace in order (then clipped).
    assert [(s.input_tokens, s.output_tokens) for s in shapes[:4]] == [
        (1000, 10),
        (1001, 11),
        (1002, 12),
        (1002, 13),
    ]
    fixed = request_shapes(ArrivalSpec("constant", 2.0, rate_rps=2.0), None, LengthPolicy(), 64, 8)
    assert [(s.arrival_s, s.input_tokens, s.output_tokens) for s in fixed] == [
        (0, 64, 8),
        (0.5, 64, 8),
        (1.0, 64, 8),
        (1.5, 64, 8),
    ]
    replay = request_shapes(
        ArrivalSpec("trace", 5.0, rate_rps=2.0, trace_start_s=10.0), trace, LengthPolicy()
    )
    assert len(replay) == 10 and replay[0].input_tokens == 1010
    native = request_shapes(
        ArrivalSpec("trace", 5.0, trace_start_s=10.0, max_requests=3), trace, LengthPolicy()
    )
    assert [s.arrival_s for s in native] == [0.0, 1.0, 2.0]
    with pytest.raises(ValueError, match="need a rate"):
        ArrivalSpec("gamma", 10.0)
    with pytest.raises(ValueError, match="need a trace"):
        request_shapes(ArrivalSpec("trace", 10.0), None, LengthPolicy())


def test_sse_decoder() -> None:
    d = SSEDecoder()
    assert d.feed(": ping") is None
    assert d.feed('data: {"a": 1}') is None
    assert d.feed("") == '{"a": 1}'
    assert d.feed("event: message") is None
    assert d.feed("data:x") is None and d.feed("data: y\r") is None
    assert d.feed("\r") == "x\ny"
    assert d.feed("") is None
    d.feed("data: [DONE]")
    assert d.flush() == "[DONE]"


def test_request_bodies_and_urls() -> None:
    from collm_workload.workload import PlannedRequest

    p = PlannedRequest("r1", 1, 0.0, "medical", "medical", "hi", 5, 5, 7, 800.0, None)
    chat = request_body(p, ClientOptions(url="u", send_slo=True))
    assert chat["messages"] == [{"role": "user", "content": "hi"}] and chat["slo"] == {"ttft_ms": 800.0}
    assert chat["stream"] and chat["stream_options"] == {"include_usage": True} and chat["max_tokens"] == 7
    comp = request_body(p, ClientOptions(url="u", endpoint="completions", ignore_eos=False))
    assert (
        comp["prompt"] == "hi" and "messages" not in comp and "ignore_eos" not in comp and "slo" not in comp
    )
    assert endpoint_url("http://h:1", "chat") == "http://h:1/v1/chat/completions"
    assert endpoint_url("http://h:1/v1/", "completions") == "http://h:1/v1/completions"
    with pytest.raises(ValueError):
        endpoint_url("h:1", "chat")
    assert error_message(b'{"error": {"message": "bad model", "code": 404}}') == "bad model"
    assert error_message(b'{"detail": "nope"}') == "nope"
    assert error_message(b"plain text") == "plain text"


def test_records_round_trip(tmp_path: Path) -> None:
    r = RequestRecord("r0", 0, "medical", "m", "ok", 0.0, sent_s=0.0, ttft_ms=1.5, itl_ms=[1.0, 2.0])
    write_records(tmp_path / "x.jsonl", [r])
    assert read_records(tmp_path / "x.jsonl") == [r]
    (tmp_path / "bad.jsonl").write_text('{"request_id": "r0", "status": "ok"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        read_records(tmp_path / "bad.jsonl")
