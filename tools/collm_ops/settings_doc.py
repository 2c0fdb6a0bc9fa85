"""Markdown tables of every service's settings, generated from the settings classes themselves.

`python -m collm_ops.settings_doc` prints what docs/settings.md's tables hold (`--write docs/settings.md`
rewrites them there); a test checks that the page names every variable, so the documentation cannot
fall behind the code.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator

from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings

from collm_common.settings import CommonSettings

SERVICES: dict[str, str] = {
    "gateway": "collm_gateway.settings:GatewaySettings",
    "replica": "collm_replica.settings:ReplicaSettings",
    "coordinator": "collm_coordinator.settings:CoordinatorSettings",
    "aggregator": "collm_aggregator.settings:AggregatorSettings",
}


def settings_class(path: str) -> type[BaseSettings]:
    module, _, name = path.partition(":")
    cls = getattr(importlib.import_module(module), name)
    assert issubclass(cls, BaseSettings)
    return cls


def env_name(cls: type[BaseSettings], field: str) -> str:
    return str(cls.model_config.get("env_prefix", "")).upper() + field.upper()


def _default(info: FieldInfo) -> str:
    if info.default_factory is not None:
        return "(computed)"
    value = info.default
    if value is None:
        return "unset"
    if isinstance(value, tuple | list):
        return ",".join(str(v) for v in value) or "(empty)"
    return str(value)


def rows(cls: type[BaseSettings], own_only: bool) -> Iterator[tuple[str, str, str]]:
    common = set(CommonSettings.model_fields)
    for name, info in cls.model_fields.items():
        if own_only and name in common:
            continue
        desc = (info.description or "").replace("|", "\\|").replace("\n", " ")
        yield env_name(cls, name), _default(info).replace("|", "\\|"), desc


def table(cls: type[BaseSettings], own_only: bool = True) -> str:
    lines = ["| variable | default | meaning |", "|---|---|---|"]
    lines += [f"| `{env}` | `{default}` | {desc} |" for env, default, desc in rows(cls, own_only)]
    return "\n".join(lines)


def all_env_names() -> set[str]:
    names = {env for env, _, _ in rows(CommonSettings, own_only=False)}
    for path in SERVICES.values():
        names |= {env for env, _, _ in rows(settings_class(path), own_only=True)}
    return names


def render() -> str:
    parts = ["### Every service\n", table(CommonSettings, own_only=False), ""]
    for service, path in SERVICES.items():
        parts += [f"### {service}\n", table(settings_class(path)), ""]
    return "\n".join(parts)


BEGIN = "<!-- settings:begin -->"
END = "<!-- settings:end -->"


def splice(readme: str) -> str:
    """`readme` with the text between the settings markers replaced by `render()`."""
    head, sep, rest = readme.partition(BEGIN)
    _, sep2, tail = rest.partition(END)
    if not sep or not sep2:
        raise ValueError(f"the page has no {BEGIN} ... {END} block")
    return f"{head}{BEGIN}\n{render()}\n{END}{tail}"


if __name__ == "__main__":
    import sys
    from pathlib import Path

    if len(sys.argv) == 3 and sys.argv[1] == "--write":
        path = Path(sys.argv[2])
        path.write_text(splice(path.read_text()))
    else:
        print(render())  # noqa: T201
