"""The codecs of benchmarks/reference.py against independent computations (explicit Kronecker
matrices, element-wise error bounds, statistics of random projections)."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks import reference as C

N_O, N_I = 5, 4


def _layer(n: int = 12, seed: int = 0):
    """Per-example gradients with a skewed spectrum, and factors from per-token vectors."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((200, N_I)) * np.array([3.0, 1.0, 0.3, 0.1])  # [tokens, N_i]
    g = rng.standard_normal((200, N_O)) * np.array([2.0, 1.0, 0.5, 0.2, 0.05])  # [tokens, N_o]
    A, S = a.T @ a / len(a), g.T @ g / len(g)
    G = np.einsum("nto,nti->noi", g[: 10 * n].reshape(n, 10, N_O), a[: 10 * n].reshape(n, 10, N_I))
    return G, A, S


def _explicit_H(curv: C.Curvature, damping: float) -> np.ndarray:
    """``Q diag(max(Λ+δ, δ/2)) Qᵀ`` with ``Q = Q_S ⊗ Q_A`` acting on row-major ``vec(G)``."""
    Q = np.kron(curv.Q_S, curv.Q_A)
    d = curv.delta(damping)
    return Q @ np.diag(np.maximum(curv.Lambda.ravel() + d, 0.5 * d)) @ Q.T


@pytest.mark.parametrize("method", ["kfac", "ekfac"])
def test_whitened_inner_product_equals_influence_from_the_explicit_matrix(method):
    G, A, S = _layer()
    Gq = _layer(3, seed=1)[0]
    curv = C.fit_curvature(A, S, G, method)
    H = _explicit_H(curv, 0.1)
    want = np.linalg.solve(H, Gq.reshape(3, -1).T).T @ G.reshape(len(G), -1).T  # [Q, N]
    W, Wq = C.whiten(G, curv, 0.1), C.whiten(Gq, curv, 0.1)
    got = C.scores([Wq], [W])
    assert np.allclose(got, want, rtol=1e-6, atol=1e-9 * np.abs(want).max())
    assert np.allclose(C.influence(Gq, G, curv, 0.1), want, rtol=1e-6, atol=1e-9 * np.abs(want).max())


def test_ekfac_eigenvalues_are_the_mean_squared_rotated_gradients():
    G, A, S = _layer()
    curv = C.fit_curvature(A, S, G, "ekfac")
    Q = np.kron(curv.Q_S, curv.Q_A)
    want = np.mean((G.reshape(len(G), -1) @ Q) ** 2, axis=0)
    assert np.allclose(curv.Lambda.ravel(), want)
    kf = C.fit_curvature(A, S, None, "kfac")
    assert np.allclose(_explicit_H(kf, 1e-12), np.kron(S, A), atol=1e-8)


def test_factor_whiteners_score_as_the_inverse_of_the_damped_kronecker_product():
    G, A, S = _layer()
    Sw, Aw = C.factor_whiteners(A, S, 0.1)
    dS, dA = np.sqrt(0.1) * np.linalg.eigvalsh(S).mean(), np.sqrt(0.1) * np.linalg.eigvalsh(A).mean()
    H = np.kron(S + dS * np.eye(N_O), A + dA * np.eye(N_I))
    want = np.linalg.solve(H, G[:2].reshape(2, -1).T).T @ G.reshape(len(G), -1).T
    assert np.allclose(C.scores([Sw @ G[:2] @ Aw], [Sw @ G @ Aw]), want, rtol=1e-6)


def test_int8_and_int4_round_trips_stay_within_half_a_step():
    x = np.random.default_rng(0).standard_normal((50, 300)) * np.exp(np.random.default_rng(1).standard_normal((50, 1)))
    for bits in (8, 4):
        c = C.quantize(x, bits)
        step = np.abs(x).max(1, keepdims=True) / (2 ** (bits - 1) - 1)
        assert np.all(np.abs(c.decode() - x) <= 0.5 * step + 1e-12)
        assert c.codes.min() >= 0 and c.codes.max() <= 2**bits - 2  # midtread: one code unused
    dec, nbytes = C.roundtrip(x, "int4")
    assert nbytes == 150 + 4 and np.allclose(dec, C.quantize(x, 4).decode())


