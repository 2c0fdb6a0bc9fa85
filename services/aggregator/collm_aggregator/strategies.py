"""Aggregation strategies for LoRA updates: pure functions over dicts of numpy arrays.

An update is the participant's full trained adapter (PEFT state-dict names, `lora_A` [r, in] and
`lora_B` [out, r] per module), weighted by its sample count (times a staleness factor). The served
effect of a module is `scaling * B @ A`, so the exact average of the updates is `sum_k p_k B_k A_k`.

* `fedavg`: average A and B separately (what Flower, OpenFedLLM and FATE do). Cheap, keeps each
  participant's factorisation, but `(sum p_k B_k)(sum p_k A_k) != sum p_k B_k A_k`: the cross terms are
  aggregation noise.
* `product_svd`: average the products and re-factorise to the same rank by truncated SVD (FlexLoRA,
  Bai et al., NeurIPS 2024). Exact whenever the average has rank <= r; otherwise the best rank-r
  approximation in Frobenius norm (Eckart-Young). The SVD is taken through the stacked factors
  (`[p_1 B_1 | ... | p_K B_K] @ [A_1; ...; A_K]`) and two thin QRs, so its cost is O((in + out) (K r)^2)
  per module, never O(in * out * min(in, out)).
* `NormClipping`: a wrapper (as Flower's clipping strategies wrap an inner strategy) that scales each
  update's difference from the base version down to a maximum L2 norm before the inner strategy runs.
* Server learning rate `eta` (FedOpt's global step, Reddi et al., ICLR 2021): the candidate is
  `base + eta * (average - base)`; 1 is plain averaging. `"participants"` sets eta to the number of
  updates, so the candidate adds up the participants' (sample-weighted) changes instead of averaging
  them: with one participant per domain each domain keeps the full step its own participant took, where
  the average gives it 1/K of it. For `product_svd` the base's product enters the stacked factors with
  weight `1 - eta` (exact whenever the result has rank <= r, as before).

Nothing here does I/O, imports torch or knows about rounds; `python -m collm_bench federated strategies`
and the unit tests run these functions directly.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np

Tensors = Mapping[str, np.ndarray]
ServerLR = float | Literal["participants"]

A_SUFFIX = ".lora_A.weight"
B_SUFFIX = ".lora_B.weight"

# Singular values below this fraction of the largest are treated as zero (null directions).
_RELATIVE_RANK_TOL = 1e-7


@dataclass(frozen=True)
class WeightedUpdate:
    """One participant's trained adapter and its aggregation weight (samples x staleness factor)."""

    replica_id: str
    tensors: Tensors
    weight: float


class Strategy(Protocol):
    """Aggregates validated updates of one round into the candidate adapter (same keys and shapes)."""

    @property
    def name(self) -> str: ...

    @property
    def server_lr(self) -> ServerLR: ...

    @property
    def products(self) -> bool:
        """Whether it averages the modules' products B·A (else each tensor on its own)."""
        ...

    def aggregate(self, updates: Sequence[WeightedUpdate], base: Tensors | None) -> dict[str, np.ndarray]: ...


# --- helpers ------------------------------------------------------------------------------------------
def lora_modules(keys: Sequence[str] | Tensors) -> dict[str, tuple[str, str]]:
    """Module prefix -> (A key, B key). Raises ValueError for a key that is not part of an A/B pair."""
    names = set(keys)
    modules: dict[str, tuple[str, str]] = {}
    for k in sorted(names):
        if k.endswith(A_SUFFIX):
            prefix = k[: -len(A_SUFFIX)]
            b = prefix + B_SUFFIX
            if b not in names:
                raise ValueError(f"{k} has no matching {b}")
            modules[prefix] = (k, b)
        elif k.endswith(B_SUFFIX):
            if k[: -len(B_SUFFIX)] + A_SUFFIX not in names:
                raise ValueError(f"{k} has no matching lora_A")
        else:
            raise ValueError(f"{k} is not a LoRA A/B weight")
    return modules


