"""What the aggregator's `import` endpoint checks besides the PEFT directory itself, and how it answers.

Every refusal is an error reply with the reason and a client status: 404 the path names nothing, 403 it
lies outside the import roots or the aggregator may not read it, 422 its content is not a LoRA adapter
that replicas can serve on the base model, 409 it conflicts with the adapter already under that name
(another LoRA spec or base model; a concurrent publication). `import_status` maps a refusal of
`collm_common.adapter_io` to its status; `reference_shapes` finds what the base model's layers look like.
"""

from __future__ import annotations

import logging

from safetensors import SafetensorError

from collm_common.adapter_io import AdapterAccessDenied, AdapterImportError, AdapterNotFound, same_base_model
from collm_common.lora import decode_adapter
from collm_common.store import AdapterStore, StoreError

log = logging.getLogger(__name__)


def import_status(exc: AdapterImportError) -> int:
    """The reply code of a refused directory: 404 nothing there, 403 not readable, 422 not servable."""
    if isinstance(exc, AdapterNotFound):
        return 404
    if isinstance(exc, AdapterAccessDenied):
        return 403
    return 422


async def reference_shapes(
    store: AdapterStore, base_model: str, exclude: str
) -> tuple[str, dict[str, tuple[int, ...]]] | None:
    """(version id, tensor shapes) of the current version of another adapter on `base_model`, the
    aggregator's only knowledge of that model's layer shapes; None when no readable one exists."""
    for name in await store.list_adapters():
        if name == exclude:
            continue
        try:
            current = await store.current(name)
            if current is None:
                continue
            rec = await store.get_version(name, current)
            if not rec.base_model or not same_base_model(rec.base_model, base_model):
                continue
            weights = decode_adapter(await store.get_blob(name, current))
        except (
            StoreError,
            ValueError,
            KeyError,
            SafetensorError,
        ) as exc:  # pruned, corrupt or unreadable: try another
            log.warning("import: %s is no reference for %s's shapes: %s", name, base_model, exc)
            continue
        return rec.id, {k: tuple(v.shape) for k, v in weights.tensors.items()}
    return None
