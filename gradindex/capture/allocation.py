"""Projection sizes per layer from a byte budget (``gradindex build --projection auto --budget B``).

A layer's stored row is ``k_g × k_a`` numbers; a side whose size reaches its width (``N_i+1`` or
``N_o``) is stored exactly (size 0 in :class:`~gradindex.capture.projection.ProjectionSpec`).
Rules, each a one-parameter family searched for the largest member within the budget:

* ``ratio``: every layer keeps the same share of its numbers (each side ``k ∝`` its width);
* ``equal``: one ``k`` for every side of every layer (capped at the side's width), the fixed-``K``
  default made budget-aware;
* ``spectrum``: each side ``k ∝`` its effective rank (``(Σλ)²/Σλ²`` of its factor), capped at the
  width; needs the factors' eigenvalues;
* ``cost``: each layer the numbers ``ratio`` gives it, split between its sides so that the capture
  computes them with the fewest multiply-adds per token (:func:`capture_cost`: mapping each side,
  their outer product and the covariance factors); a narrow side is then often kept exact.

``benchmarks/rowspace.py`` measures them against full-space EK-FAC; docs/math.md ("What a row holds") gives the curve.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from gradindex.methods import absolute_damping

ALLOCATIONS = ("ratio", "equal", "spectrum", "cost")
DEFAULT_ALLOCATION = "cost"
"""The build's default (``BuildConfig.allocation``): as faithful as ``ratio`` at the same bytes, and the
capture's mapping about half as costly (``benchmarks/results/rowspace_cost.json``, ``buildcost.json``)."""


def effective_rank(eigenvalues: np.ndarray) -> float:
    """Participation ratio ``(Σλ)² / Σλ²`` of a factor's (non-negative) eigenvalues."""
    lam = np.clip(np.asarray(eigenvalues, np.float64), 0.0, None)
    s2 = float((lam**2).sum())
    return float(lam.sum() ** 2 / s2) if s2 > 0 else 1.0


def _sizes(widths: Mapping[str, tuple[int, int]], targets: Mapping[str, tuple[float, float]],
           x: float) -> dict[str, tuple[int, int]]:
    out = {}
    for n, (n_a, n_g) in widths.items():
        t_a, t_g = targets[n]
        k_a = max(1, int(math.floor(x * t_a)))
        k_g = max(1, int(math.floor(x * t_g)))
        out[n] = (0 if k_a >= n_a else k_a, 0 if k_g >= n_g else k_g)
    return out


def stored_numbers(widths: Mapping[str, tuple[int, int]], sizes: Mapping[str, tuple[int, int]]) -> int:
    """Numbers per example of a per-layer plan (0 = exact side, stored at its width)."""
    return sum((sizes[n][0] or n_a) * (sizes[n][1] or n_g) for n, (n_a, n_g) in widths.items())


def capture_cost(n_a: int, n_g: int, k_a: int, k_g: int) -> int:
    """Multiply-adds per token of one layer's row ``[k_g, k_a]`` on the factorized route: each side mapped
    (nothing for an exact side, ``k = n``), the outer product, and the covariance factors ``A``, ``S``."""
    return n_a * k_a * (k_a < n_a) + n_g * k_g * (k_g < n_g) + k_a * k_g + k_a * k_a + k_g * k_g


