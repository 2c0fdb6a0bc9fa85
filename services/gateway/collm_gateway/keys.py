"""API keys: stored hashed, each mapped to a tenant, an admin flag and an optional rate limit.

A key is only ever kept as the sha256 hex of its text; the key itself is shown once, when it is made,
and never written anywhere. The gateway reads keys from `COLLM_API_KEYS` (JSON) and/or the file named
by `COLLM_API_KEYS_FILE` (YAML or JSON, the same mapping), re-reading the file when it changes:

    # keys.yaml: sha256 of the key -> what the key may do
    9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08:
      tenant: acme            # adapters owned by "acme", shared adapters and the base model
      rate_limit_rps: 5       # optional; else COLLM_RATE_LIMIT_RPS
      burst: 10
    2c26b46b68ffc68ff99b453c1d30413413422d706483bfa0f98a5e886266e7ae:
      admin: true             # the admin endpoints, and every adapter

Command line (`python -m collm_gateway.keys ...`):

    add --file keys.yaml --tenant acme [--admin] [--rate-limit-rps 5 --burst 10]
        prints a fresh key once on stdout and stores only its hash in the file
    hash [KEY]     the sha256 to put in COLLM_API_KEYS (reads the key from stdin when omitted)
    list --file keys.yaml
    remove --file keys.yaml SHA256_PREFIX
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import secrets
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

KEY_PREFIX = "sk-collm-"
SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
TENANT_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"


class ApiKeySpec(BaseModel):
    """What one key may do."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tenant: str | None = Field(
        None, pattern=TENANT_PATTERN, description="Tenant of the key (None: shared adapters only)."
    )
    admin: bool = Field(False, description="Admin endpoints, and every tenant's adapters.")
    rate_limit_rps: float | None = Field(
        None, gt=0, description="Requests per second (token bucket); None: the gateway default."
    )
    burst: int | None = Field(None, ge=1, description="Bucket size; None: the gateway default.")


def hash_key(api_key: str) -> str:
    """The sha256 hex of a key: the only form in which keys are stored or compared."""
    return hashlib.sha256(api_key.encode()).hexdigest()


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def parse_keys(raw: Mapping[str, Any] | None) -> dict[str, ApiKeySpec]:
    """Validate a {sha256: spec} mapping (raises ValueError naming the bad entry)."""
    out: dict[str, ApiKeySpec] = {}
    for digest, spec in (raw or {}).items():
        d = str(digest).strip().lower()
        if not SHA256_HEX.match(d):
            raise ValueError(
                f"API key entry {str(digest)[:16]!r}... is not a sha256 hex digest: keys are stored hashed "
                "(python -m collm_gateway.keys hash)"
            )
        try:
            out[d] = spec if isinstance(spec, ApiKeySpec) else ApiKeySpec.model_validate(spec or {})
        except ValidationError as exc:
            raise ValueError(f"API key {d[:12]}: {exc.errors()[0]['msg']}") from None
    return out


def read_keys_file(path: Path) -> dict[str, ApiKeySpec]:
    """Keys from a YAML or JSON file (JSON is YAML); an empty file holds no keys."""
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not valid YAML/JSON: {exc}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a mapping of sha256 -> key spec")
    try:
        return parse_keys(raw)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def write_keys_file(path: Path, keys: Mapping[str, ApiKeySpec]) -> None:
    """Replace the file atomically (a reader never sees half a file), readable by its owner only."""
    doc = {d: spec.model_dump(exclude_defaults=True) for d, spec in sorted(keys.items())}
    text = json.dumps(doc, indent=2) + "\n" if path.suffix == ".json" else yaml.safe_dump(doc, sort_keys=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# --- command line ----------------------------------------------------------------------------------------
def _out(text: str) -> None:
    sys.stdout.write(text + "\n")


def _err(text: str) -> None:
    sys.stderr.write(text + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m collm_gateway.keys", description="Manage gateway API keys.")
    sub = p.add_subparsers(dest="cmd", required=True)
    add = sub.add_parser("add", help="make a key; print it once; store only its hash")
    add.add_argument("--file", type=Path, required=True, help="keys file (YAML, or JSON by .json)")
    add.add_argument("--tenant", default=None, help="tenant of the key")
    add.add_argument("--admin", action="store_true", help="an admin key")
    add.add_argument("--rate-limit-rps", type=float, default=None)
    add.add_argument("--burst", type=int, default=None)
    h = sub.add_parser("hash", help="print the sha256 of a key (from stdin when not given)")
    h.add_argument("key", nargs="?")
    ls = sub.add_parser("list", help="list the keys of a file (hash prefixes only)")
    ls.add_argument("--file", type=Path, required=True)
    rm = sub.add_parser("remove", help="remove the key whose hash starts with PREFIX")
    rm.add_argument("--file", type=Path, required=True)
    rm.add_argument("prefix")
    args = p.parse_args(argv)
    try:
        return _run(args)
    except ValueError as exc:
        _err(f"error: {exc}")
        return 1


def _run(args: argparse.Namespace) -> int:
    if args.cmd == "hash":
        key = args.key if args.key is not None else sys.stdin.readline().strip()
        if not key:
            raise ValueError("no key given")
        _out(hash_key(key))
        return 0
    path: Path = args.file
    keys = read_keys_file(path) if path.exists() else {}
    if args.cmd == "add":
        spec = ApiKeySpec.model_validate(
            {
                "tenant": args.tenant,
                "admin": args.admin,
                "rate_limit_rps": args.rate_limit_rps,
                "burst": args.burst,
            }
        )
        key = new_key()
        digest = hash_key(key)
        write_keys_file(path, {**keys, digest: spec})
        _err(f"stored sha256 {digest[:12]}... in {path}; the key is shown once:")
        _out(key)
        return 0
    if args.cmd == "list":
        for digest, spec in sorted(keys.items()):
            _out(f"{digest[:12]}  {json.dumps(spec.model_dump(exclude_defaults=True))}")
        return 0
    matches = [d for d in keys if d.startswith(args.prefix.lower())]
    if len(matches) != 1:
        raise ValueError(f"{len(matches)} keys match {args.prefix!r}; give a longer prefix")
    write_keys_file(path, {d: s for d, s in keys.items() if d != matches[0]})
    _err(f"removed {matches[0][:12]}...")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
