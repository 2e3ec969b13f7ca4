"""Projection sizes per layer from a byte budget (``gradindex build --projection auto --budget B``).

A layer's stored row is ``k_g × k_a`` numbers; a side whose size reaches its width (``N_i+1`` or
``N_o``) is stored exactly (size 0 in :class:`~gradindex.capture.projection.ProjectionSpec`).
Rules, each a one-parameter family searched for the largest member within the budget:

* ``ratio``: every layer keeps the same share of its numbers (each side ``k ∝`` its width);
* ``equal``: one ``k`` for every side of every layer (capped at the side's width), the fixed-``K``
  default made budget-aware;
* ``spectrum``: each side ``k ∝`` its effective rank (``(Σλ)²/Σλ²`` of its factor), capped at the
  width; needs the factors' eigenvalues.

``benchmarks/rowspace.py`` measures them against full-space EK-FAC; docs/math.md ("What a row holds") gives the curve.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

ALLOCATIONS = ("ratio", "equal", "spectrum")
DEFAULT_ALLOCATION = "ratio"


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


def allocate(
    widths: Mapping[str, tuple[int, int]],
    budget: int,
    rule: str = DEFAULT_ALLOCATION,
    bytes_per_number: float = 4.0,
    spectra: Mapping[str, tuple[np.ndarray, np.ndarray]] | None = None,
) -> dict[str, tuple[int, int]]:
    """layer → ``(k_a, k_g)`` (0 = exact side) spending at most ``budget`` bytes per example.

    ``widths``: layer → ``(N_i+1, N_o)``. ``spectra`` (rule ``spectrum``): layer → eigenvalues of
    ``(A, S)``. The largest plan of the rule's family that fits is returned.
    """
    if rule not in ALLOCATIONS:
        raise ValueError(f"allocation rule {rule!r} is not one of {ALLOCATIONS}")
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
