"""The index tiers as the CLI's ``--index-type`` help lists them, without importing them.

The tier modules load numpy, torch and FAISS, which ``gradindex build --help`` must not (tests/test_cli_startup.py),
so the package's tiers are written here (tests/test_cli_tiers.py checks them against the registry,
:data:`gradindex.index.tiers.base.TIERS`). Where the registry is loaded already (a tier registered by the caller's
own code), it is the list: a tier not written here is described by its ``help``, else its docstring's first line.
"""

from __future__ import annotations

import sys
from typing import NamedTuple


class TierInfo(NamedTuple):
    """What the help says of one registered tier."""

    name: str
    auto_order: float | None
    catch_all: bool
    help: str

    def sort_key(self) -> tuple:
        return self.catch_all, self.auto_order is None, self.auto_order or 0.0, self.name


PACKAGE_TIERS = {t.name: t for t in (
    TierInfo("store", 0, False, "queries scan the store's own codes (exhaustive, exact, no copy); auto's first "
             "choice while one scan is estimated under 0.5 s and the store fits a quarter of RAM"),
    TierInfo("ivf-sketch", 0.5, False, "the sketch's codes in FAISS IVF lists (IVF{nlist},sketch; ivf-sketch: 4 "
             "sqrt(N) lists), a query scores the nprobe nearest (chosen at build for 0.95 of the exhaustive default's "
             "top 10 on held-out queries), then the exact re-rank; auto's choice where the exhaustive sketch scan is "
             "estimated over 0.5 s (~1.6 million examples)"),
    TierInfo("sketch", 1, False, "two tiers: an in-RAM sketch of each example's whole-model row ranks everything, "
             "its top --candidates are re-ranked exactly"),
    TierInfo("faiss", 2, True, "per-layer FAISS indices of a factory string (Flat, IVF1024,PQ64, SQ4, HNSW32, ...): "
             "any string no other tier takes; auto's choice with --whiten/--normalize (the per-layer default)"),
)}
"""The package's tiers (``gradindex/index/tiers/``): name, ``auto_order``, ``catch_all`` and the CLI's words."""


def declared_tiers() -> dict[str, TierInfo]:
    """The package's tiers (:data:`PACKAGE_TIERS`)."""
    return dict(PACKAGE_TIERS)


def registered_tiers() -> list[TierInfo]:
    """Every registered tier, in ``auto``'s order (catch-all last): the registry's where it is loaded, else the
    package's."""
    base = sys.modules.get("gradindex.index.tiers.base")
    if base is None or "gradindex.index.tiers" not in sys.modules:
        return sorted(PACKAGE_TIERS.values(), key=TierInfo.sort_key)
    return sorted((PACKAGE_TIERS.get(n) or TierInfo(n, c.auto_order, c.catch_all, getattr(c, "help", "") or _doc(c))
                   for n, c in base.TIERS.items()), key=TierInfo.sort_key)


def _doc(cls) -> str:
    """A class docstring's first sentence, its first letter lower-cased as in the help's other entries."""
    text = " ".join((cls.__doc__ or "").replace("``", "").split()).split(". ")[0].rstrip(".")
    return text[:1].lower() + text[1:] if text[1:2].islower() else text


def index_type_help() -> str:
    """``--index-type``'s help: each registered tier in words, then what ``auto`` does."""
    tiers = registered_tiers()
    each = "; ".join(f"{t.name}{' (catch-all)' if t.catch_all else ''}: {t.help}" for t in tiers)
    order = ", ".join(t.name for t in tiers if t.auto_order is not None)
    return (f"The index tier, one of those registered (gradindex.index.tiers). {each}. auto: the first of {order} "
            "that suits the rows and the space.")