def normalized_weights(updates: Sequence[WeightedUpdate]) -> np.ndarray:
    """Weights summing to 1; raises ValueError when there is nothing to weight."""
    if not updates:
        raise ValueError("no updates to aggregate")
    w = np.array([u.weight for u in updates], dtype=np.float64)
    if not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
        raise ValueError(f"aggregation weights must be finite, >= 0 and not all zero (got {w.tolist()})")
    return w / w.sum()


def _same_keys(updates: Sequence[WeightedUpdate]) -> list[str]:
    keys = sorted(updates[0].tensors)
    for u in updates[1:]:
        if sorted(u.tensors) != keys:
            raise ValueError(f"update of {u.replica_id} has different keys than {updates[0].replica_id}")
        for k in keys:
            if u.tensors[k].shape != updates[0].tensors[k].shape:
                raise ValueError(f"update of {u.replica_id}: {k} has shape {u.tensors[k].shape}")
    return keys


# --- FedAvg ---------------------------------------------------------------------------------------------
def server_eta(server_lr: ServerLR, updates: Sequence[WeightedUpdate]) -> float:
    """The server learning rate of a round: a number, or the count of updates for `"participants"`."""
    eta = float(len(updates)) if server_lr == "participants" else float(server_lr)
    if not math.isfinite(eta) or eta <= 0:
        raise ValueError(f"server learning rate must be finite and > 0 (got {server_lr!r})")
    return eta


def _base_term(eta: float, base: Tensors | None) -> Tensors | None:
    """The base version's tensors when the server step needs them (eta != 1)."""
    if eta == 1.0:
        return None
    if base is None:
        raise ValueError("a server learning rate other than 1 needs the base version's tensors")
    return base


def fedavg(
    updates: Sequence[WeightedUpdate], base: Tensors | None = None, server_lr: ServerLR = 1.0
) -> dict[str, np.ndarray]:
    """Weighted mean of every tensor independently (A and B averaged separately), then the server step."""
    eta = server_eta(server_lr, updates)
    p = normalized_weights(updates) * eta
    b0 = _base_term(eta, base)
    out: dict[str, np.ndarray] = {}
    for k in _same_keys(updates):
        dtype = updates[0].tensors[k].dtype
        acc = np.zeros(updates[0].tensors[k].shape, dtype=np.float64)
        for pk, u in zip(p, updates, strict=True):
            acc += pk * u.tensors[k].astype(np.float64)
        if b0 is not None:
            acc += (1.0 - eta) * _base_tensor(b0, k, acc.shape)
        out[k] = acc.astype(dtype)
    return out


def _base_tensor(base: Tensors, key: str, shape: tuple[int, ...]) -> np.ndarray:
    if key not in base or base[key].shape != shape:
        raise ValueError(f"base version has no tensor {key} of shape {shape}")
    return base[key].astype(np.float64)


# --- product averaging with SVD re-factorisation ------------------------------------------------------
def average_products(updates: Sequence[WeightedUpdate]) -> dict[str, np.ndarray]:
    """The exact target, `sum_k p_k B_k A_k` per module (dense [out, in]; reference and tests only)."""
    p = normalized_weights(updates)
    modules = lora_modules(updates[0].tensors)
    out = {}
    for prefix, (ka, kb) in modules.items():
        out[prefix] = sum(
            pk * (u.tensors[kb].astype(np.float64) @ u.tensors[ka].astype(np.float64))
            for pk, u in zip(p, updates, strict=True)
        )
    return out


def _complement_rows(v_kept: np.ndarray, seed_rows: np.ndarray, count: int, seed: int) -> np.ndarray:
    """`count` orthonormal rows orthogonal to the rows of `v_kept` (deterministic).

    Candidates are `seed_rows` (the averaged A: directions the participants already use) followed by a
    seeded Gaussian block; projecting out `v_kept` and taking the leading left singular vectors keeps
    only directions in the orthogonal complement.
    """
    n_in = seed_rows.shape[1]
    rng = np.random.default_rng(seed)
    cand = np.vstack([seed_rows, rng.standard_normal((max(count, 1), n_in))]).T  # [in, m]
    if v_kept.size:
        cand = cand - v_kept.T @ (v_kept @ cand)
    u, s, _ = np.linalg.svd(cand, full_matrices=False)
    return u[:, :count].T


