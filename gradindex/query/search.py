"""The exact re-rank: each query's candidates (from the index's tier, :meth:`gradindex.index.IndexSet.candidates`)
read from the store in one sorted pass and scored exactly (float64): ``score = Σ_l ⟨m_l, t_l⟩``, divided by ``‖t‖``
over the chosen layers for cosine, and by ``sqrt`` of the self-influence for the ``-selfnorm`` methods.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gradindex.index import RowReader
from gradindex.index.tiers.base import dots, top_and_bottom

__all__ = ["Ranked", "dots", "rerank", "top_and_bottom"]

@dataclass
class Ranked:
    """One query's re-ranked results: ids best first, their scores and per-layer scores."""

    ids: np.ndarray
    scores: np.ndarray
    layer_scores: np.ndarray
    """``[len(ids), L]`` per-layer contributions (they sum to ``scores``)."""


def rerank(rows: RowReader, layers: Sequence[str], m: dict[str, np.ndarray], cosine: bool,
           candidates: list[np.ndarray], k: int, k_low: int,
           scale: np.ndarray | None = None) -> list[tuple[Ranked, Ranked]]:
    """Exact scores of each query's candidates; its top ``k`` and bottom ``k_low``."""
    allc = np.unique(np.concatenate(candidates))
    t = rows.read(allc, layers)  # {layer: [C, D]}
    per_layer = np.stack([dots(t[n], m[n]) for n in layers], axis=-1)  # [C, Q, L]
    if cosine:
        tn = np.sqrt(sum(np.einsum("ij,ij->i", t[n], t[n], dtype=np.float64) for n in layers))  # [C]
        per_layer *= np.where(tn > 0, 1.0 / np.where(tn > 0, tn, 1.0), 0.0)[:, None, None]
    if scale is not None:
        per_layer *= scale[allc][:, None, None]
    out = []
    for j, cand in enumerate(candidates):
        pos = np.searchsorted(allc, cand)
        ls = per_layer[pos, j]  # [c, L]
        sc = ls.sum(axis=1)
        best = np.lexsort((cand, -sc))[:k]
        worst = np.lexsort((cand, sc))[:k_low]
        out.append((Ranked(cand[best], sc[best], ls[best]), Ranked(cand[worst], sc[worst], ls[worst])))
    return out
