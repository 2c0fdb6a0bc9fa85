"""Aggregation math against a plain numpy reference."""

import numpy as np
import pytest

from collm_aggregator.strategies import (
    FedAvg,
    NormClipping,
    ProductSVD,
    WeightedUpdate,
    average_products,
    clip_update,
    delta_norm,
    fedavg,
    lora_modules,
    make_strategy,
    product_error,
    product_svd,
    rebase_aggregate,
)

pytestmark = pytest.mark.unit

MODS = {
    "base_model.model.model.layers.0.self_attn.q_proj": (24, 16),
    "base_model.model.model.layers.0.self_attn.v_proj": (8, 16),
}


def adapter(rng: np.random.Generator, r: int = 4, scale_b: float = 1.0) -> dict[str, np.ndarray]:
    out = {}
    for prefix, (n_out, n_in) in MODS.items():
        out[f"{prefix}.lora_A.weight"] = rng.standard_normal((r, n_in)).astype(np.float32)
        out[f"{prefix}.lora_B.weight"] = (scale_b * rng.standard_normal((n_out, r))).astype(np.float32)
    return out


def updates(n: int = 3, seed: int = 0, r: int = 4) -> list[WeightedUpdate]:
    rng = np.random.default_rng(seed)
    return [WeightedUpdate(f"r{i}", adapter(rng, r), float(10 * (i + 1))) for i in range(n)]


def test_fedavg_matches_numpy_average_per_tensor() -> None:
    ups = updates()
    got = fedavg(ups)
    w = np.array([u.weight for u in ups])
    for k in ups[0].tensors:
        ref = np.average(np.stack([u.tensors[k] for u in ups]), axis=0, weights=w)
        np.testing.assert_allclose(got[k], ref, rtol=1e-6, atol=1e-6)
        assert got[k].dtype == np.float32


def test_fedavg_is_not_the_average_of_products() -> None:
    ups = updates()
    agg = fedavg(ups)
    err = product_error(agg, ups)
    assert err["rel_avg"] > 0.1  # the cross terms are real error, not rounding


def test_product_svd_is_exact_when_the_average_has_rank_at_most_r() -> None:
    # Two rank-2 updates whose products share no structure: the average has rank <= 4 = r.
    rng = np.random.default_rng(1)
    ups = []
    for i in range(2):
        t = adapter(rng, r=4)
        for prefix in MODS:
            t[f"{prefix}.lora_B.weight"][:, 2:] = 0.0  # each update has rank 2
        ups.append(WeightedUpdate(f"r{i}", t, 1.0 + i))
    agg = product_svd(ups)
    ref = average_products(ups)
    for prefix, (ka, kb) in lora_modules(agg).items():
        assert agg[ka].shape == ups[0].tensors[ka].shape and agg[kb].shape == ups[0].tensors[kb].shape
        np.testing.assert_allclose(agg[kb].astype(np.float64) @ agg[ka], ref[prefix], rtol=1e-4, atol=1e-5)
    assert product_error(agg, ups)["rel_avg"] < 1e-5


def test_product_svd_is_the_best_rank_r_approximation_otherwise() -> None:
    ups = updates(n=4, r=4)  # average of 4 generic rank-4 products has rank 16 > 4
    agg = product_svd(ups)
    ref = average_products(ups)
    for prefix, (ka, kb) in lora_modules(agg).items():
        u, s, vt = np.linalg.svd(ref[prefix])
        best = (u[:, :4] * s[:4]) @ vt[:4]
        np.testing.assert_allclose(agg[kb].astype(np.float64) @ agg[ka], best, rtol=1e-4, atol=1e-4)
    assert product_error(agg, ups)["rel_avg"] < product_error(fedavg(ups), ups)["rel_avg"]


