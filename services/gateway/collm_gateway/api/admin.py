"""Adapter administration and training-sample upload (see adapter_admin.py and samples.py).

| route                               | key   | does                                                |
|-------------------------------------|-------|-----------------------------------------------------|
| `POST /v1/load_lora_adapter`        | admin | import a PEFT directory as a new adapter or version |
| `POST /v1/unload_lora_adapter`      | admin | unlist the adapter (its versions are kept)          |
| `GET /v1/adapters/{name}/versions`  | any   | versions, digests, quality (tenant-scoped)          |
| `POST /v1/adapters/{name}/rollback` | admin | republish an old version's content as a new one     |
| `POST /v1/samples`                  | admin | training samples to replicas' JetStream subjects    |
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path

from collm_gateway.adapter_admin import (
    NAME_PATTERN,
    LoadLoraAdapterRequest,
    RollbackRequest,
    UnloadLoraAdapterRequest,
)
from collm_gateway.api.deps import AdminDep, PrincipalDep, StateDep
from collm_gateway.api.responses import AUTHENTICATED, errors
from collm_gateway.samples import SamplesIn

router = APIRouter()

# Admin routes: authentication, rate limits, and the admin check (403).
ADMIN = (*AUTHENTICATED, 403)
AdapterName = Annotated[str, Path(pattern=NAME_PATTERN, description="Adapter name.")]


@router.post("/v1/load_lora_adapter", responses=errors(*ADMIN, 400, 404, 409, 413, 422, 502, 503, 504))
async def load_lora_adapter(
    body: LoadLoraAdapterRequest, state: StateDep, _admin: AdminDep
) -> dict[str, Any]:
    return await state.adapter_admin.load(body)


@router.post("/v1/unload_lora_adapter", responses=errors(*ADMIN, 400, 404, 413, 503))
async def unload_lora_adapter(
    body: UnloadLoraAdapterRequest, state: StateDep, _admin: AdminDep
) -> dict[str, Any]:
    return await state.adapter_admin.unload(body)


@router.get("/v1/adapters/{name}/versions", responses=errors(*AUTHENTICATED, 400, 404, 503))
async def adapter_versions(name: AdapterName, state: StateDep, principal: PrincipalDep) -> dict[str, Any]:
    return await state.adapter_admin.versions(name, principal)


@router.post("/v1/adapters/{name}/rollback", responses=errors(*ADMIN, 400, 404, 409, 413, 502, 503, 504))
async def rollback_adapter(
    name: AdapterName, body: RollbackRequest, state: StateDep, admin: AdminDep
) -> dict[str, Any]:
    return await state.adapter_admin.rollback(name, body, admin)


@router.post("/v1/samples", responses=errors(*ADMIN, 400, 413, 422, 503))
async def upload_samples(body: SamplesIn, state: StateDep, _admin: AdminDep) -> dict[str, Any]:
    planned = state.sample_intake.plan(body)
    acked = await state.sample_intake.publish(planned)
    return {"object": "list", "data": acked}
