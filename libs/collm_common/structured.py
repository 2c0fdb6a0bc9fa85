"""Structured outputs and tool calls: the grammars the replica's sampler enforces, and the text format of
tool calls (pure; no grammar library here: the replica compiles the grammar text with llguidance).

Grammars are llguidance's Lark dialect, where `%json {...}` embeds a JSON schema:

* `response_format: {"type": "json_schema", "json_schema": {"schema": S}}` -> `start: %json S`;
  `{"type": "json_object"}` -> any JSON object. Whitespace outside strings is not generated (compact JSON).
* tools: a call is the JSON object `{"name": N, "arguments": A}` (A valid against the tool's
  `parameters`) between `<tool_call>` and `</tool_call>`. `tool_choice: "required"` and a named function
  force one call (several in a row with `parallel_tool_calls`), `"auto"` lets the output be either plain
  text (not starting with `<`) or calls, `"none"` constrains nothing.

The tool definitions reach the model as a system message (`tool_system_prompt`), since the default
model's chat template has no tool support; an assistant turn that made calls is rendered back in the
same `<tool_call>` format, and a `tool` turn's content is the tool's result (`render_tool_calls`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}
_COMPACT = {"whitespace_flexible": False}


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI returns it


def _schema_text(schema: dict[str, Any]) -> str:
    return json.dumps({**schema, "x-guidance": _COMPACT}, separators=(",", ":"))


def json_schema_grammar(schema: dict[str, Any]) -> str:
    """Output that is one JSON value valid against `schema`."""
    return f"start: %json {_schema_text(schema)}\n"


def _call_schema(tools: list[Tool]) -> dict[str, Any]:
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": t.name}, "arguments": t.parameters or ANY_JSON_OBJECT},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    return options[0] if len(options) == 1 else {"anyOf": options}


def tool_grammar(tools: list[Tool], choice: str, parallel: bool) -> str:
    """`choice`: "auto", "required", or the name of the one function to call."""
    if choice not in ("auto", "required"):
        tools = [t for t in tools if t.name == choice]
    calls = "call+" if parallel else "call"
    lines = [
        f"calls: {calls}",
        f'call: "{TOOL_CALL_OPEN}" body "{TOOL_CALL_CLOSE}"',
        f"body: %json {_schema_text(_call_schema(tools))}",
    ]
    if choice == "auto":
        return "\n".join(["start: TEXT | calls", *lines, r"TEXT: /[^<](.|\n)*/", ""])
    return "\n".join(["start: calls", *lines, ""])


def tool_system_prompt(tools: list[Tool], choice: str) -> str:
    """The system message that tells the model which tools it has and how to call them."""
    specs = [
        {"name": t.name, "description": t.description, "parameters": t.parameters or ANY_JSON_OBJECT}
        for t in tools
    ]
    how = (
        f'To call a tool, answer with {TOOL_CALL_OPEN}{{"name": <tool name>, "arguments": <arguments '
        f"object>}}{TOOL_CALL_CLOSE} and nothing else."
    )
    if choice == "auto":
        how += " If no tool is needed, answer in plain text."
    elif choice != "required":
        how += f" Call the tool {choice}."
    return "You have these tools:\n" + json.dumps(specs, ensure_ascii=False) + "\n" + how


_CALL = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)


def parse_tool_calls(text: str) -> list[ToolCall] | None:
    """The calls of an output made only of tool calls; None when it is plain text (or malformed)."""
    stripped = text.strip()
    if not stripped.startswith(TOOL_CALL_OPEN):
        return None
    calls: list[ToolCall] = []
    end = 0
    for m in _CALL.finditer(stripped):
        if stripped[end : m.start()].strip():
            return None
        end = m.end()
        try:
            body = json.loads(m.group(1))
        except json.JSONDecodeError:
            return None
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            return None
        arguments = body.get("arguments", {})
        calls.append(ToolCall(body["name"], json.dumps(arguments, ensure_ascii=False)))
    if not calls or stripped[end:].strip():
        return None
    return calls


_CUT_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")')
_CUT_ARGUMENTS = re.compile(r'"arguments"\s*:\s*')


def parse_cut_tool_calls(text: str, name: str | None = None) -> list[ToolCall] | None:
    """The calls of an output of tool calls that `max_tokens` cut short: the complete ones, then the cut
    one with its arguments as far as they got (not JSON yet), named as the output names it, else `name`
    (the function a named `tool_choice` forces); a cut call whose name is not known yet is left out. None
    when the output is not calls (plain text: it does not start with `<`, which only a call may)."""
    stripped = text.lstrip()
    if not stripped.startswith("<"):
        return None
    calls: list[ToolCall] = []
    end = 0
    for m in _CALL.finditer(stripped):
        if stripped[end : m.start()].strip():
            break
        try:
            body = json.loads(m.group(1))
        except json.JSONDecodeError:
            break
        if isinstance(body, dict) and isinstance(body.get("name"), str):
            calls.append(ToolCall(body["name"], json.dumps(body.get("arguments", {}), ensure_ascii=False)))
        end = m.end()
    rest = stripped[end:].lstrip()
    if not rest:
        return calls
    if rest.startswith(TOOL_CALL_OPEN):
        body_text = rest[len(TOOL_CALL_OPEN) :]
    elif TOOL_CALL_OPEN.startswith(rest):
        body_text = ""
    else:
        return calls
    cut_name = name
    m_name = _CUT_NAME.match(body_text)
    if m_name is not None:
        cut_name = json.loads(m_name.group(1))
    if cut_name is None:
        return calls
    m_args = _CUT_ARGUMENTS.search(body_text)
    arguments = body_text[m_args.end() :] if m_args is not None else ""
    if arguments.endswith("}") or TOOL_CALL_CLOSE[:2] in arguments:
        # Cut in the closing tag: the object is whole, and its arguments are JSON.
        whole = body_text.split(TOOL_CALL_CLOSE[:2])[0]
        try:
            body = json.loads(whole)
            arguments = json.dumps(body.get("arguments", {}), ensure_ascii=False)
        except (json.JSONDecodeError, AttributeError):
            pass
    calls.append(ToolCall(cut_name, arguments))
    return calls


def render_tool_calls(calls: list[ToolCall]) -> str:
    """An assistant turn that made `calls`, as the model wrote it."""
    return "".join(
        TOOL_CALL_OPEN
        + json.dumps({"name": c.name, "arguments": json.loads(c.arguments or "{}")}, ensure_ascii=False)
        + TOOL_CALL_CLOSE
        for c in calls
    )