def test_product_svd_keeps_a_row_scale_and_fills_null_directions() -> None:
    # First round from PEFT's init: B = 0 everywhere except one module trained a little.
    rng = np.random.default_rng(2)
    base = adapter(rng, r=4, scale_b=0.0)
    ups = []
    for i in range(2):
        t = {k: v.copy() for k, v in base.items()}
        t["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"][:, 0] = 0.01 * (i + 1)
        ups.append(WeightedUpdate(f"r{i}", t, 1.0))
    agg = product_svd(ups)
    for ka, _kb in lora_modules(agg).values():
        a = agg[ka].astype(np.float64)
        # No dead rank: every row of A is non-zero, rows are orthogonal with the participants' row scale.
        norms = np.linalg.norm(a, axis=1)
        assert np.all(norms > 0)
        np.testing.assert_allclose(norms, norms[0], rtol=1e-5)
        gram = a @ a.T
        np.testing.assert_allclose(gram - np.diag(np.diag(gram)), 0.0, atol=1e-4)
    assert product_error(agg, ups)["rel_avg"] < 1e-5


def test_weights_are_validated() -> None:
    ups = updates()
    with pytest.raises(ValueError):
        fedavg([WeightedUpdate("a", ups[0].tensors, 0.0)])
    with pytest.raises(ValueError):
        fedavg([])
    with pytest.raises(ValueError):
        fedavg([ups[0], WeightedUpdate("x", {k: v[:1] for k, v in ups[1].tensors.items()}, 1.0)])


def test_unpaired_keys_are_refused() -> None:
    with pytest.raises(ValueError):
        lora_modules(["m.lora_A.weight"])
    with pytest.raises(ValueError):
        lora_modules(["m.weight"])


def test_clip_update_scales_the_change_from_the_base() -> None:
    rng = np.random.default_rng(3)
    base = adapter(rng)
    big = WeightedUpdate("r0", {k: v + 10.0 for k, v in base.items()}, 1.0)
    clipped = clip_update(big, base, 1.0)
    assert delta_norm(clipped.tensors, base) == pytest.approx(1.0, rel=1e-5)
    # direction preserved
    k = next(iter(base))
    d = clipped.tensors[k] - base[k]
    assert np.allclose(d / d.flat[0], 1.0, atol=1e-4)
    small = WeightedUpdate("r1", {k: v + 1e-4 for k, v in base.items()}, 1.0)
    assert clip_update(small, base, 1.0) is small


def test_norm_clipping_wraps_an_inner_strategy() -> None:
    rng = np.random.default_rng(4)
    base = adapter(rng)
    ups = [
        WeightedUpdate("r0", {k: v + 0.01 for k, v in base.items()}, 1.0),
        WeightedUpdate("evil", {k: v + 1000.0 for k, v in base.items()}, 1.0),
    ]
    wrapped = NormClipping(FedAvg(), max_norm=1.0)
    agg = wrapped.aggregate(ups, base)
    assert delta_norm(agg, base) <= 1.0 + 1e-4
    assert "clip(fedavg" in wrapped.name
    with pytest.raises(ValueError):
        wrapped.aggregate(ups, None)


def test_make_strategy() -> None:
    assert isinstance(make_strategy("fedavg"), FedAvg)
    assert isinstance(make_strategy("product_svd"), ProductSVD)
    assert isinstance(make_strategy("product_svd", clip_norm=2.0), NormClipping)
    with pytest.raises(ValueError):
        make_strategy("median")


def test_product_error_relative_to_the_change() -> None:
    rng = np.random.default_rng(5)
    base = adapter(rng)
    ups = [
        WeightedUpdate(
            f"r{i}",
            {k: v + 0.01 * rng.standard_normal(v.shape).astype(np.float32) for k, v in base.items()},
            1.0,
        )
        for i in range(3)
    ]
    e = product_error(fedavg(ups), ups, base)
    assert e["rel_delta"] >= e["rel_avg"]  # the change is smaller than the adapter itself


# --- server learning rate -------------------------------------------------------------------------------
def _shared_a_round(seed: int, n: int = 3) -> tuple[dict[str, np.ndarray], list[WeightedUpdate]]:
    """A base and `n` updates that changed only B (as in a round where A barely moves): every product
    lies in the row space of the common A, so product averaging is exact at rank r."""
    rng = np.random.default_rng(seed)
    base = adapter(rng, r=4, scale_b=0.1)
    ups = []
    for i in range(n):
        t = {k: v.copy() for k, v in base.items()}
        for prefix in MODS:
            kb = f"{prefix}.lora_B.weight"
            t[kb] = t[kb] + 0.05 * rng.standard_normal(t[kb].shape).astype(np.float32)
        ups.append(WeightedUpdate(f"r{i}", t, float(i + 1)))
    return base, ups


