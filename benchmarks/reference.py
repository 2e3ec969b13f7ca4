"""The independent numpy reference: curvature math and stored-row codes, written apart from the library.

The compression study (``_study.py``) scores full-space gradients with these functions and checks
the result against gradindex's own full-space EK-FAC (``reference_check`` in fidelity.json), and
tests/test_compression_study.py checks them against explicit Kronecker matrices, so this module
must never import gradindex: it is a second implementation on purpose, not a copy to keep in step.
It also simulates stores the library does not write (whitened-eigenbasis codes, MSE clipping).

One layer's per-example gradients are ``G`` ``[n, N_o, N_i]`` (``N_i`` counts the bias column), its
token-mean factors ``A`` ``[N_i, N_i]`` and ``S`` ``[N_o, N_o]`` (docs/design.md, "The math in brief"). Every
compression is an *asymmetric* pair: training rows are encoded and stored, the query stays in
float64, and a score is an inner product between a query-side vector and a decoded stored row.

* raw basis: store ``G`` (or a code of it); the query side is ``(H + δI)⁻¹ G_q``;
* whitened eigenbasis: store ``W = (Q_Sᵀ G Q_A) ⊙ (Λ + δ)^{-1/2}``; the query side is the same map,
  so ``⟨W_q, W_t⟩`` is the K-FAC / EK-FAC influence exactly (:func:`whiten`);
* factored projection ``P_g G P_aᵀ`` (LoGra), optionally of a whitened ``W``;
* codes: float16, ``b``-bit integers with a per-row (or per-column) scale, deterministic or
  stochastic rounding, absmax or MSE-optimal clipping (:func:`quantize`).

Curvature follows the library's conventions (``gradindex/precondition/apply.py``): eigenvalues as
computed, relative damping ``δ = damping × mean(Λ)``, ``Λ + δ`` floored at ``δ/2``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


# -- curvature ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Curvature:
    """One layer's Kronecker eigenbasis and eigenvalues (float64)."""

    Q_S: np.ndarray
    """``[N_o, N_o]`` eigenvectors of ``S``."""
    Q_A: np.ndarray
    """``[N_i, N_i]`` eigenvectors of ``A``."""
    Lambda: np.ndarray
    """``[N_o, N_i]`` eigenvalues: ``λ_S λ_Aᵀ`` (K-FAC) or the corrected ``E_n[(Q_Sᵀ G_n Q_A)²]`` (EK-FAC)."""

    def delta(self, damping: float) -> float:
        """Absolute damping ``δ = damping × mean(Λ)`` (``damping`` itself when ``Λ`` is all zero)."""
        m = float(self.Lambda.mean())
        return damping * m if m > 0 else float(damping)

    def damped(self, damping: float, power: float) -> np.ndarray:
        """``[N_o, N_i]`` ``(Λ + δ)^power``, ``Λ + δ`` floored at ``δ/2``."""
        d = self.delta(damping)
        return np.maximum(self.Lambda + d, 0.5 * d) ** power