def cheapest_split(n_a: int, n_g: int, numbers: int, keep: float = 0.98) -> tuple[int, int]:
    """``(k_a, k_g)`` (0 = exact side) with at most ``numbers`` and at least ``keep`` of them, at the
    least :func:`capture_cost` (which grows with ``k_g`` but drops where the side becomes exact: for each
    ``k_a`` the fewest ``k_g`` that keep enough, and the exact side)."""
    best, plan = None, (n_a, n_g)
    for k_a in range(1, n_a + 1):
        top = min(n_g, numbers // k_a)
        for k_g in {-(-math.ceil(keep * numbers) // k_a), n_g}:
            if k_g > top or k_a * k_g < keep * numbers:
                continue
            c = capture_cost(n_a, n_g, k_a, k_g)
            if best is None or c < best:
                best, plan = c, (k_a, k_g)
    k_a, k_g = plan
    return 0 if k_a >= n_a else k_a, 0 if k_g >= n_g else k_g


def allocate(
    widths: Mapping[str, tuple[int, int]],
    budget: int,
    rule: str = "ratio",
    bytes_per_number: float = 4.0,
    spectra: Mapping[str, tuple[np.ndarray, np.ndarray]] | None = None,
) -> dict[str, tuple[int, int]]:
    """layer → ``(k_a, k_g)`` (0 = exact side) spending at most ``budget`` bytes per example.

    ``widths``: layer → ``(N_i+1, N_o)``. ``spectra`` (rule ``spectrum``): layer → eigenvalues of
    ``(A, S)``. The largest plan of the rule's family that fits is returned.
    """
    if rule not in ALLOCATIONS:
        raise ValueError(f"allocation rule {rule!r} is not one of {ALLOCATIONS}")
    if rule == "cost":
        ratio = allocate(widths, budget, "ratio", bytes_per_number)
        return {n: (0, 0) if ratio[n] == (0, 0) else cheapest_split(a, g, (ratio[n][0] or a) * (ratio[n][1] or g))
                for n, (a, g) in widths.items()}
    cap = budget / bytes_per_number
    floor = len(widths)  # 1x1 per layer
    if cap < floor:
        raise ValueError(f"budget {budget} bytes per example is below the minimum of {floor * bytes_per_number:g} "
                         f"(one number per layer for {len(widths)} layers); raise --budget")
    if rule == "equal":
        targets = {n: (1.0, 1.0) for n in widths}
    elif rule == "ratio":
        targets = {n: (float(a), float(g)) for n, (a, g) in widths.items()}
    else:
        if not spectra or any(n not in spectra for n in widths):
            raise ValueError("the spectrum allocation needs every layer's factor eigenvalues (a K-FAC basis pass)")
        targets = {n: (effective_rank(spectra[n][0]), effective_rank(spectra[n][1])) for n in widths}
    hi = max(max(a / targets[n][0], g / targets[n][1]) for n, (a, g) in widths.items())  # all exact at x = hi
    if stored_numbers(widths, _sizes(widths, targets, hi)) <= cap:
        return {n: (0, 0) for n in widths}
    lo = 0.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if stored_numbers(widths, _sizes(widths, targets, mid)) <= cap:
            lo = mid
        else:
            hi = mid
    return _sizes(widths, targets, lo)


def influence_share(lam: np.ndarray, damping: float) -> np.ndarray:
    """``Λ / (Λ + δ)`` with ``δ = damping × mean(Λ)``: each whitened coordinate's expected share of an
    influence score (about 1 far above the damping, about 0 far below it)."""
    lam = np.clip(np.asarray(lam, np.float64), 0.0, None)
    return lam / (lam + absolute_damping(damping, lam))


def influence_counts(spectra: Mapping[str, tuple[np.ndarray, np.ndarray]], cap_numbers: int) -> dict[str, np.ndarray]:
    """layer → ``m`` ``[n_g]`` (non-increasing): keep eigen-coordinates ``(i, j)`` with ``j < m_i``.

    ``spectra``: layer → ``(λ_A, λ_S)`` of its full-space factors, each sorted largest first. A
    coordinate's K-FAC eigenvalue relative to its layer's mean, ``λ_S,i λ_A,j / mean(λ_S λ_Aᵀ)``, says
    how far above the (relative) damping it lies, hence about how much of an influence score it
    carries (:func:`influence_share`); the ``cap_numbers`` coordinates with the largest such ratio
    over all layers are kept, one threshold for the model, and every layer keeps at least its top one.
    """
    if cap_numbers < len(spectra):
        raise ValueError(f"{cap_numbers} numbers per example cannot hold one number per layer for "
                         f"{len(spectra)} layers; raise --budget")
    norm = {}
    for n, (lam_a, lam_s) in spectra.items():
        a, s = (np.clip(np.asarray(x, np.float64), 0.0, None) for x in (lam_a, lam_s))
        if np.any(np.diff(a) > 0) or np.any(np.diff(s) > 0):
            raise ValueError(f"eigenvalues of layer {n!r} must be sorted largest first")
        norm[n] = (a / a.mean() if a.mean() > 0 else a, s / s.mean() if s.mean() > 0 else s)

    def counts(tau: float) -> dict[str, np.ndarray]:
        out = {}
        for n, (a, s) in norm.items():
            need = np.divide(tau, s, out=np.full_like(s, np.inf), where=s > 0)  # [n_g]: λ_A ratio each row needs
            m = len(a) - np.searchsorted(a[::-1], need, side="left")  # #{j: a_j >= need_i}
            m[0] = max(int(m[0]), 1)
            out[n] = np.minimum(m, len(a)).astype(np.int64)
        return out

    if sum(len(a) * len(s) for a, s in norm.values()) <= cap_numbers:
        return {n: np.full(len(s), len(a), np.int64) for n, (a, s) in norm.items()}
    lo, hi = -60.0, 60.0  # log2 of the threshold: kept counts fall as it rises
    for _ in range(100):
        mid = (lo + hi) / 2
        if sum(int(m.sum()) for m in counts(2.0 ** mid).values()) <= cap_numbers:
            hi = mid
        else:
            lo = mid
    return counts(2.0 ** hi)
