"""The aggregator's `import` endpoint: a PEFT directory published as the next version of an adapter.

`import_version` checks the directory (`collm_common.adapter_io`) and what it must match besides: it lies
within the import roots, and it agrees with the adapter already under that name (LoRA spec, base model,
tensor names and shapes) or, for a new adapter, with the layer shapes of another adapter on the same base
model (`reference_shapes`). Every refusal is a `ServiceFailure` with the reason and a client status: 400
the adapter name is not a subject token, 404 the path names nothing, 403 it lies outside the import roots
or the aggregator may not read it, 422 its content is not a LoRA adapter that replicas can serve on the
base model, 409 it conflicts with the adapter already under that name (another LoRA spec or base model;
an unreadable current version; a concurrent publication). `import_status` maps a refusal of
`collm_common.adapter_io` to its status.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from pathlib import Path

from safetensors import SafetensorError

from collm_aggregator.settings import AggregatorSettings
from collm_common import subjects
from collm_common.adapter_io import (
    AdapterAccessDenied,
    AdapterImportError,
    AdapterNotFound,
    check_base_dims,
    check_shapes,
    import_peft_dir,
    same_base_model,
    shown,
)
from collm_common.bus import ServiceFailure
from collm_common.lora import AdapterWeights, decode_adapter, encode_adapter
from collm_common.store import AdapterStore, Conflict, StoreError, VersionRecord, version_id
from collm_common.wire.admin import ImportAdapter

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


async def import_version(
    store: AdapterStore, settings: AggregatorSettings, req: ImportAdapter
) -> VersionRecord:
    """Publish the PEFT directory `req.path` as the next version of `req.adapter` (and set the adapter's
    domains when `req.domains` is given); refusals raise `ServiceFailure` (module docstring)."""
    try:
        subjects.check_token(req.adapter, "adapter name")
    except ValueError as exc:
        raise ServiceFailure(400, str(exc)) from None
    path = Path(req.path).expanduser()
    check_import_roots(path, settings.import_roots)
    current = await store.current(req.adapter)
    cur = await _current_weights(store, req.adapter, current)
    base_model = req.base_model
    if cur is not None:
        if base_model and cur.base_model and not same_base_model(base_model, cur.base_model):
            raise ServiceFailure(
                409,
                f"{req.adapter} is trained on {cur.base_model!r}, not {base_model!r}; "
                "import it under a new adapter name",
            )
        base_model = base_model or cur.base_model or None
    try:
        weights = await asyncio.to_thread(
            import_peft_dir,
            path,
            expected_base_model=base_model,
            supported_modules=tuple(settings.supported_target_modules),
            max_rank=settings.max_import_rank,
        )
    except AdapterImportError as exc:
        raise ServiceFailure(import_status(exc), f"cannot import {shown(path)}: {exc}") from None
    if cur is not None and weights.spec != cur.spec:
        raise ServiceFailure(
            409,
            f"LoRA spec {weights.spec.to_json()} differs from {req.adapter}'s {cur.spec.to_json()}; "
            "import it under a new adapter name",
        )
    if not weights.base_model:
        raise ServiceFailure(422, "the adapter names no base model; pass base_model")
    await _check_layer_shapes(store, req.adapter, path, weights, current, cur)
    try:
        rec = await store.publish(
            req.adapter,
            encode_adapter(weights),
            expected_current=current,
            base_model=weights.base_model,
            source="import",
            parent=current,
            meta={"imported_from": str(path)},
        )
    except Conflict as exc:
        raise ServiceFailure(409, f"{exc}; retry the import") from None
    if req.domains is not None:
        await store.set_meta(req.adapter, {"domains": ",".join(req.domains)})
    log.info("imported %s as %s", path, rec.id)
    return rec


def check_import_roots(path: Path, import_roots: Sequence[str]) -> None:
    """Refuse `path` unless it lies within one of `import_roots` (none: any path): 404 when it cannot be
    resolved, 403 when it lies outside."""
    roots = [Path(r).expanduser().resolve() for r in import_roots]
    if not roots:
        return
    try:
        resolved = path.resolve()
    except (OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop
        raise ServiceFailure(404, f"{shown(path)} does not exist ({exc})") from None
    if not any(resolved.is_relative_to(r) for r in roots):
        raise ServiceFailure(403, f"{shown(path)} is outside the import roots {[str(r) for r in roots]}")


async def _current_weights(store: AdapterStore, adapter: str, current: int | None) -> AdapterWeights | None:
    """The adapter's current version (None: the adapter has none); 409 when it cannot be read."""
    if current is None:
        return None
    try:
        return decode_adapter(await store.get_blob(adapter, current))
    except (StoreError, ValueError, KeyError, SafetensorError) as exc:
        raise ServiceFailure(409, f"current version of {adapter} is unreadable: {exc}") from None


async def _check_layer_shapes(
    store: AdapterStore,
    adapter: str,
    path: Path,
    weights: AdapterWeights,
    current: int | None,
    cur: AdapterWeights | None,
) -> None:
    """422 unless the imported tensors have the shapes a version must have: the current version's `cur`
    (same names and shapes), else the base model's layer shapes as another adapter on it shows them (any
    rank); nothing to compare with passes."""
    shapes = {k: tuple(v.shape) for k, v in weights.tensors.items()}
    if cur is not None and current is not None:
        reference = (version_id(adapter, current), {k: tuple(v.shape) for k, v in cur.tensors.items()})
        check = check_shapes
    else:
        reference = await reference_shapes(store, weights.base_model, adapter)
        check = check_base_dims
    if reference is None:
        return
    try:
        check(shapes, reference[1])
    except AdapterImportError as exc:
        raise ServiceFailure(
            422, f"cannot import {shown(path)}: {exc} (compared with {reference[0]})"
        ) from None
