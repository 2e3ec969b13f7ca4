"""The projection stream is pinned, seeded per layer and side, and preserves inner products."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gradindex.capture.projection import ProjectionSpec, projection_matrix

LAYER = "transformer.h.0.mlp.c_fc"

# Values pinned when the stream was introduced (STREAM_VERSION 1). If this test fails, an
# upgrade changed the matrices and every existing index would silently answer wrongly: restore
# the stream, or bump STREAM_VERSION and keep the old path.
PINNED = {
    ("gaussian", 0, "a"): [0.2272525131702423, 0.20761044323444366, -0.5789995193481445, 0.05706995353102684],
    ("gaussian", 7, "a"): [0.2807264029979706, 0.7415506839752197, -0.031087558716535568, -0.14325940608978271],
    ("gaussian", 0, "g"): [-0.09669911861419678, 0.5818353295326233, 1.036257266998291],
    ("rademacher", 0, "a"): [0.5, 0.5, -0.5, 0.5],
    ("rademacher", 7, "a"): [0.5, -0.5, 0.5, 0.5],
}


@pytest.mark.parametrize("key", sorted(PINNED))
def test_projection_stream_is_pinned(key):
    kind, seed, side = key
    m = projection_matrix(ProjectionSpec(kind=kind, k_a=4, k_g=4, seed=seed), LAYER, side, 10)
    got = (m[0, :4] if side == "a" else m[1, :3]).tolist()
    assert got == pytest.approx(PINNED[key], rel=1e-6, abs=1e-7)


def test_matrices_depend_on_seed_layer_and_side_only():
    s = ProjectionSpec(k_a=8, k_g=8, seed=1)
    a = projection_matrix(s, LAYER, "a", 32)
    assert torch.equal(a, projection_matrix(s, LAYER, "a", 32))
    assert not torch.equal(a, projection_matrix(s, LAYER, "g", 32))
    assert not torch.equal(a, projection_matrix(s, "other", "a", 32))
    assert not torch.equal(a, projection_matrix(ProjectionSpec(k_a=8, k_g=8, seed=2), LAYER, "a", 32))
    # Generated on the CPU in float64 regardless of the target device or torch's global RNG.
    torch.manual_seed(123)
    assert torch.equal(a, projection_matrix(s, LAYER, "a", 32, device="cpu"))
    if torch.cuda.is_available():  # pragma: no cover - exercised on GPU machines
        assert torch.equal(a, projection_matrix(s, LAYER, "a", 32, device="cuda").cpu())


@pytest.mark.parametrize("kind", ["gaussian", "rademacher"])
def test_entries_have_variance_one_over_k(kind):
    k, n = 64, 512
    m = projection_matrix(ProjectionSpec(kind=kind, k_a=k, k_g=k), LAYER, "a", n).double()
    assert abs(float(m.mean())) < 4 / math.sqrt(k * n) / math.sqrt(k)
    assert float(m.var()) * k == pytest.approx(1.0, rel=0.02)


@pytest.mark.parametrize("kind", ["gaussian", "rademacher"])
def test_factored_projection_preserves_inner_products_within_jl_bound(kind):
    """⟨P_g X P_aᵀ, P_g Y P_aᵀ⟩ ≈ ⟨X, Y⟩ for rank-1-sum gradients, error shrinking like 1/√k."""
    rng = np.random.default_rng(0)
    n_out, n_in, T = 48, 40, 6

    def grad_like():
        g, a = rng.standard_normal((T, n_out)), rng.standard_normal((T, n_in))
        return torch.from_numpy(g.T @ a).float()  # [N_o, N_i] = Σ_t g_t a_tᵀ

    pairs = [(grad_like(), grad_like()) for _ in range(40)]
    errs = {}
    for k in (8, 32):
        s = ProjectionSpec(kind=kind, k_a=k, k_g=k, seed=5)
        P_a, P_g = projection_matrix(s, LAYER, "a", n_in), projection_matrix(s, LAYER, "g", n_out)
        rel = []
        for X, Y in pairs:
            px, py = P_g @ X @ P_a.T, P_g @ Y @ P_a.T
            exact = float((X * Y).sum())
            rel.append((float((px * py).sum()) - exact) / (float(X.norm()) * float(Y.norm())))
        errs[k] = float(np.sqrt(np.mean(np.square(rel))))
        # JL-type bound for the factored (Kronecker) projection: error ~ c/√(k_a k_g)^{1/2}
        assert errs[k] < 3.0 / math.sqrt(k), (k, errs[k])
        assert abs(float(np.mean(rel))) < 3 * errs[k] / math.sqrt(len(rel))  # unbiased
    assert errs[32] < errs[8]


def test_projection_spec_parsing():
    assert ProjectionSpec.parse("16") == ProjectionSpec(k_a=16, k_g=16)
    assert ProjectionSpec.parse("8x32", kind="rademacher", seed=3) == ProjectionSpec("rademacher", 8, 32, 3)
    assert ProjectionSpec.parse("none").is_identity
    with pytest.raises(ValueError, match="KAxKG"):
        ProjectionSpec.parse("sixteen")
    with pytest.raises(ValueError, match="kind"):
        ProjectionSpec(kind="sparse")
