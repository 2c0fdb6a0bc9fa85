"""`GET /v1/models` and `GET /v1/models/{model}`: the base model, then every adapter as a model.

An adapter's card has `parent` = the base model and `root` = the exact current version
(`medical@v3`); clients send `"model": "medical"` for the current version or `"medical@v3"` to pin one.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path

from collm_common.store import StoreError
from collm_gateway.api.deps import PrincipalDep, StateDep
from collm_gateway.api.responses import AUTHENTICATED, errors
from collm_gateway.auth import can_use_adapter
from collm_gateway.errors import unavailable

router = APIRouter()

ModelId = Annotated[str, Path(min_length=1, max_length=256, description="A model id, as in requests.")]


@router.get("/v1/models", responses=errors(*AUTHENTICATED, 503))
async def list_models(state: StateDep, principal: PrincipalDep) -> dict[str, Any]:
    s = state.settings
    try:
        adapters = await state.catalog.adapters()
    except StoreError as exc:
        raise unavailable(f"cannot list adapters: {exc}", s.retry_after_s, "store_unavailable") from None
    data = [state.base_card()]
    for name in sorted(adapters):
        card = adapters[name]
        if card.current is None or not can_use_adapter(principal, card.owner):
            continue
        data.append(state.adapter_card(name, card.current, card.created_unix_s, card.owner))
    return {"object": "list", "data": data}


@router.get("/v1/models/{model}", responses=errors(*AUTHENTICATED, 400, 404, 503))
async def retrieve_model(model: ModelId, state: StateDep, principal: PrincipalDep) -> dict[str, Any]:
    ref = await state.catalog.resolve(model, principal, state.settings.retry_after_s)
    if ref.adapter is None:
        return state.base_card()
    cards = await state.catalog.adapters()
    card = cards[ref.adapter]
    version = ref.version if ref.version is not None else card.current
    assert version is not None  # resolve() refused adapters without a current version
    out = state.adapter_card(ref.adapter, version, card.created_unix_s, card.owner)
    out["id"] = model
    return out