@pytest.mark.parametrize("server_lr", [0.5, 2.0, "participants"])
def test_server_lr_takes_the_step_from_the_base_fedavg(server_lr: float | str) -> None:
    base, ups = _shared_a_round(7)
    eta = len(ups) if server_lr == "participants" else server_lr
    got = fedavg(ups, base, server_lr)  # type: ignore[arg-type]
    avg = fedavg(ups)
    for k in base:
        ref = base[k].astype(np.float64) + eta * (avg[k].astype(np.float64) - base[k])
        np.testing.assert_allclose(got[k], ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("server_lr", [0.5, 2.0, "participants"])
def test_server_lr_takes_the_step_from_the_base_product_svd(server_lr: float | str) -> None:
    base, ups = _shared_a_round(8)
    eta = len(ups) if server_lr == "participants" else server_lr
    got = product_svd(ups, base=base, server_lr=server_lr)  # type: ignore[arg-type]
    avg = average_products(ups)
    for prefix, (ka, kb) in lora_modules(got).items():
        b0a0 = base[kb].astype(np.float64) @ base[ka].astype(np.float64)
        ref = b0a0 + eta * (avg[prefix] - b0a0)
        np.testing.assert_allclose(got[kb].astype(np.float64) @ got[ka], ref, rtol=1e-4, atol=1e-4)
    assert product_error(got, ups, base, server_lr)["rel_delta"] < 1e-4  # type: ignore[arg-type]
    # Measured against the plain average instead, the same candidate is far off (unless eta is 1).
    assert product_error(got, ups, base)["rel_delta"] > 0.1


def test_participants_sums_one_update_per_domain() -> None:
    # Equal weights, one participant each: the candidate's change is the sum of the participants' changes.
    base, ups = _shared_a_round(9)
    ups = [WeightedUpdate(u.replica_id, u.tensors, 1.0) for u in ups]
    got = fedavg(ups, base, "participants")
    for k in base:
        ref = base[k].astype(np.float64) + sum(u.tensors[k].astype(np.float64) - base[k] for u in ups)
        np.testing.assert_allclose(got[k], ref, rtol=1e-5, atol=1e-5)
    # One participant: "participants" is plain averaging (the participant's own adapter).
    one = fedavg(ups[:1], base, "participants")
    for k in base:
        np.testing.assert_allclose(one[k], ups[0].tensors[k], rtol=1e-6, atol=1e-6)


def test_server_lr_is_validated_and_named() -> None:
    base, ups = _shared_a_round(10)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="server learning rate"):
            fedavg(ups, base, bad)
    with pytest.raises(ValueError, match="base version"):
        product_svd(ups, server_lr=2.0)  # the step needs the base
    assert make_strategy("product_svd").name == "product_svd"
    s = make_strategy("product_svd", clip_norm=2.0, server_lr="participants")
    assert s.server_lr == "participants" and "server_lr=participants" in s.name


@pytest.mark.parametrize("products", [False, True])
def test_rebase_applies_the_candidates_change_to_the_newer_version(products: bool) -> None:
    """new + scale x (candidate - old): tensor by tensor, or per module in product space (exact here:
    the three versions share A, so the result is still of the adapter's rank)."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((4, 6))
    old, new, cand = (
        {"m.lora_A.weight": a, "m.lora_B.weight": rng.standard_normal((5, 4))} for _ in range(3)
    )
    out = rebase_aggregate(cand, old, new, 0.5, products)
    want_b = new["m.lora_B.weight"] + 0.5 * (cand["m.lora_B.weight"] - old["m.lora_B.weight"])
    if products:
        got = out["m.lora_B.weight"] @ out["m.lora_A.weight"]
        np.testing.assert_allclose(got, want_b @ a, atol=1e-9)
        assert out["m.lora_A.weight"].shape == (4, 6)
    else:
        np.testing.assert_allclose(out["m.lora_B.weight"], want_b)
        np.testing.assert_allclose(out["m.lora_A.weight"], a)
