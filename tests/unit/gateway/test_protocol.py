"""Request schemas at the HTTP edge: what is accepted, refused, and how it becomes the wire request."""

import json

import pytest
from pydantic import ValidationError

from collm_gateway.catalog import parse_model_id
from collm_gateway.errors import APIError, from_validation
from collm_gateway.protocol import ChatCompletionRequest, CompletionRequest
from collm_gateway.settings import GatewaySettings

pytestmark = pytest.mark.unit

S = GatewaySettings(max_tokens_limit=100, default_max_tokens=16)


def chat(**kw) -> ChatCompletionRequest:
    kw.setdefault("model", "m")
    kw.setdefault("messages", [{"role": "user", "content": "hi"}])
    return ChatCompletionRequest.model_validate(kw)


def test_unknown_openai_fields_are_accepted_and_ignored() -> None:
    req = chat(frequency_penalty=0.5, response_format={"type": "text"}, metadata={"a": "b"}, tools=[])
    assert req.ignored_fields == ["metadata"]
    req.check_supported()  # each sent at its neutral value
    req.check_supported()


def test_sampling_translation_and_defaults() -> None:
    req = chat(max_tokens=5, temperature=0, top_p=0.5, seed=7, stop="END")
    p = req.sampling(S)
    assert (p.max_tokens, p.temperature, p.top_p, p.seed, p.stop) == (5, 0.0, 0.5, 7, ["END"])
    d = chat().sampling(S)
    assert d.max_tokens == 16 and d.temperature == 1.0 and d.top_p == 1.0 and d.stop == []


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    assert chat(max_tokens=5, max_completion_tokens=9).sampling(S).max_tokens == 9


def test_max_tokens_above_the_limit_is_a_400() -> None:
    with pytest.raises(APIError) as err:
        chat(max_tokens=101).sampling(S)
    assert err.value.status == 400 and err.value.param == "max_tokens" and "100" in err.value.message


@pytest.mark.parametrize(
    "bad",
    [
        {"messages": []},
        {"messages": [{"role": "wizard", "content": "x"}]},
        {"messages": "hello"},
        {"max_tokens": 0},
        {"temperature": 2.5},
        {"top_p": 0},
        {"stop": ["a"] * 9},
        {"stop": [""]},
        {"model": ""},
        {"slo": {"ttft_ms": -1}},
        {"slo": {"ttft_ms": 10, "bogus": 1}},
        {"n": 0},
    ],
)
def test_schema_violations_are_validation_errors(bad: dict) -> None:
    with pytest.raises(ValidationError):
        chat(**bad)


# Every numeric and boolean field of chat and completions bodies, with a value of a wrong JSON type.
WRONG_TYPES: list[tuple[str, object]] = [
    ("max_tokens", "16"),
    ("max_tokens", 16.0),
    ("max_tokens", True),
    ("max_completion_tokens", "16"),
    ("temperature", True),
    ("temperature", "0.5"),
    ("top_p", "1"),
    ("top_p", False),
    ("seed", "7"),
    ("seed", 7.5),
    ("n", "1"),
    ("n", True),
    ("stream", "true"),
    ("stream", 1),
    ("ignore_eos", "false"),
    ("ignore_eos", 0),
    ("logprobs", "false"),
    ("top_logprobs", "2"),
    ("stream_options", {"include_usage": "true"}),
    ("slo", {"ttft_ms": "100"}),
    ("slo", {"tpot_ms": True}),
]
COMPLETION_WRONG_TYPES: list[tuple[str, object]] = [
    ("echo", "false"),
    ("echo", 0),
    ("logprobs", "0"),
    ("best_of", "1"),
    ("best_of", 1.0),
    ("prompt", [True, 2]),
    ("prompt", [1.0, 2.0]),
    ("prompt", [[1, "2"]]),
]


@pytest.mark.parametrize(("field", "value"), WRONG_TYPES)
def test_chat_numbers_and_booleans_take_only_their_json_type(field: str, value: object) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True, field: value}
    with pytest.raises(ValidationError) as err:
        ChatCompletionRequest.model_validate_json(json.dumps(body))
    api = from_validation(err.value.errors())
    assert api.status == 400 and api.param is not None and api.param.split(".")[0] == field


CHAT_ONLY = ("max_completion_tokens", "top_logprobs")


