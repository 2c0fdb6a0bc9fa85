"""Who is calling: the one place where API keys become a `Principal`.

Two modes, chosen by the settings (logged at start):

* **Open** (no `COLLM_API_KEYS` and no `COLLM_API_KEYS_FILE`): any key, or none, is accepted, as the
  OpenAI client always sends one; every adapter is usable; no rate limit.
* **Keys** (either is set): `Authorization: Bearer <key>` is looked up by its sha256; a missing or
  unknown key is 401, a key past its rate limit is 429 with `Retry-After`. The key's tenant decides
  which adapters it lists and uses (`can_use_adapter`): its own, shared ones (no owner) and the base
  model; another tenant's adapter is 404 exactly like an unknown one.

Admin endpoints need an admin key in both modes: a key with `admin: true`, or `COLLM_ADMIN_KEY`. Without
a key they answer 401; with a key that is not an admin key, 403; and when no admin key is configured
at all, 403 saying so. They are never open by default.

`AuthMiddleware` authenticates every `/v1/` request (and vLLM's `/tokenize` and `/detokenize`) before
its body is read (so an unauthenticated client learns nothing about the body), and leaves the principal
in the request's state for routes, which take it through `PrincipalDep` / `AdminDep`. The tenant
travels to the replica in `GenerateRequest.tenant`.
"""

from __future__ import annotations

import hmac
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from fastapi import Depends, Request
from starlette.types import ASGIApp, Receive, Scope, Send

from collm_common.clock import Clock
from collm_gateway.errors import APIError
from collm_gateway.keys import ApiKeySpec, hash_key, read_keys_file
from collm_gateway.limits import send_api_error
from collm_gateway.ratelimit import RateLimiter, default_burst, retry_after_s
from collm_gateway.settings import GatewaySettings

log = logging.getLogger(__name__)

PROTECTED_PREFIX = "/v1/"
# vLLM's routes outside /v1/ that take keys as the /v1/ routes do.
PROTECTED_PATHS = frozenset({"/tokenize", "/detokenize"})


def is_protected(path: str) -> bool:
    """Whether `path` needs an API key (when keys are required) and counts against rate limits."""
    return path.startswith(PROTECTED_PREFIX) or path in PROTECTED_PATHS


@dataclass(frozen=True)
class Principal:
    tenant: str | None = None
    # sha256 prefix of the presented key, for logs (never the key itself); None without a key.
    key_id: str | None = None
    is_admin: bool = False
    # Open mode (no keys configured): every adapter is usable, as before tenants existed.
    open_access: bool = False


ANONYMOUS = Principal(open_access=True)


def key_id(api_key: str) -> str:
    return hash_key(api_key)[:12]


