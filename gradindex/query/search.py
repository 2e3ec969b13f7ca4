"""Search the per-layer indices, merge their candidates, and re-rank them exactly.

Pure functions of an :class:`~gradindex.index.IndexSet`, a row reader and the query vectors
``m`` (method space, dotted with raw stored rows) and ``u`` (index space, searched):

* when every chosen layer's index is flat, the per-layer inner products with *all* vectors are
  summed (one pass), so the candidates are the exact top and bottom of the summed score;
* otherwise each layer's index returns its approximate top ``candidates`` for ``u`` (and for
  ``-u`` when the lowest scores are asked for); those rows of that layer are scored exactly and
  the best ``shortlist`` per layer kept; the union over layers is the candidate set;
* the candidates' stored rows are read in one sorted pass and scored exactly (float64):
  ``score = Σ_l ⟨m_l, t_l⟩``, divided by ``‖t‖`` over the chosen layers for cosine, and by
  ``sqrt`` of the self-influence for the ``-selfnorm`` methods.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gradindex.index import IndexSet, RowReader

DEFAULT_CANDIDATES = 2000
"""ANN results per layer (queries' ``candidates``)."""
DEFAULT_SHORTLIST = 100
"""Of those, kept per layer after exact per-layer scoring (queries' ``shortlist``)."""
EXHAUSTIVE_MARGIN = 16
"""Extra candidates taken from exhaustive (float32) scores before the float64 re-rank."""
EXACT_SHARE = 0.25
"""When a query asks for at least this share of the examples, approximate layers are not searched:
every example is scored exactly, streaming the store (an IVF search at the default ``nprobe``
returned 289-511 of 512 rows for ``k = 512``); so is a query the ANN search found too few for."""


def coded_shortlist(k: int) -> int:
    """Examples re-ranked exactly after an exhaustive scan of scalar codes (``SQ4``...): ``max(3k, 30)``.

    On the demo's default index (int4 eigenbasis rows, 1,107 examples, 13 queries) the exact top 10
    was always within the codes' top 13."""
    return max(3 * k, 30)


def dots(t: np.ndarray, m: np.ndarray) -> np.ndarray:
    """``[C, Q]`` float64 ``t @ m.T`` for rows ``t`` ``[C, D]`` and queries ``m`` ``[Q, D]``.

    A few queries go through ``einsum``: at this size BLAS threads cost more than they save
    (10x on a busy 2-core machine); batches go through BLAS.
    """
    if len(m) <= 4:
        return np.einsum("cd,qd->cq", t, m, dtype=np.float64)
    return t.astype(np.float64) @ m.T


@dataclass
class Ranked:
    """One query's re-ranked results: ids best first, their scores and per-layer scores."""

    ids: np.ndarray
    scores: np.ndarray
    layer_scores: np.ndarray
    """``[len(ids), L]`` per-layer contributions (they sum to ``scores``)."""


def exhaustive_candidates(indices: IndexSet, layers: Sequence[str], u: dict[str, np.ndarray], cosine: bool,
                          n_top: int, n_low: int, scale: np.ndarray | None = None) -> list[np.ndarray]:
    """Per query, the ids of the exact top ``n_top`` and bottom ``n_low`` summed scores.

    ``scale`` ``[N]``: a per-example factor of the score (self-normalization), if any. Layers
    of a ``store`` index are scored by scanning the store's codes, flat or coded FAISS layers
    from their vectors.
    """
    s = None
    for n in layers:
        if indices.layers[n].tier is not None:
            continue
        part = indices.layers[n].scores(u[n])  # [Q, N]
        s = part.astype(np.float64) if s is None else s + part
    tiered = [n for n in layers if indices.layers[n].tier is not None]
    if tiered:
        part = indices.store_scan().scores(u, tiered)  # [Q, N] float64
        s = part if s is None else s + part
    return top_and_bottom(with_factors(indices, s, layers, cosine, scale), n_top, n_low)


def sketch_candidates(indices: IndexSet, layers: Sequence[str], u: dict[str, np.ndarray], cosine: bool,
                      n_top: int, n_low: int, scale: np.ndarray | None = None) -> list[np.ndarray]:
    """The first tier of a ``sketch`` index: per query, the ids of the top ``n_top`` (and bottom
    ``n_low``) sketch estimates of the summed score over ``layers`` (the other layers' parts of
    the query sketch are zero), with the same per-example factors as the exact score."""
    yq = indices.sketch.sketch.apply(u, list(layers))  # [Q, m]
    s = indices.sketch.scores(yq).astype(np.float64)  # [Q, N]
    return top_and_bottom(with_factors(indices, s, layers, cosine, scale), n_top, n_low, margin=0)


def with_factors(indices: IndexSet, s: np.ndarray, layers: Sequence[str], cosine: bool,
                 scale: np.ndarray | None) -> np.ndarray:
    """Index-space scores ``s`` ``[Q, N]`` times the per-example factors of the method: the norms a
    normalized index divided by, ``1/‖t‖`` for cosine, ``scale``."""
    if indices.space.normalize:
        s *= indices.norms()[None, :]
    if cosine:
        t = indices.norms(layers)
        s = np.where(t > 0, s / np.where(t > 0, t, 1.0), 0.0)
    if scale is not None:
        s *= scale[None, :]
    return s


def top_and_bottom(s: np.ndarray, n_top: int, n_low: int, margin: int = EXHAUSTIVE_MARGIN) -> list[np.ndarray]:
    """Per row of summed scores ``s`` ``[Q, N]``, the ids of its top ``n_top`` and bottom ``n_low``
    (each with ``margin`` more, :data:`EXHAUSTIVE_MARGIN` by default, for the float64 re-rank to settle)."""
    N = s.shape[1]
    out = []
    for row in s:
        parts = []
        if n_top:
            kk = min(N, n_top + margin)
            parts.append(np.argpartition(-row, kk - 1)[:kk] if kk < N else np.arange(N))
        if n_low:
            kk = min(N, n_low + margin)
            parts.append(np.argpartition(row, kk - 1)[:kk] if kk < N else np.arange(N))
        out.append(np.unique(np.concatenate(parts)))
    return out


def ann_candidates(indices: IndexSet, rows: RowReader, layers: Sequence[str], u: dict[str, np.ndarray],
                   m: dict[str, np.ndarray], n_top: int, n_low: int, shortlist: int,
                   params: dict[str, int] | None, scale: np.ndarray | None = None) -> list[np.ndarray]:
    """Per query, the union over layers of each layer's shortlist.

    Each layer's index returns its approximate top ``n_top`` ids for ``u_l`` (and bottom
    ``n_low``, searched with ``-u_l``). Those rows of that layer are read and scored exactly
    (``⟨m_l, t_l⟩``, times ``scale``), and the best ``shortlist`` of them stay: the union is then
    as good as an exact per-layer search to that depth, which the codes alone are not.
    """
    Q = len(next(iter(u.values())))
    found: list[list[np.ndarray]] = [[] for _ in range(Q)]
    for n in layers:
        li = indices.layers[n]
        for sign, kk in ((1.0, n_top), (-1.0, n_low)):
            if not kk:
                continue
            ids = li.search(sign * u[n], min(kk, indices.n), params)  # [Q, kk]
            if shortlist >= ids.shape[1]:
                found = [f + [row[row >= 0]] for f, row in zip(found, ids, strict=True)]
                continue
            uniq = np.unique(ids[ids >= 0])
            contrib = dots(rows.read(uniq, [n])[n], m[n])  # [A, Q]
            if scale is not None:
                contrib *= scale[uniq][:, None]
            for j, row in enumerate(ids):
                row = row[row >= 0]
                sc = sign * contrib[np.searchsorted(uniq, row), j]
                found[j].append(row[np.argsort(-sc, kind="stable")[:shortlist]])
    return [np.unique(np.concatenate(f)) for f in found]


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