def test_mse_clipping_never_loses_to_absmax_and_midrise_two_bits_has_four_levels():
    x = np.random.default_rng(2).standard_t(3, size=(40, 500))
    for bits in (2, 4):
        grid = "midrise" if bits == 2 else "midtread"
        e_abs = np.square(C.quantize(x, bits, grid=grid).decode() - x).sum(1)
        e_mse = np.square(C.quantize(x, bits, grid=grid, clip="mse").decode() - x).sum(1)
        assert np.all(e_mse <= e_abs + 1e-9) and e_mse.sum() < e_abs.sum()
    c = C.quantize(x, 2, grid="midrise", clip="mse")
    levels = np.unique(np.round(c.decode() / c.scale, 6))
    assert set(levels) <= {-1.5, -0.5, 0.5, 1.5}


def test_stochastic_rounding_is_unbiased():
    x = np.random.default_rng(3).standard_normal((1, 64))
    mean = np.mean([C.quantize(x, 2, rounding="stochastic", seed=s).decode() for s in range(4000)], axis=0)
    step = np.abs(x).max()
    assert np.abs(mean - x).max() < 0.05 * step


def test_per_column_scales_and_fp16():
    x = np.random.default_rng(4).standard_normal((30, 8)) * np.arange(1, 9)
    c = C.quantize(x, 8, per="col")
    assert c.scale.shape == (1, 8)
    assert np.all(np.abs(c.decode() - x) <= 0.5 * np.abs(x).max(0) / 127 + 1e-12)
    assert np.abs(C.fp16(x) - x).max() <= 2**-11 * np.abs(x).max()


def test_factored_projection_preserves_inner_products_in_expectation():
    rng = np.random.default_rng(5)
    X, Y = rng.standard_normal((2, 12, 10))
    want = (X * Y).sum()
    got = []
    for s in range(3000):
        P_g, P_a = C.gaussian_projection(3, 12, 2 * s), C.gaussian_projection(4, 10, 2 * s + 1)
        got.append((C.project(X[None], P_g, P_a) * C.project(Y[None], P_g, P_a)).sum())
    se = np.std(got) / np.sqrt(len(got))
    assert abs(np.mean(got) - want) < 4 * se
    assert np.array_equal(C.gaussian_projection(12, 12, 0), np.eye(12))  # k >= n: no projection
    assert C.ratio_sizes(64, 65, 0.354) == (23, 24)


@pytest.mark.parametrize("damping", [0.1, 1e-3])
def test_study_codecs_without_loss_reproduce_the_influence_scores(damping):
    """Uncoded (fp32 storage of float64 data aside), every scoring route of the study is EK-FAC influence."""
    from benchmarks import _study

    G, A, S = _layer(20)
    Gq = _layer(4, seed=1)[0]
    curv = C.fit_curvature(A, S, G, "ekfac")
    ctx = {"layers": [("l", G, A, S)], "Gq": [Gq], "damping": damping, "ekfac": [curv]}
    want = C.influence(Gq, G, curv, damping)
    for enc in (_study.raw_codec("fp32"), _study.eigen_codec("fp32"), _study.eigen_norm_codec("fp32"),
                _study.topvar_codec(1.0, "fp32"), _study.topvar_codec(1.0, "fp32", norm=True),
                _study.whitened_proj_codec(lambda o, i: (o, i))):
        e = enc(ctx, 0)
        assert np.allclose(C.scores(e.q, e.t), want, rtol=1e-5, atol=1e-6 * np.abs(want).max())
        selfinf = sum((a * b).sum(1) for a, b in zip(e.selfside, e.t, strict=True))
        assert np.allclose(selfinf, np.einsum("ni,ni->n", C.precondition(G, curv, damping).reshape(20, -1),
                                              G.reshape(20, -1)), rtol=1e-5)


def test_default_grid_holds_the_reference_and_the_library_default_codes():
    from benchmarks import _study

    names = [name for _, name, _, _ in _study.grid("default")]
    assert names[0] == "raw fp32" and "eigen int4" in names and len(names) == len(set(names))
    assert not any(random for *_, random in _study.grid("default"))
    with pytest.raises(ValueError, match="grid"):
        _study.grid("nope")