def refactorise(
    b_stack: np.ndarray, a_stack: np.ndarray, rank: int, row_scale: float, seed_rows: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rank-`rank` factors (B [out, rank], A [rank, in]) of `b_stack @ a_stack`, and its singular values.

    A's rows are `row_scale` times orthonormal right singular vectors and B carries the singular values,
    so A keeps the scale the participants trained with (a `sqrt(S)` split would shrink A towards zero
    after small first rounds and slow the next round's training of B). Directions beyond the product's
    numerical rank get B columns of zero (the product stays exact) and A rows from the orthogonal
    complement, so LoRA's gradient through them is not dead in the next round.
    """
    qb, rb = np.linalg.qr(b_stack)  # [out, m], [m, m]
    qa, ra = np.linalg.qr(a_stack.T)  # [in, m'], [m', m']
    uc, s, vct = np.linalg.svd(rb @ ra.T, full_matrices=False)
    u = qb @ uc  # [out, k]
    v = qa @ vct.T  # [in, k]
    keep = min(rank, s.size)
    tol = _RELATIVE_RANK_TOL * (s[0] if s.size else 0.0)
    nonzero = int(np.sum(s[:keep] > tol)) if s.size and s[0] > 0 else 0
    out_dim, in_dim = b_stack.shape[0], a_stack.shape[1]
    b_new = np.zeros((out_dim, rank))
    a_new = np.zeros((rank, in_dim))
    b_new[:, :nonzero] = u[:, :nonzero] * (s[:nonzero] / row_scale)
    a_new[:nonzero] = row_scale * v[:, :nonzero].T
    if nonzero < rank:
        a_new[nonzero:] = row_scale * _complement_rows(
            a_new[:nonzero] / row_scale, seed_rows, rank - nonzero, 0
        )
    return b_new, a_new, s


def product_svd(
    updates: Sequence[WeightedUpdate],
    rank: int | None = None,
    base: Tensors | None = None,
    server_lr: ServerLR = 1.0,
) -> dict[str, np.ndarray]:
    """Average the products B_k A_k, take the server step from the base's product, and re-factorise each
    module to `rank` (default: the input rank)."""
    eta = server_eta(server_lr, updates)
    p = normalized_weights(updates)
    b0 = _base_term(eta, base)
    _same_keys(updates)
    modules = lora_modules(updates[0].tensors)
    out: dict[str, np.ndarray] = {}
    for ka, kb in modules.values():
        a_list = [u.tensors[ka].astype(np.float64) for u in updates]
        b_list = [u.tensors[kb].astype(np.float64) for u in updates]
        r = rank or a_list[0].shape[0]
        b_parts = [eta * pk * b for pk, b in zip(p, b_list, strict=True)]
        a_parts = list(a_list)
        if b0 is not None:
            b_parts.append((1.0 - eta) * _base_tensor(b0, kb, b_list[0].shape))
            a_parts.append(_base_tensor(b0, ka, a_list[0].shape))
        b_stack = np.hstack(b_parts)
        a_stack = np.vstack(a_parts)
        # Typical A row norm of the participants, weighted like the updates.
        row_scale = float(sum(pk * np.linalg.norm(a, axis=1).mean() for pk, a in zip(p, a_list, strict=True)))
        if not math.isfinite(row_scale) or row_scale <= 0:
            row_scale = 1.0
        seed_rows = sum(pk * a for pk, a in zip(p, a_list, strict=True))
        b_new, a_new, _ = refactorise(b_stack, a_stack, r, row_scale, seed_rows)
        out[ka] = a_new.astype(updates[0].tensors[ka].dtype)
        out[kb] = b_new.astype(updates[0].tensors[kb].dtype)
    return out


# --- rebasing an aggregate onto a newer version (async rounds) ----------------------------------------
def rebase_aggregate(
    candidate: Tensors, old: Tensors, new: Tensors, scale: float, products: bool
) -> dict[str, np.ndarray]:
    """The candidate's change from `old`, times `scale`, applied to `new`. With `products` (the strategy
    averages B·A) the change is taken per module in product space and the result re-factorised to the
    rank (new B·A + scale x (candidate B·A - old B·A), exact as a stack of three factor pairs before the
    truncation); else tensor by tensor (new + scale x (candidate - old))."""
    if not products:
        return {k: (new[k] + scale * (candidate[k] - old[k])).astype(candidate[k].dtype) for k in candidate}
    out: dict[str, np.ndarray] = {}
    for ka, kb in lora_modules(candidate).values():
        c_a, c_b = candidate[ka].astype(np.float64), candidate[kb].astype(np.float64)
        b_stack = np.hstack([new[kb].astype(np.float64), scale * c_b, -scale * old[kb].astype(np.float64)])
        a_stack = np.vstack([new[ka].astype(np.float64), c_a, old[ka].astype(np.float64)])
        row_scale = float(np.linalg.norm(c_a, axis=1).mean())
        if not math.isfinite(row_scale) or row_scale <= 0:
            row_scale = 1.0
        b_new, a_new, _ = refactorise(b_stack, a_stack, c_a.shape[0], row_scale, c_a)
        out[ka] = a_new.astype(candidate[ka].dtype)
        out[kb] = b_new.astype(candidate[kb].dtype)
    return out


# --- how far an aggregate is from the exact average ------------------------------------------------------
def product_error(
    aggregate: Tensors,
    updates: Sequence[WeightedUpdate],
    base: Tensors | None = None,
    server_lr: ServerLR = 1.0,
) -> dict[str, float]:
    """Frobenius distance between the aggregate's products and the exact target: the average of the
    updates' products (with a server learning rate eta != 1: base + eta x (average - base)).

    Returns `abs` (sum over modules, as one norm), `rel_avg` (relative to the exact target's norm) and,
    when `base` is given, `rel_delta` (relative to the norm of the target's *change* from the base, which
    is what a round is meant to apply). Computed from Gram matrices of the stacked factors, so it never
    forms an [out, in] matrix.
    """
    eta = server_eta(server_lr, updates)
    p = normalized_weights(updates) * eta
    b0 = _base_term(eta, base)
    modules = lora_modules(aggregate)
    err_sq = avg_sq = delta_sq = 0.0
    for ka, kb in modules.values():
        bs = [pk * u.tensors[kb].astype(np.float64) for pk, u in zip(p, updates, strict=True)]
        as_ = [u.tensors[ka].astype(np.float64) for u in updates]
        if b0 is not None:
            bs.append((1.0 - eta) * b0[kb].astype(np.float64))
            as_.append(b0[ka].astype(np.float64))
        avg_b, avg_a = np.hstack(bs), np.vstack(as_)
        agg_b, agg_a = aggregate[kb].astype(np.float64), aggregate[ka].astype(np.float64)
        err_sq += _frob_sq_of_product(np.hstack([avg_b, -agg_b]), np.vstack([avg_a, agg_a]))
        avg_sq += _frob_sq_of_product(avg_b, avg_a)
        if base is not None:
            base_b, base_a = base[kb].astype(np.float64), base[ka].astype(np.float64)
            delta_sq += _frob_sq_of_product(np.hstack([avg_b, -base_b]), np.vstack([avg_a, base_a]))
    result = {"abs": math.sqrt(max(err_sq, 0.0))}
    result["rel_avg"] = result["abs"] / math.sqrt(avg_sq) if avg_sq > 0 else 0.0
    if base is not None:
        result["rel_delta"] = result["abs"] / math.sqrt(delta_sq) if delta_sq > 0 else 0.0
    return result


def _frob_sq_of_product(x: np.ndarray, y: np.ndarray) -> float:
    """||x @ y||_F^2 = sum((x^T x) * (y y^T)), for thin x [out, m] and y [m, in]."""
    return float(np.sum((x.T @ x) * (y @ y.T)))


# --- clipping ---------------------------------------------------------------------------------------------
def delta_norm(tensors: Tensors, base: Tensors) -> float:
    """L2 norm of the parameter-space difference from the base version, over all tensors."""
    return math.sqrt(
        sum(float(np.sum((tensors[k].astype(np.float64) - base[k].astype(np.float64)) ** 2)) for k in base)
    )


def clip_update(update: WeightedUpdate, base: Tensors, max_norm: float) -> WeightedUpdate:
    """The update with its difference from `base` scaled down to at most `max_norm` (L2)."""
    n = delta_norm(update.tensors, base)
    if n <= max_norm or n == 0:
        return update
    f = max_norm / n
    clipped = {
        k: (base[k].astype(np.float64) + f * (v.astype(np.float64) - base[k].astype(np.float64))).astype(
            v.dtype
        )
        for k, v in update.tensors.items()
    }
    return WeightedUpdate(update.replica_id, clipped, update.weight)


# --- strategies as thin classes ----------------------------------------------------------------------------
def _named(name: str, server_lr: ServerLR) -> str:
    return name if server_lr == 1.0 else f"{name}(server_lr={server_lr})"


class FedAvg:
    """Sample-weighted average of A and B separately (McMahan et al. 2017; Flower, OpenFedLLM)."""

    products = False

    def __init__(self, server_lr: ServerLR = 1.0) -> None:
        self.server_lr = server_lr
        self.name = _named("fedavg", server_lr)

    def aggregate(self, updates: Sequence[WeightedUpdate], base: Tensors | None) -> dict[str, np.ndarray]:
        return fedavg(updates, base, self.server_lr)


class ProductSVD:
    """Average of B·A re-factorised to the same rank by truncated SVD (FlexLoRA, arXiv:2402.11505)."""

    products = True

    def __init__(self, server_lr: ServerLR = 1.0) -> None:
        self.server_lr = server_lr
        self.name = _named("product_svd", server_lr)

    def aggregate(self, updates: Sequence[WeightedUpdate], base: Tensors | None) -> dict[str, np.ndarray]:
        return product_svd(updates, base=base, server_lr=self.server_lr)


class NormClipping:
    """Clip each update's change from the base to `max_norm` before the inner strategy aggregates."""

    def __init__(self, inner: Strategy, max_norm: float) -> None:
        if max_norm <= 0:
            raise ValueError("max_norm must be > 0")
        self.inner = inner
        self.max_norm = max_norm

    @property
    def name(self) -> str:
        return f"clip({self.inner.name},{self.max_norm:g})"

    @property
    def server_lr(self) -> ServerLR:
        return self.inner.server_lr

    @property
    def products(self) -> bool:
        return self.inner.products

    def aggregate(self, updates: Sequence[WeightedUpdate], base: Tensors | None) -> dict[str, np.ndarray]:
        if base is None:
            raise ValueError("norm clipping needs the base version's tensors")
        return self.inner.aggregate([clip_update(u, base, self.max_norm) for u in updates], base)


STRATEGIES: dict[str, type[FedAvg] | type[ProductSVD]] = {"fedavg": FedAvg, "product_svd": ProductSVD}


def make_strategy(name: str, clip_norm: float | None = None, server_lr: ServerLR = 1.0) -> Strategy:
    """The named strategy with its server learning rate, wrapped in `NormClipping` when `clip_norm` is set."""
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r} (choose from {sorted(STRATEGIES)})")
    strategy: Strategy = STRATEGIES[name](server_lr)
    return NormClipping(strategy, clip_norm) if clip_norm else strategy
