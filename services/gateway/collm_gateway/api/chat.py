"""`POST /v1/chat/completions`."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from collm_gateway.api.deps import PrincipalDep, StateDep
from collm_gateway.api.responses import COMPLETION_RESPONSES
from collm_gateway.protocol import ChatCompletionRequest

router = APIRouter()


@router.post("/v1/chat/completions", response_model=None, responses=COMPLETION_RESPONSES)
async def chat_completions(
    body: ChatCompletionRequest, request: Request, state: StateDep, principal: PrincipalDep
) -> Response:
    return await state.serving.chat(body, request, principal)
