"""Index tiers behind one interface (:class:`Tier`), in one registry, chosen by one factory string.

The built-in tiers register here, in the order ``auto`` tries them: ``store`` (a scan of the stored codes),
``ivf-sketch`` (the sketch's codes in inverted lists, a few searched: for millions of examples), ``sketch`` (an
in-RAM first stage, then an exact re-rank) and FAISS (per-layer indices, every other factory string).
A new tier is one module: a :class:`Tier` subclass passed to :func:`register_tier` (docs/extending.md).
"""

from __future__ import annotations

from gradindex.index.config import IndexConfig
from gradindex.index.cost import LookupCost
from gradindex.index.sketch import SKETCH_BYTES
from gradindex.index.tiers import faiss, ivf_sketch, sketch, store  # noqa: F401  (each registers its tier)
from gradindex.index.tiers.base import (
    TIERS,
    BuildJob,
    CandidateRequest,
    Candidates,
    RowShape,
    Tier,
    TierSource,
    kind_of,
    make_tier,
    register_tier,
    tier_class,
    tier_named,
    unregister_tier,
)


def lookup_cost(n: int, numbers: int, storage: str, kind: str, layers: int = 1, sketch_bytes: int = 0,
                candidates: int | None = None) -> LookupCost | None:
    """One lookup's estimated cost over ``n`` examples of ``numbers`` stored numbers each (``storage`` codes) in
    ``layers`` layers, on the tier ``kind`` names (None: the tier has no estimate, as FAISS)."""
    cfg = IndexConfig(factory=kind, sketch_bytes=sketch_bytes or SKETCH_BYTES)
    return tier_class(kind)(kind, cfg).cost(RowShape(n, numbers, storage, layers), candidates)


def choose_kind(n: int, numbers: int, storage: str, ram_bytes: int | None = None) -> str:
    """The tier ``auto`` builds over raw rows: ``store`` while a scan is quick and the store fits the page cache,
    else ``sketch`` (:func:`make_tier`)."""
    return make_tier(IndexConfig(), RowShape(n, numbers, storage), ram_bytes).name


__all__ = ["TIERS", "BuildJob", "CandidateRequest", "Candidates", "RowShape", "Tier", "TierSource", "choose_kind",
           "kind_of", "lookup_cost", "make_tier", "register_tier", "tier_class", "tier_named", "unregister_tier"]
