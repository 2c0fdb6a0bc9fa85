"""Adapter publication events and new local training samples."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from collm_common.wire.base import WireModel


class AdapterPublished(WireModel):
    """Sent on `subjects.adapter_published(name)` after the store's pointer moved to `version`."""

    name: str
    version: int
    version_id: str
    sha256: str
    base_model: str
    source: Literal["round", "rollback", "import", "create"]
    round_id: int | None = None
    created_unix_s: float = 0.0


class TrainingSample(WireModel):
    """One instruction/response pair for a replica's local dataset (JetStream, never lost)."""

    sample_id: str = Field(min_length=1, max_length=128)
    replica_id: str
    adapter: str | None = None
    domain: str | None = None
    prompt: str = Field(min_length=1)
    response: str = Field(min_length=1)
    system: str | None = None
    received_unix_s: float = 0.0
