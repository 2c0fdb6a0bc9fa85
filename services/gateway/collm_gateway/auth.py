"""Who is calling: the one place where API keys become a `Principal`.

Today every key is accepted (OpenAI clients always send one) and maps to the anonymous principal, which
may use the base model and every adapter. Tenants and admin keys (keys stored hashed, mapped to a
tenant; per-key rate limits) replace `authenticate` and `can_use_adapter` without touching any route:
routes receive a `Principal` through the `PrincipalDep` dependency, the catalog asks `can_use_adapter`,
and the tenant travels to the replica in `GenerateRequest.tenant`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request


@dataclass(frozen=True)
class Principal:
    tenant: str | None = None
    # sha256 prefix of the presented key, for logs (never the key itself); None without a key.
    key_id: str | None = None
    is_admin: bool = False


ANONYMOUS = Principal()


def key_id(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()[:12]


def bearer_token(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


async def authenticate(request: Request) -> Principal:
    """Map the request's API key (`Authorization: Bearer ...`) to a principal. Accepts any key today."""
    token = bearer_token(request.headers.get("authorization"))
    return Principal(tenant=None, key_id=key_id(token) if token else None, is_admin=False)


def can_use_adapter(principal: Principal, owner_tenant: str | None) -> bool:
    """Whether `principal` may list and use an adapter owned by `owner_tenant` (None: shared)."""
    del principal, owner_tenant  # no tenants yet: everything is shared
    return True


PrincipalDep = Annotated[Principal, Depends(authenticate)]