@pytest.mark.parametrize(
    ("field", "value"), COMPLETION_WRONG_TYPES + [(f, v) for f, v in WRONG_TYPES if f not in CHAT_ONLY]
)
def test_completion_numbers_and_booleans_take_only_their_json_type(field: str, value: object) -> None:
    body = {"model": "m", "prompt": "hi", field: value}
    with pytest.raises(ValidationError) as err:
        CompletionRequest.model_validate_json(json.dumps(body))
    api = from_validation(err.value.errors())
    assert api.status == 400 and api.param is not None and api.param.split(".")[0] == field


def test_an_integer_is_a_number_as_in_openai() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 1, "top_p": 1}
    req = ChatCompletionRequest.model_validate_json(json.dumps({**body, "slo": {"ttft_ms": 500}}))
    assert (req.temperature, req.top_p, req.slo and req.slo.ttft_ms) == (1.0, 1.0, 500.0)


def test_n_up_to_the_gateway_limit() -> None:
    assert chat(n=3).sampling(GatewaySettings(max_n=3)).n == 3
    assert chat().sampling(GatewaySettings()).n == 1
    with pytest.raises(APIError) as err:
        chat(n=4).sampling(GatewaySettings(max_n=3))
    assert err.value.status == 400 and err.value.param == "n" and "3" in err.value.message


def test_stream_options_need_stream() -> None:
    with pytest.raises(APIError):
        chat(stream_options={"include_usage": True}).check_supported()
    assert chat(stream=True, stream_options={"include_usage": True}).include_usage
    assert not chat(stream=True).include_usage


def test_content_parts_text_only() -> None:
    req = chat(
        messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    )
    assert req.wire_messages()[0].content == "ab"
    img = chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    with pytest.raises(APIError) as err:
        img.wire_messages()
    assert err.value.param == "messages.0.content.0"


def test_slo_body_over_headers_over_defaults() -> None:
    headers = {"x-collm-slo-ttft-ms": "300", "x-collm-slo-tpot-ms": "40"}
    assert chat().slo_targets({}, 1000.0, 100.0).model_dump(exclude={"v"}) == {
        "ttft_ms": 1000.0,
        "tpot_ms": 100.0,
    }
    assert chat().slo_targets(headers, 1000.0, 100.0).ttft_ms == 300.0
    body = chat(slo={"ttft_ms": 200}).slo_targets(headers, 1000.0, 100.0)
    assert (body.ttft_ms, body.tpot_ms) == (200.0, 40.0)
    with pytest.raises(APIError) as err:
        chat().slo_targets({"x-collm-slo-ttft-ms": "soon"}, None, None)
    assert err.value.status == 400


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("hello", ("hello", None)),
        (["hello"], ("hello", None)),
        ([1, 2, 3], (None, [1, 2, 3])),
        ([[4, 5]], (None, [4, 5])),
    ],
)
def test_completion_prompt_forms(prompt, expected) -> None:
    assert CompletionRequest(model="m", prompt=prompt).wire_prompt() == expected


@pytest.mark.parametrize("prompt", [["a", "b"], [[1], [2]], [], [[]], [-1]])
def test_unsupported_prompt_forms_are_400(prompt) -> None:
    with pytest.raises(APIError) as err:
        CompletionRequest(model="m", prompt=prompt).wire_prompt()
    assert err.value.status == 400 and err.value.param == "prompt"


@pytest.mark.parametrize(
    ("field", "value"), [("echo", True), ("best_of", 3), ("suffix", "x"), ("min_tokens", 4)]
)
def test_completion_features_that_would_change_the_answer_are_refused(field: str, value) -> None:
    with pytest.raises(APIError) as err:
        CompletionRequest.model_validate({"model": "m", "prompt": "p", field: value}).check_supported()
    assert err.value.status == 400 and err.value.param == field


def test_model_ids() -> None:
    assert parse_model_id("base", "base").adapter is None
    ref = parse_model_id("medical@v3", "base")
    assert (ref.adapter, ref.version, ref.label) == ("medical", 3, "medical")
    assert parse_model_id("medical", "base").version is None
    for bad in ("medical@v0", "medical@3", "a b", "x@v1@v2", "../etc", "medical@v"):
        assert parse_model_id(bad, "base") is None
    # a base model id that is not a valid adapter token still resolves to the base model
    assert parse_model_id("org/Model-1.5B", "org/Model-1.5B").adapter is None


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("functions", [{"name": "f"}]),
        ("function_call", "auto"),
        ("guided_json", {"type": "object"}),
        ("use_beam_search", True),
        ("stop_token_ids", [2]),
        ("modalities", ["text", "audio"]),
    ],
)
def test_chat_fields_that_would_change_the_answer_are_refused_by_name(field: str, value: object) -> None:
    with pytest.raises(APIError) as err:
        chat(**{field: value}).check_supported()
    assert err.value.status == 400 and err.value.param == field and field in err.value.message


