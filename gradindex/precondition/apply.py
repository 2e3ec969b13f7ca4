"""Pure tensor functions: Kronecker eigenbasis rotations and ``(H + δI)^p`` for K-FAC / EK-FAC.

A stored row is a row-major flattened ``[k_g, k_a]`` matrix ``Ĝ``. With ``S = Q_S Λ_S Q_Sᵀ`` and
``A = Q_A Λ_A Q_Aᵀ``, the Kronecker basis ``Q = Q_S ⊗ Q_A`` acts on a row as
``Q_Sᵀ Ĝ Q_A`` (row-major ``vec(S Ĝ Aᵀ) = (S ⊗ A) vec(Ĝ)``). Both methods are then diagonal in
that basis, with eigenvalues ``Λ`` ``[k_g, k_a]``: ``λ_S λ_Aᵀ`` (K-FAC) or the corrected
``Λ*`` (EK-FAC). So ``(H + δI)^p Ĝ = Q_S [(Q_Sᵀ Ĝ Q_A) ⊙ (Λ + δ)^p] Q_Aᵀ``.
"""

from __future__ import annotations

import numpy as np
import torch

from gradindex.methods import absolute_damping  # noqa: F401 (re-exported)
from gradindex.store.basis import rotate  # noqa: F401 (re-exported: the one rotation of stored rows)


def eigendecompose(M: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(λ ascending [k], Q [k, k])`` of a symmetric matrix, in float64 on the symmetrized input.

    LAPACK through torch, which honours ``torch.set_num_threads`` (NumPy's OpenBLAS spawns its own
    threads: 13 s against 0.9 s for a 1025² matrix on a shared 2-core machine).
    """
    M = torch.as_tensor(np.asarray(M, dtype=np.float64))
    lam, Q = torch.linalg.eigh(0.5 * (M + M.T))
    return lam.numpy(), Q.numpy()


def kfac_eigenvalues(lam_S: np.ndarray, lam_A: np.ndarray) -> np.ndarray:
    """``[k_g, k_a]`` K-FAC eigenvalues ``λ_S λ_Aᵀ``, as computed (round-off negatives kept)."""
    return np.outer(lam_S, lam_A)


def unrotate(R: torch.Tensor, Q_S: torch.Tensor, Q_A: torch.Tensor) -> torch.Tensor:
    """``Q_S R Q_Aᵀ`` for a batch ``R`` ``[n, k_g, k_a]`` (back from the eigenbasis)."""
    return Q_S @ R @ Q_A.T


def damped(Lam: torch.Tensor, delta: float, power: float) -> torch.Tensor:
    """``(Λ + δ)^power``, with ``Λ + δ`` floored at ``δ/2``.

    Eigenvalues are used as computed, so ``power=-1`` is exactly ``(S ⊗ A + δI)⁻¹``; the floor only
    acts where a round-off negative eigenvalue (a null direction of ``S`` or ``A``, e.g. the one a
    LayerNorm leaves in the gradients) exceeds ``δ/2`` in size, and keeps every power finite.
    """
    return (Lam + delta).clamp_min(0.5 * delta).pow(power)


def eigen_power(
    x: torch.Tensor, Q_S: torch.Tensor, Q_A: torch.Tensor, Lam: torch.Tensor, delta: float, power: float
) -> torch.Tensor:
    """``(H + δI)^power x`` for rows ``x`` ``[n, k_g·k_a]``, ``H = Q diag(Λ) Qᵀ``, ``Q = Q_S ⊗ Q_A``.

    ``Q_S`` ``[k_g, k_g]``, ``Q_A`` ``[k_a, k_a]``, ``Lam`` ``[k_g, k_a]``, all on
    ``x``'s device and dtype. ``power = -1`` is ``H⁻¹``, ``-0.5`` the whitening ``H^{-1/2}``.
    (``(H + δI)^p`` is shorthand for ``Q diag(damped(Λ, δ, p)) Qᵀ``.)
    """
    k_g, k_a = Lam.shape
    n = x.shape[0]
    R = rotate(x.reshape(n, k_g, k_a), Q_S, Q_A)  # [n, k_g, k_a]
    R = R * damped(Lam, delta, power)
    return unrotate(R, Q_S, Q_A).reshape(n, k_g * k_a)
