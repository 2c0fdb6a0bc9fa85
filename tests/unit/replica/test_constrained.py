"""Constrained decoding in the engine on the tiny model: every output of the 22-schema suite parses and
validates when it ends with "stop", in one mixed batch beside unconstrained requests that decode as they
would alone; tool-call grammars; a grammar the library cannot run is refused with a 400 naming its field."""

from __future__ import annotations

import json

import jsonschema
import pytest

from collm_bench.schemas import SCHEMAS
from collm_common.structured import Tool, json_schema_grammar, parse_tool_calls, tool_grammar
from collm_replica.constrain import grammar_error_text
from collm_replica.engine import Engine, EngineConfig, EngineRequest
from collm_replica.engine.cosched import NoTraining
from collm_replica.engine.types import EngineRefusal
from collm_replica.models import LoadedModel
from tests.unit.replica.helpers import Collector, greedy, submit_all
from tests.unit.replica.test_engine import P1, P2

UNSUPPORTED = {"bounded_map"}  # propertyNames: llguidance refuses it


def constrained(rid: str, grammar: str, seed: int, max_tokens: int = 300, n: int = 1) -> EngineRequest:
    return EngineRequest(
        rid,
        P2,
        n=n,
        max_tokens=max_tokens,
        temperature=1.0,
        seed=seed,
        grammar=grammar,
        grammar_param="response_format",
    )


def test_schema_suite_outputs_validate_in_a_mixed_batch(tiny: LoadedModel) -> None:
    with Engine(tiny, EngineConfig(), NoTraining()) as eng:
        alone = submit_all(eng, [greedy("free", P1, 12)])["free"].token_ids
        reqs = [
            constrained(name, json_schema_grammar(schema), seed=i)
            for i, (name, schema) in enumerate(SCHEMAS.items())
            if name not in UNSUPPORTED
        ]
        res = submit_all(eng, [*reqs, greedy("free", P1, 12)], timeout_s=240)
    assert res["free"].token_ids == alone
    stopped = 0
    for r in reqs:
        out = res[r.request_id]
        if out.finished.finish_reason != "stop":
            continue
        stopped += 1
        jsonschema.validate(json.loads(out.text), SCHEMAS[r.request_id])
    assert len(reqs) >= 20 and stopped >= len(reqs) - 2


def test_an_unsupported_schema_is_refused_naming_the_field(tiny: LoadedModel) -> None:
    with Engine(tiny, EngineConfig(), NoTraining()) as eng:
        for lark, param in (
            (json_schema_grammar(SCHEMAS["bounded_map"]), "response_format"),
            ("start: %json {", "tools"),
        ):
            req = constrained("bad", lark, 0)
            req.grammar_param = param
            with pytest.raises(EngineRefusal) as err:
                eng.submit(req, Collector())
            assert err.value.code == 400 and err.value.param == param
            # One line that names the field and the library's reason, none of the grammar CoLLM wrote.
            assert err.value.message.startswith(f"{param}: unsupported or invalid schema: ")
            assert "\n" not in err.value.message and "x-guidance" not in err.value.message
        assert grammar_error_text(
            'at 1(8): failed: Unimplemented keys: ["propertyNames"]\n 1 | start: %json {}'
        ) == ('failed: Unimplemented keys: ["propertyNames"]')


TOOLS = [
    Tool(
        "get_weather",
        "Weather in a city",
        {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}},
            "required": ["city"],
            "additionalProperties": False,
        },
    ),
    Tool(
        "add",
        "Add two integers",
        {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": 0, "maximum": 99},
                "b": {"type": "integer", "minimum": 0, "maximum": 99},
            },
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    ),
]


@pytest.mark.parametrize(("choice", "parallel"), [("required", False), ("add", False), ("required", True)])
def test_forced_tool_calls_parse_and_match_their_parameters(
    tiny: LoadedModel, choice: str, parallel: bool
) -> None:
    grammar = tool_grammar(TOOLS, choice, parallel)
    with Engine(tiny, EngineConfig(), NoTraining()) as eng:
        res = submit_all(eng, [constrained(f"t{s}", grammar, seed=s, n=2) for s in range(3)], timeout_s=120)
    by_name = {t.name: t for t in TOOLS}
    for c in res.values():
        texts: dict[int, str] = {}
        for e in c.events:
            if e.kind == "token":
                texts[e.index] = texts.get(e.index, "") + e.text
        assert c.finished.choices is not None
        for end in c.finished.choices:
            if end.finish_reason != "stop":
                continue
            calls = parse_tool_calls(texts[end.index])
            assert calls, texts[end.index]
            assert parallel or len(calls) == 1
            for call in calls:
                assert choice == "required" or call.name == choice
                jsonschema.validate(json.loads(call.arguments), by_name[call.name].parameters)


def test_auto_tool_choice_allows_text_or_calls(tiny: LoadedModel) -> None:
    grammar = tool_grammar(TOOLS, "auto", False)
    with Engine(tiny, EngineConfig(), NoTraining()) as eng:
        res = submit_all(
            eng, [constrained(f"a{s}", grammar, seed=s, max_tokens=40) for s in range(6)], timeout_s=120
        )
    for c in res.values():
        text = c.text
        if text.startswith("<"):
            assert c.finished.finish_reason == "length" or parse_tool_calls(text) is not None
        else:
            assert parse_tool_calls(text) is None