def eigh(M: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(λ ascending, Q)`` of the symmetrized ``M`` in float64."""
    M = np.asarray(M, dtype=np.float64)
    return np.linalg.eigh(0.5 * (M + M.T))


def rotate(G: np.ndarray, Q_S: np.ndarray, Q_A: np.ndarray) -> np.ndarray:
    """``Q_Sᵀ G Q_A`` for ``G`` ``[n, N_o, N_i]`` (into the Kronecker eigenbasis)."""
    return Q_S.T @ G @ Q_A


def fit_curvature(A: np.ndarray, S: np.ndarray, G: np.ndarray | None = None, method: str = "ekfac") -> Curvature:
    """K-FAC (``λ_S λ_Aᵀ``) or EK-FAC (``Λ*`` = mean over the rows of ``G`` of the squared rotated rows)."""
    lam_A, Q_A = eigh(A)
    lam_S, Q_S = eigh(S)
    if method == "kfac":
        return Curvature(Q_S, Q_A, np.outer(lam_S, lam_A))
    if method != "ekfac" or G is None:
        raise ValueError(f"method must be 'kfac', or 'ekfac' with G given; got {method!r}")
    lam = np.zeros((len(lam_S), len(lam_A)))
    for s in range(0, len(G), 64):  # bounded memory
        lam += np.square(rotate(np.asarray(G[s: s + 64], dtype=np.float64), Q_S, Q_A)).sum(0)
    return Curvature(Q_S, Q_A, lam / len(G))


def precondition(G: np.ndarray, curv: Curvature, damping: float, power: float = -1.0) -> np.ndarray:
    """``(H + δI)^power G`` in the raw basis, ``G`` ``[n, N_o, N_i]``."""
    return curv.Q_S @ (rotate(G, curv.Q_S, curv.Q_A) * curv.damped(damping, power)) @ curv.Q_A.T


def whiten(G: np.ndarray, curv: Curvature, damping: float) -> np.ndarray:
    """``(Q_Sᵀ G Q_A) ⊙ (Λ + δ)^{-1/2}`` ``[n, N_o, N_i]``: coordinates of ``H^{-1/2} G`` in the eigenbasis."""
    return rotate(G, curv.Q_S, curv.Q_A) * curv.damped(damping, -0.5)


def influence(Gq: np.ndarray, Gt: np.ndarray, curv: Curvature, damping: float) -> np.ndarray:
    """``[Q, N]`` ``⟨(H + δI)⁻¹ G_q, G_t⟩`` computed in the raw basis (the reference formula)."""
    Pq = precondition(Gq, curv, damping).reshape(len(Gq), -1)
    return Pq @ np.asarray(Gt, dtype=np.float64).reshape(len(Gt), -1).T


def factor_whiteners(A: np.ndarray, S: np.ndarray, damping: float) -> tuple[np.ndarray, np.ndarray]:
    """``(S_δ^{-1/2} [N_o, N_o], A_δ^{-1/2} [N_i, N_i])`` with per-factor damping ``√damping × mean(λ)``,
    so that ``S_δ^{-1/2} G A_δ^{-1/2}`` whitens by a damped K-FAC (the damping floor of ``S_δ ⊗ A_δ`` is
    ``damping × mean(λ_S λ_Aᵀ)``, as for the library's K-FAC)."""
    out = []
    for M in (S, A):
        lam, Q = eigh(M)
        d = math.sqrt(damping) * max(float(lam.mean()), 0.0) or math.sqrt(damping)
        out.append((Q * np.maximum(lam + d, 0.5 * d) ** -0.5) @ Q.T)
    return out[0], out[1]


# -- projections --------------------------------------------------------------------------------------
def gaussian_projection(k: int, n: int, seed: int) -> np.ndarray:
    """``[k, n]`` with i.i.d. N(0, 1/k) entries, so ``E[PᵀP] = I``; the identity when ``k >= n``."""
    if k >= n:
        return np.eye(n)
    return np.random.default_rng(seed).standard_normal((k, n)) / math.sqrt(k)


def project(G: np.ndarray, P_g: np.ndarray, P_a: np.ndarray) -> np.ndarray:
    """``P_g G P_aᵀ`` ``[n, k_g, k_a]``."""
    return P_g @ G @ P_a.T


def ratio_sizes(n_out: int, n_in: int, ratio: float) -> tuple[int, int]:
    """``(k_g, k_a) = (⌈r N_o⌉, ⌈r N_i⌉)``, at most the layer's own sizes."""
    return min(n_out, math.ceil(ratio * n_out)), min(n_in, math.ceil(ratio * n_in))


# -- codes --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Code:
    """Integer codes of rows ``x`` ``[n, D]``: ``x ≈ (codes - zero) * scale``."""

    codes: np.ndarray
    """``[n, D]`` integers in ``[0, 2^bits)``."""
    scale: np.ndarray
    """``[n, 1]`` (per row) or ``[1, D]`` (per column) step sizes."""
    zero: float
    """``(2^bits - 1) / 2`` for a midrise grid, ``2^(bits-1) - 1`` for a midtread grid."""
    bits: int

    def decode(self) -> np.ndarray:
        return (self.codes.astype(np.float64) - self.zero) * self.scale


def _levels(bits: int, grid: str) -> tuple[float, float]:
    """``(zero, half)``: codes ``c`` in ``[0, 2·half]`` stand for ``(c - zero)``; clip at ``half`` steps."""
    if grid == "midtread":  # symmetric with an exact zero: -(2^(b-1)-1) .. 2^(b-1)-1 (int8: ±127)
        h = 2 ** (bits - 1) - 1
        return float(h), float(h)
    if grid == "midrise":  # 2^b levels ±0.5, ±1.5, ... (no zero; 2-bit: 4 levels)
        h = (2**bits - 1) / 2
        return h, h
    raise ValueError(f"grid must be 'midtread' or 'midrise', got {grid!r}")


CLIP_FRACTIONS = (1.0, 0.7, 0.5, 0.35, 0.25, 0.18, 0.12)
"""Candidate clip levels (fractions of the row's max |x|) of the MSE-optimal clipping search."""


def quantize(x: np.ndarray, bits: int, per: str = "row", grid: str = "midtread", clip: str = "absmax",
             rounding: str = "nearest", seed: int = 0) -> Code:
    """``bits``-bit uniform codes of rows ``x`` ``[n, D]`` with one scale per row (``per='row'``) or column.

    ``clip='absmax'``: the grid spans the largest ``|x|``; ``'mse'``: per row (or column), the clip level
    among :data:`CLIP_FRACTIONS` of the max that minimizes the squared error (values beyond it saturate).
    ``rounding='stochastic'``: round up with probability equal to the fraction (unbiased).
    """
    if grid == "midtread" and bits < 2:
        raise ValueError(f"a midtread grid needs bits >= 2, got {bits}")
    x = np.asarray(x, dtype=np.float64)
    axis = 1 if per == "row" else 0
    if per not in ("row", "col"):
        raise ValueError(f"per must be 'row' or 'col', got {per!r}")
    zero, half = _levels(bits, grid)
    amax = np.abs(x).max(axis=axis, keepdims=True)
    amax = np.where(amax > 0, amax, 1.0)
    rng = np.random.default_rng(seed) if rounding == "stochastic" else None

    def code(scale: np.ndarray) -> np.ndarray:
        y = x / scale + zero  # code c stands for (c - zero)·scale; zero is a half-integer on a midrise grid
        c = np.floor(y + rng.random(y.shape)) if rng is not None else np.rint(y)
        return np.clip(c, 0, 2 * half)

    if clip == "absmax":
        scale = amax / half
        return Code(code(scale).astype(np.int16), scale, zero, bits)
    if clip != "mse":
        raise ValueError(f"clip must be 'absmax' or 'mse', got {clip!r}")
    best_err, best = None, None
    for f in CLIP_FRACTIONS:
        scale = f * amax / half
        c = code(scale)
        err = np.square((c - zero) * scale - x).sum(axis=axis, keepdims=True)
        if best is None:
            best_err, best = err, (c, scale)
        else:
            take = err < best_err
            best_err = np.where(take, err, best_err)
            best = (np.where(take, c, best[0]), np.where(take, scale, best[1]))
    return Code(best[0].astype(np.int16), best[1], zero, bits)


def fp16(x: np.ndarray) -> np.ndarray:
    """Round-trip through IEEE half precision."""
    return np.asarray(x).astype(np.float16).astype(np.float64)


def row_bytes(D: int, bits: int, per: str = "row") -> int:
    """Stored bytes of one row of ``D`` numbers at ``bits`` bits, plus a float32 scale when per row."""
    return math.ceil(D * bits / 8) + (4 if per == "row" else 0)


def roundtrip(x: np.ndarray, code: str, seed: int = 0) -> tuple[np.ndarray, int]:
    """``(decoded rows, bytes per row)`` of rows ``x`` ``[n, D]`` under a code name:
    ``fp32``, ``fp16``, ``int<b>`` (per-row absmax, midtread), ``int<b>-mse`` (MSE clip),
    ``int<b>-sr`` (stochastic rounding), ``int<b>-col`` (per-column absmax; scales shared, not counted),
    ``int<b>-mr`` (midrise grid with MSE clip: ``2^b`` levels, e.g. 4 for 2 bits)."""
    D = x.shape[1]
    if code == "fp32":
        return np.asarray(x, dtype=np.float32).astype(np.float64), 4 * D
    if code == "fp16":
        return fp16(x), 2 * D
    if not code.startswith("int"):
        raise ValueError(f"unknown code {code!r}")
    name, _, variant = code.partition("-")
    bits = int(name[3:])
    kw = {"": {}, "mse": {"clip": "mse"}, "sr": {"rounding": "stochastic", "seed": seed},
          "col": {"per": "col"}, "mr": {"grid": "midrise", "clip": "mse"},
          "mrsr": {"grid": "midrise", "clip": "mse", "rounding": "stochastic", "seed": seed}}[variant]
    c = quantize(x, bits, **kw)
    return c.decode(), row_bytes(D, bits, kw.get("per", "row"))


def scores(q: list[np.ndarray], t: list[np.ndarray]) -> np.ndarray:
    """``[Q, N]`` ``Σ_layers ⟨q_l, t_l⟩`` for per-layer rows ``q_l`` ``[Q, d_l]``, ``t_l`` ``[N, d_l]``."""
    out = 0.0
    for a, b in zip(q, t, strict=True):
        out = out + a.reshape(len(a), -1) @ b.reshape(len(b), -1).T
    return np.asarray(out)
