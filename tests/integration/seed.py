"""Test data for integration tests that run a real stack on the tiny model."""

from __future__ import annotations

from collm_common.store import AdapterStore


async def seed_v1(redis_url: str, prefix: str, adapter: str) -> None:
    """`<adapter>@v1` for the tiny model, as a replica creates it (PEFT's init: B = 0, the base behaviour)."""
    from collm_common.lora import encode_adapter
    from collm_replica.lora_bank import LiveLora, module_shapes
    from collm_replica.models import build_tiny_model
    from collm_replica.settings import ReplicaSettings

    model, _ = build_tiny_model(0)
    live = LiveLora.init_new(
        ReplicaSettings().lora_spec, int(model.config.num_hidden_layers), module_shapes(model), "tiny"
    )
    store = AdapterStore.from_url(redis_url, prefix)
    try:
        await store.publish(
            adapter,
            encode_adapter(live.to_weights({})),
            expected_current=None,
            base_model="tiny",
            source="create",
        )
    finally:
        await store.close()
