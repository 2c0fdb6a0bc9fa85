"""Dependencies the routes take: the gateway's runtime state and the calling principal (or admin)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

from fastapi import Depends, Request

from collm_gateway.auth import AdminDep, PrincipalDep

if TYPE_CHECKING:
    from collm_gateway.app import GatewayState


def gateway_state(request: Request) -> GatewayState:
    return request.app.state.gateway  # type: ignore[no-any-return]


StateDep = Annotated["GatewayState", Depends(gateway_state)]

__all__ = ["AdminDep", "PrincipalDep", "StateDep", "gateway_state"]
