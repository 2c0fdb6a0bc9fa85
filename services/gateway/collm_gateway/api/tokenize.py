"""vLLM's `POST /tokenize` and `POST /detokenize`, answered by a replica's tokenizer (tokenization.py).

Both take API keys and rate limits as the `/v1/` routes do (auth.py) and the same body limit.
"""

from __future__ import annotations

from fastapi import APIRouter

from collm_gateway.api.deps import PrincipalDep, StateDep
from collm_gateway.api.responses import AUTHENTICATED, errors
from collm_gateway.tokenization import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)

router = APIRouter()

# 400 bad input (ids outside the vocabulary: `tokens`), 404 unknown model, 413 too large for a replica
# message, 502 a replica failed, 503 no replica (or the adapter store) available, 504 no answer in time.
TOKENIZE_ERRORS = errors(*AUTHENTICATED, 400, 404, 413, 502, 503, 504)


@router.post("/tokenize", responses=TOKENIZE_ERRORS)
async def tokenize(body: TokenizeRequest, state: StateDep, principal: PrincipalDep) -> TokenizeResponse:
    """Token ids of `prompt`, or of `messages` as the chat template renders them for generation."""
    return await state.tokenization.tokenize(body, principal)


@router.post("/detokenize", responses=TOKENIZE_ERRORS)
async def detokenize(body: DetokenizeRequest, state: StateDep, principal: PrincipalDep) -> DetokenizeResponse:
    """The text of `tokens`."""
    return await state.tokenization.detokenize(body, principal)
