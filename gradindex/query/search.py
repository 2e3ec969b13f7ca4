"""The first stage: query rows preconditioned into the index's space, each query's candidates from the index's tier
(:meth:`gradindex.index.IndexSet.candidates`), then the exact re-rank, read from the store in one sorted pass and
scored exactly (float64): ``score = Σ_l ⟨m_l, t_l⟩``, divided by ``‖t‖`` over the chosen layers for cosine, and by
``sqrt`` of the self-influence for the ``-selfnorm`` methods; the results a query answers.
"""

from __future__ import annotations

import fnmatch
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from gradindex.index import IndexSet, OpenIndex, RowReader, query_vectors
from gradindex.index.tiers import CandidateRequest
from gradindex.index.tiers.base import dots, top_and_bottom
from gradindex.query.defaults import Answer
from gradindex.query.scores import score_matrix

__all__ = ["Hit", "QueryResult", "Ranked", "dots", "first_stage", "rerank", "top_and_bottom"]
log = logging.getLogger("gradindex")


@dataclass
class Hit:
    """One training example in a result."""

    id: int
    """Row of the example in the training data (0-based)."""
    score: float
    """Exact score under the query's method, summed over the chosen layers."""
    layer_scores: dict[str, float]
    """Each layer's contribution to ``score``."""
    text: str | None = None
    """The training text (``None`` when the data file is unavailable or changed)."""
    full_score: float | None = None
    """Score from full (unprojected) gradients, when re-ranked with them."""

    def to_dict(self) -> dict:
        d = {"id": self.id, "score": self.score, "text": self.text, "layer_scores": self.layer_scores}
        if self.full_score is not None:
            d["full_score"] = self.full_score
        return d


@dataclass
class QueryResult:
    """The answer to one query: most influential examples first, and optionally the lowest."""

    hits: list[Hit]
    lowest: list[Hit]
    method: str
    damping: float | None
    layers: list[str]
    num_tokens: int | None = None
    loss: float | None = None
    truncated: bool = False
    notes: list[str] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    stage: str = ""
    """Which stage produced the scores of :attr:`hits`: ``index rows`` (exact on the stored rows, which
    hold the whole gradient), ``first stage`` (the stored rows are a budget-bound projection) or
    ``full-space re-rank of the top C`` (:attr:`Hit.full_score`; docs/query.md, "Two stages")."""
    reranked: int = 0
    """Candidates re-scored in full space (0: none)."""

    def to_dict(self) -> dict:
        return {"hits": [h.to_dict() for h in self.hits], "lowest": [h.to_dict() for h in self.lowest],
                "method": self.method, "damping": self.damping, "layers": self.layers,
                "num_tokens": self.num_tokens, "loss": self.loss, "truncated": self.truncated,
                "notes": self.notes, "seconds": self.seconds, "stage": self.stage, "reranked": self.reranked}



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


def _hits(r: Ranked, layers: list[str]) -> list[Hit]:
    return [Hit(int(i), float(s), {n: float(v) for n, v in zip(layers, ls, strict=True)})
            for i, s, ls in zip(r.ids, r.scores, r.layer_scores, strict=True)]


def select_layers(have: list[str], patterns: Sequence[str] | str | None, index_dir) -> list[str]:
    """The layers of ``have`` matching glob ``patterns`` (all when ``None``), in their order."""
    if not patterns:
        return have
    patterns = [patterns] if isinstance(patterns, str) else list(patterns)
    out = [n for n in have if any(fnmatch.fnmatchcase(n, p) for p in patterns)]
    idle = [p for p in patterns if not any(fnmatch.fnmatchcase(n, p) for n in have)]
    if idle:  # (each pattern: a typo in one of several would go unnoticed)
        which = f"layer patterns {patterns} match" if not out else f"layer pattern {idle[0]!r} matches"
        raise ValueError(f"{which} no indexed layer; layers look like {have[:2]} ({len(have)} in all, see "
                         f"`gradindex info {index_dir}`)")
    return out


def check_rows(grads, layers: list[str]) -> list[str]:
    """``layers``, each with query rows in ``grads`` (else a ValueError)."""
    missing = [n for n in layers if n not in grads]
    if missing:
        raise ValueError(f"query gradients lack layers {missing[:3]}; pass rows for every chosen layer")
    return layers


def clamp_k(k: int, lowest: int, n: int, notes: list[str]) -> tuple[int, int]:
    """``k`` and ``lowest`` checked, and at most the index's ``n`` examples (saying so in ``notes``)."""
    if k < 1 or lowest < 0:
        raise ValueError(f"k must be >= 1 and lowest >= 0, got k={k}, lowest={lowest}")
    if k > n or lowest > n:
        asked = " and ".join(f"{name}={v}" for name, v in (("k", k), ("lowest", lowest)) if v > n)
        notes.append(f"{asked} is larger than the index ({n} examples); returning {n}")
        log.info(notes[-1])
    return min(k, n), min(lowest, n)


def first_stage(ix: OpenIndex, tier: IndexSet, rows: RowReader, q: dict[str, torch.Tensor], layers: list[str],
                answer: Answer, damping: float, k: int, lowest: int, knobs: tuple, t0: float) -> list[QueryResult]:
    """Each query's best ``k`` and lowest ``lowest`` for rows ``q`` ``{layer: [Q, D]}`` as ``answer`` says: candidates
    from the tier (``knobs``: candidates, shortlist, nprobe), re-ranked exactly (``t0``: when the call began)."""
    m, u, _ = query_vectors(tier.space, ix.pre, answer.base, damping, q)
    t1 = time.perf_counter()
    cosine = answer.base == "cosine"

    def exact(pos: list[int]) -> list[np.ndarray]:  # an approximate tier's fallback: every example scored
        scores = score_matrix(ix, {n: v[pos] for n, v in q.items()}, answer.method, damping, layers)
        return top_and_bottom(scores, k, lowest)  # (streamed from the store, memory: a block)

    found = tier.candidates(CandidateRequest(layers, u, m, k, lowest, cosine, answer.scale, *knobs, exact))
    t2 = time.perf_counter()
    ranked = rerank(rows, layers, m, cosine, found.ids, k, lowest, answer.scale)
    t3 = time.perf_counter()
    out = []
    for (top, low), widened in zip(ranked, found.widened, strict=True):
        res = QueryResult(_hits(top, layers), _hits(low, layers), answer.method, answer.used, layers,
                          notes=answer.notes + found.notes)
        if widened:
            res.notes.append(f"the approximate search found fewer than {max(k, lowest)} candidates; every example "
                             "was scored exactly instead")
        res.seconds = {"precondition": t1 - t0, "search": t2 - t1, "rerank": t3 - t2}
        out.append(res)
    return out
