"""Validation of one participant's update against what its round expects (pure; numpy only).

An update is accepted into aggregation only if it is a LoRA adapter with exactly the base version's
keys, shapes and spec, trained on the same base model, finite everywhere, and with a change from the base
that stays within an absolute norm bound. Anything else is refused with a `Rejection` whose `code` is a
stable label (metrics, tests) and whose `reason` is a sentence for people. Checks that need the whole
cohort (norm outliers) live in the round machine, which sees every accepted update's norm.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from collm_aggregator.strategies import Tensors, delta_norm


@dataclass(frozen=True)
class Rejection:
    code: str
    reason: str


# Stable rejection codes (label values of collm_aggregator_rejected_updates_total).
UNDECODABLE = "undecodable"
MISSING_BLOB = "missing_blob"
DIGEST = "digest"
NOT_PARTICIPANT = "not_participant"
SENDER_MISMATCH = "sender_mismatch"
WRONG_ADAPTER = "wrong_adapter"
WRONG_BASE = "wrong_base_version"
DUPLICATE = "duplicate"
SPEC = "spec_mismatch"
BASE_MODEL = "base_model_mismatch"
KEYS = "keys_mismatch"
SHAPE = "shape_mismatch"
NOT_FINITE = "not_finite"
NORM = "norm_too_large"
NORM_OUTLIER = "norm_outlier"
NO_SAMPLES = "no_samples"
UNKNOWN_ROUND = "unknown_round"


@dataclass(frozen=True)
class Expected:
    """What every update of a round must match: the base version's tensors and descriptors."""

    tensors: Tensors
    spec_json: str
    base_model: str
    max_delta_norm: float | None = None

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: tuple(v.shape) for k, v in self.tensors.items()}


def check_tensors(
    tensors: Mapping[str, np.ndarray], spec_json: str, base_model: str, expected: Expected
) -> tuple[Rejection | None, float]:
    """(None, delta norm) when the update may be aggregated, else (Rejection, nan)."""
    if spec_json != expected.spec_json:
        return Rejection(
            SPEC, f"LoRA spec {spec_json} differs from the base version's {expected.spec_json}"
        ), math.nan
    if expected.base_model and base_model != expected.base_model:
        return Rejection(
            BASE_MODEL, f"trained on base model {base_model!r}, expected {expected.base_model!r}"
        ), math.nan
    want = expected.shapes
    got = set(tensors)
    if got != set(want):
        missing, extra = sorted(set(want) - got), sorted(got - set(want))
        return Rejection(
            KEYS, f"tensor names differ from the base version (missing {missing[:3]}, extra {extra[:3]})"
        ), math.nan
    for k, shape in want.items():
        if tuple(tensors[k].shape) != shape:
            return Rejection(SHAPE, f"{k} has shape {tuple(tensors[k].shape)}, expected {shape}"), math.nan
    for k, v in tensors.items():
        if not np.all(np.isfinite(v)):
            bad = int(np.size(v) - np.count_nonzero(np.isfinite(v)))
            return Rejection(NOT_FINITE, f"{k} holds {bad} non-finite values (NaN/Inf)"), math.nan
    n = delta_norm(tensors, expected.tensors)
    if not math.isfinite(n):
        return Rejection(NOT_FINITE, "the change from the base version overflows"), math.nan
    if expected.max_delta_norm is not None and n > expected.max_delta_norm:
        return Rejection(
            NORM, f"change from the base has L2 norm {n:.4g} > bound {expected.max_delta_norm:.4g}"
        ), n
    return None, n
