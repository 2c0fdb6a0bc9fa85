"""`POST /v1/completions`."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from collm_gateway.api.deps import PrincipalDep, StateDep
from collm_gateway.api.responses import COMPLETION_RESPONSES
from collm_gateway.protocol import CompletionRequest

router = APIRouter()


@router.post("/v1/completions", response_model=None, responses=COMPLETION_RESPONSES)
async def completions(
    body: CompletionRequest, request: Request, state: StateDep, principal: PrincipalDep
) -> Response:
    return await state.serving.completion(body, request, principal)
