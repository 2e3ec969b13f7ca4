"""Sums of Gram matrices ``xᵀ x`` by the blocks on and above the diagonal (K-FAC factors of wide layers).

``xᵀ x`` is symmetric, so only its upper triangle needs computing. On the CPU, summing it by row
blocks of :data:`GRAM_BLOCK` (each block row times the columns from its diagonal on) costs ~60% of
the whole product at widths 768-1025 on one thread; elsewhere one product is faster.
"""

from __future__ import annotations

import numpy as np
import torch

GRAM_BLOCK = 128
"""Rows of one block on the CPU (64-192 measured within a few percent of each other)."""


def gram_block(device: torch.device | str) -> int:
    """Block rows for ``device``: :data:`GRAM_BLOCK` on the CPU, else one block (the whole product)."""
    return GRAM_BLOCK if torch.device(device).type == "cpu" else 1 << 62


def add_gram(acc: torch.Tensor, x: torch.Tensor, block: int) -> None:
    """``acc += xᵀ x`` on and above the diagonal (``x`` ``[n, k]``, ``acc`` ``[k, k]``), by row blocks of
    ``block``; below the diagonal blocks ``acc`` is left as it was (read it with :func:`upper_to_symmetric`)."""
    k = x.shape[1]
    if block >= k:
        acc.add_(x.T @ x)
        return
    for i in range(0, k, block):
        acc[i:i + block, i:].add_(x[:, i:i + block].T @ x[:, i:])


def upper_to_symmetric(acc: np.ndarray) -> np.ndarray:
    """The symmetric matrix whose upper triangle (diagonal included) is that of ``acc``."""
    return np.triu(acc) + np.triu(acc, 1).T
