"""Outliers: training examples ranked by self-influence, the influence an example has on itself.

An example the model finds hard to fit and that pulls the parameters far (a mislabeled,
corrupted or one-of-a-kind example) has a large self-influence ``⟨H⁻¹ g, g⟩``. Long examples
have large gradients just by having many target tokens, so a normalised ranking divides by the
number of target tokens too. Both come from the index's stored rows (no model pass).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gradindex.methods import DEFAULT_DAMPING, parse_method
from gradindex.precondition import self_influence
from gradindex.store.opened import OpenStore, opened

RANKINGS = ("self_influence", "per_token")


@dataclass
class OutlierRanking:
    """Every example's self-influence and its normalised variant, and the order of each."""

    method: str
    damping: float
    self_influence: np.ndarray
    """``[N]`` ``⟨(H + δI)⁻¹ g, g⟩`` summed over the chosen layers."""
    per_token: np.ndarray
    """``[N]`` self-influence divided by the example's number of target tokens (0 when none)."""
    num_tokens: np.ndarray
    loss: np.ndarray

    def order(self, by: str = "self_influence") -> np.ndarray:
        """Example ids, most self-influential first (ties by id)."""
        if by not in RANKINGS:
            raise ValueError(f"ranking {by!r} is not one of {RANKINGS}")
        v = getattr(self, by)
        return np.lexsort((np.arange(len(v)), -v))

    def top(self, n: int, by: str = "self_influence") -> list[dict]:
        ids = self.order(by)[:n]
        return [{"id": int(i), "self_influence": float(self.self_influence[i]),
                 "per_token": float(self.per_token[i]), "num_tokens": int(self.num_tokens[i]),
                 "loss": float(self.loss[i])} for i in ids]


def rank_outliers(index_dir: str | os.PathLike | OpenStore, method: str = "ekfac",
                  damping: float = DEFAULT_DAMPING, layers: Sequence[str] | None = None) -> OutlierRanking:
    """Self-influence of every stored example under ``method`` (``graddot``, ``kfac``, ``ekfac``)."""
    base = _base(method)
    with opened(index_dir, "look for outliers") as ix:
        return _ranking(base, damping, self_influence(ix, base, damping, layers), ix.store)


def engine_outliers(engine, method: str = "ekfac", damping: float = DEFAULT_DAMPING,
                    layers: Sequence[str] | None = None) -> OutlierRanking:
    """:func:`rank_outliers` of the index a query engine answers from; over a sharded index, every part's
    self-influence from the rank that holds it (:meth:`~gradindex.query.sharded.ShardedQueryEngine.self_influence`)."""
    if getattr(engine, "sharded", None) is None:
        return rank_outliers(engine.dir, method, damping, layers)
    base = _base(method)
    return _ranking(base, damping, engine.self_influence(base, damping, engine.select_layers(layers)), engine.store)


def _base(method: str) -> str:
    base, selfnorm = parse_method(method)
    if selfnorm or base == "cosine":
        raise ValueError(f"outliers rank by self-influence, which {method!r} does not have (it is 1 "
                         "for every example); use graddot, kfac or ekfac")
    return base


def _ranking(base: str, damping: float, si: np.ndarray, store) -> OutlierRanking:
    ntok = store.column("num_tokens").astype(np.int64)
    loss = store.column("loss").astype(np.float64)
    per_tok = np.where(ntok > 0, si / np.maximum(ntok, 1), 0.0)
    return OutlierRanking(base, damping, si, per_tok, ntok, loss)


def detection_curve(order: np.ndarray, flagged: np.ndarray, fractions: Sequence[float]) -> list[float]:
    """Share of ``flagged`` examples found in the first ``f`` of ``order``, for each fraction ``f``."""
    flagged = np.asarray(flagged, dtype=bool)
    total = max(1, int(flagged.sum()))
    return [float(flagged[order[: int(round(f * len(order)))]].sum() / total) for f in fractions]