def bearer_token(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def can_use_adapter(principal: Principal, owner_tenant: str | None) -> bool:
    """Whether `principal` may list and use an adapter owned by `owner_tenant` (None: shared)."""
    if principal.is_admin or principal.open_access or owner_tenant is None:
        return True
    return principal.tenant is not None and principal.tenant == owner_tenant


# --- errors ------------------------------------------------------------------------------------------------
def unauthenticated(message: str) -> APIError:
    return APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def forbidden(message: str) -> APIError:
    return APIError(403, message, code="admin_key_required")


def rate_limited(rate_per_s: float, burst: int, wait_s: float) -> APIError:
    after_s = retry_after_s(wait_s)
    return APIError(
        429,
        f"rate limit of {rate_per_s:g} requests/s (burst {burst}) exceeded for this API key; "
        f"retry after {after_s} s",
        code="rate_limit_exceeded",
        headers={"Retry-After": str(after_s)},
    )


# --- the keys file ---------------------------------------------------------------------------------------
class KeysFile:
    """The keys file, re-read when its mtime or size changes (checked at most every `reload_s`).

    A file that turns unreadable or invalid keeps the last good keys (and logs why); a file that is
    missing or invalid at start is an error, so a typo cannot start an open gateway.
    """

    def __init__(self, path: Path, reload_s: float, clock: Clock) -> None:
        self.path = path
        self.reload_s = reload_s
        self.clock = clock
        if not path.is_file():
            raise ValueError(
                f"COLLM_API_KEYS_FILE={path} does not exist (create it: python -m collm_gateway.keys add "
                f"--file {path} --tenant NAME)"
            )
        self._stamp = self._stat()
        self.keys = read_keys_file(path)
        self._checked_s = clock.monotonic()

    def _stat(self) -> tuple[int, int] | None:
        try:
            st = self.path.stat()
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size

    def current(self) -> dict[str, ApiKeySpec]:
        now = self.clock.monotonic()
        if now - self._checked_s < self.reload_s:
            return self.keys
        self._checked_s = now
        stamp = self._stat()
        if stamp == self._stamp:
            return self.keys
        self._stamp = stamp
        try:
            self.keys = read_keys_file(self.path)
            log.info("API keys reloaded from %s: %d keys", self.path, len(self.keys))
        except (OSError, ValueError) as exc:
            log.error(
                "API keys file %s unusable, keeping the last %d keys: %s", self.path, len(self.keys), exc
            )
        return self.keys


# --- the authenticator --------------------------------------------------------------------------------------
class Authenticator:
    """Keys -> principals, rate limits, and the admin check (pure but for the keys file's reads)."""

    def __init__(self, settings: GatewaySettings, clock: Clock) -> None:
        self.settings = settings
        self.clock = clock
        self.keys_required = settings.keys_configured
        self._static = dict(settings.api_keys)
        self._file = (
            KeysFile(settings.api_keys_file, settings.api_keys_reload_s, clock)
            if settings.api_keys_file is not None
            else None
        )
        secret = settings.admin_key.get_secret_value() if settings.admin_key is not None else None
        self._admin_sha = hash_key(secret) if secret else None
        self.limiter = RateLimiter()

    def keys(self) -> dict[str, ApiKeySpec]:
        if self._file is None:
            return self._static
        return {**self._file.current(), **self._static}

    @property
    def admin_configured(self) -> bool:
        return self._admin_sha is not None or any(s.admin for s in self.keys().values())

    def describe(self) -> str:
        keys = self.keys()
        admin = "on" if self.admin_configured else "off (no admin key configured)"
        if not self.keys_required:
            return f"API keys: open (no keys configured: any key is accepted); admin endpoints {admin}"
        n_admin = sum(1 for s in keys.values() if s.admin)
        return f"API keys: required ({len(keys)} keys, {n_admin} admin); admin endpoints {admin}"

    def _spec_of(self, digest: str) -> ApiKeySpec | None:
        if self._admin_sha is not None and hmac.compare_digest(digest, self._admin_sha):
            return ApiKeySpec(admin=True)
        return self.keys().get(digest)

    def authenticate(self, token: str | None) -> Principal:
        """The caller's principal; raises APIError 401 (missing/unknown key) or 429 (rate limit)."""
        if not self.keys_required:
            if token is None:
                return ANONYMOUS
            digest = hash_key(token)
            admin = self._admin_sha is not None and hmac.compare_digest(digest, self._admin_sha)
            return Principal(key_id=digest[:12], is_admin=admin, open_access=True)
        if token is None:
            raise unauthenticated(
                "missing API key: send it as 'Authorization: Bearer <key>' (keys are required here)"
            )
        digest = hash_key(token)
        spec = self._spec_of(digest)
        if spec is None:
            raise unauthenticated("invalid API key")
        rps = spec.rate_limit_rps or self.settings.rate_limit_rps
        if rps is not None:
            burst = spec.burst or self.settings.rate_limit_burst or default_burst(rps)
            wait_s = self.limiter.take(digest, rps, burst, self.clock.monotonic())
            if wait_s > 0:
                raise rate_limited(rps, burst, wait_s)
        return Principal(tenant=spec.tenant, key_id=digest[:12], is_admin=spec.admin)

    def require_admin(self, principal: Principal) -> Principal:
        """`principal` if it holds an admin key; else APIError 401/403 (see the module docstring)."""
        if principal.is_admin:
            return principal
        if not self.admin_configured:
            raise forbidden(
                "admin endpoints are disabled: no admin key is configured (set COLLM_ADMIN_KEY, or add a "
                "key with admin: true to COLLM_API_KEYS / COLLM_API_KEYS_FILE)"
            )
        if principal.key_id is None:
            raise unauthenticated("this endpoint needs an admin API key: send 'Authorization: Bearer <key>'")
        raise forbidden("this endpoint needs an admin API key; the key sent is not one")


class AuthMiddleware:
    """Authenticates protected requests (`is_protected`) before anything reads their body; refusals leave
    as the envelope."""

    def __init__(self, app: ASGIApp, authenticator: Authenticator) -> None:
        self.app = app
        self.authenticator = authenticator

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_protected(str(scope.get("path", ""))):
            await self.app(scope, receive, send)
            return
        authorization = None
        for key, value in scope.get("headers", ()):
            if key == b"authorization":
                authorization = value.decode("latin-1")
                break
        try:
            principal = self.authenticator.authenticate(bearer_token(authorization))
        except APIError as err:
            await send_api_error(send, err)
            return
        scope.setdefault("state", {})["principal"] = principal
        await self.app(scope, receive, send)


# --- dependencies -------------------------------------------------------------------------------------------
def _authenticator(request: Request) -> Authenticator:
    return request.app.state.gateway.auth  # type: ignore[no-any-return]


async def authenticate(request: Request) -> Principal:
    """The principal `AuthMiddleware` found (or found now, for a route outside `/v1/`)."""
    principal = request.scope.get("state", {}).get("principal")
    if isinstance(principal, Principal):
        return principal
    return _authenticator(request).authenticate(bearer_token(request.headers.get("authorization")))


async def require_admin(
    request: Request, principal: Annotated[Principal, Depends(authenticate)]
) -> Principal:
    return _authenticator(request).require_admin(principal)


PrincipalDep = Annotated[Principal, Depends(authenticate)]
AdminDep = Annotated[Principal, Depends(require_admin)]