def test_sampling_fields_reach_the_wire() -> None:
    req = chat(
        temperature=0.5,
        top_k=5,
        min_p=0.1,
        presence_penalty=-1.5,
        frequency_penalty=2,
        repetition_penalty=1.3,
        logit_bias={"17": -100, "4": 2.5},
        logprobs=True,
        top_logprobs=4,
    )
    req.check_supported()
    sp = req.sampling(GatewaySettings())
    assert (sp.temperature, sp.top_k, sp.min_p) == (0.5, 5, 0.1)
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (-1.5, 2.0, 1.3)
    assert sp.logit_bias == [(17, -100.0), (4, 2.5)] and sp.logprobs == 4
    assert chat(logprobs=True).sampling(GatewaySettings()).logprobs == 0
    plain = chat().sampling(GatewaySettings())
    assert plain.logprobs is None and plain.top_k == 0 and plain.logit_bias == []
    text = CompletionRequest.model_validate({"model": "m", "prompt": "p", "logprobs": 3})
    assert text.sampling(GatewaySettings()).logprobs == 3


@pytest.mark.parametrize(
    "fields",
    [
        {"top_k": -2},
        {"top_k": 1.5},
        {"min_p": 1.5},
        {"min_p": -0.1},
        {"presence_penalty": 2.5},
        {"frequency_penalty": -3},
        {"repetition_penalty": 0},
        {"repetition_penalty": "1"},
        {"logit_bias": {"5": 101}},
        {"logit_bias": {"5": "1"}},
        {"logit_bias": {str(i): 1 for i in range(301)}},
        {"logprobs": 1},
        {"logprobs": True, "top_logprobs": 21},
        {"logprobs": True, "top_logprobs": -1},
    ],
)
def test_sampling_fields_out_of_range_are_400(fields: dict[str, object]) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    with pytest.raises(ValidationError) as err:
        ChatCompletionRequest.model_validate_json(json.dumps(body))
    api = from_validation(err.value.errors())
    assert api.status == 400 and api.param is not None and api.param.split(".")[0] in fields


@pytest.mark.parametrize("bias", [{"x": 1}, {"-1": 1}, {"1.5": 2}])
def test_logit_bias_keys_must_be_token_ids(bias: dict[str, float]) -> None:
    with pytest.raises(APIError) as err:
        chat(logit_bias=bias).sampling(GatewaySettings())
    assert err.value.status == 400 and err.value.param == "logit_bias"


def test_top_logprobs_needs_logprobs() -> None:
    with pytest.raises(APIError) as err:
        chat(top_logprobs=2).check_supported()
    assert err.value.status == 400 and err.value.param == "top_logprobs"


def test_null_flags_mean_their_default_and_other_values_stay_refused() -> None:
    assert chat(stream=None).stream is False
    c = CompletionRequest.model_validate({"model": "m", "prompt": "p", "echo": None, "stream": None})
    assert (c.echo, c.stream) == (False, False)
    c.check_supported()
    with pytest.raises(ValidationError):
        chat(stream="true")
    with pytest.raises(ValidationError):
        chat(stream=1)


def test_a_list_of_prompts_is_one_request_per_prompt() -> None:
    def comp(prompt, **kw) -> CompletionRequest:
        return CompletionRequest.model_validate({"model": "m", "prompt": prompt, **kw})

    assert [p.wire_prompt() for p in comp(["a", "b"], n=2).split_prompts(8)] == [("a", None), ("b", None)]
    assert [p.n for p in comp(["a", "b"], n=2).split_prompts(8)] == [2, 2]
    assert [p.wire_prompt() for p in comp([[1, 2], [3]]).split_prompts(8)] == [(None, [1, 2]), (None, [3])]
    for one in ("a", ["a"], [1, 2, 3], [[1, 2]]):
        req = comp(one)
        assert req.split_prompts(8) == [req]
    with pytest.raises(APIError) as err:
        comp(["a"] * 9).split_prompts(8)
    assert err.value.status == 400 and err.value.param == "prompt" and "8" in err.value.message
    with pytest.raises(APIError) as err:
        comp(["a", "b"], stream=True).split_prompts(8)
    assert err.value.status == 400 and err.value.param == "stream"
