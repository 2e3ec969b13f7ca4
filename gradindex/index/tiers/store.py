"""The ``store`` tier: exhaustive. Every query scans the store's own codes (:mod:`gradindex.index.scan`); the
build writes nothing but ``norms.npy``, the scores are exact, the cost grows as ``N × numbers``."""

from __future__ import annotations

from gradindex.index.cost import SCAN_NS, STORE_SCAN_RAM_SHARE, STORE_SCAN_SECONDS, LookupCost
from gradindex.index.scan import StoreScan
from gradindex.index.space import IndexSpace
from gradindex.index.tiers.base import (
    CandidateRequest,
    Candidates,
    RowShape,
    Tier,
    TierSource,
    register_tier,
    top_and_bottom,
    with_factors,
)
from gradindex.store.codes import row_bytes


@register_tier
class StoreTier(Tier):
    """Queries scan the stored rows as they are (so only in the raw space); ``auto``'s first choice while one scan
    is estimated at most :data:`~gradindex.index.cost.STORE_SCAN_SECONDS` and the store fits
    :data:`~gradindex.index.cost.STORE_SCAN_RAM_SHARE` of RAM (the page cache keeps it)."""

    name = "store"
    auto_order = 0
    exhaustive = True

    def suits(self, rows: RowShape, space: IndexSpace, ram_bytes: int) -> bool:
        scan = self.cost(rows)
        codes = rows.n * row_bytes(rows.storage, rows.numbers)  # (the rows' codes; their scales aside)
        fits = ram_bytes <= 0 or codes <= STORE_SCAN_RAM_SHARE * ram_bytes
        return _raw(space) and scan.seconds <= STORE_SCAN_SECONDS and fits

    def check_space(self, space: IndexSpace) -> None:
        if not _raw(space):
            raise ValueError("--index-type store scans the stored rows as they are, so it cannot hold whitened or "
                             "normalized vectors; use --index-type sketch (or a FAISS type) with --whiten/--normalize")

    def cost(self, rows: RowShape, candidates: int | None = None) -> LookupCost:
        n = rows.n
        norms = 4 * n * rows.layers
        secs = n * rows.numbers * SCAN_NS.get(rows.storage, SCAN_NS["fp32"]) * 1e-9
        return LookupCost(self.name, secs, norms, norms, n * rows.row_bytes)

    @classmethod
    def describe(cls, meta: dict) -> str:
        return "store (exhaustive scan of the store's codes)"

    def open(self, source: TierSource) -> None:
        self._scan: StoreScan | None = None

    def scan(self) -> StoreScan:
        """The exhaustive scan of the store's codes (made at first use: it needs the store's row reader)."""
        if self._scan is None:
            self._scan = StoreScan(self.source.reader())
        return self._scan

    def candidates(self, req: CandidateRequest) -> Candidates:
        s = self.scan().scores(req.u, list(req.layers))  # [Q, N] float64
        s = with_factors(self.source, s, req.layers, req.cosine, req.scale)
        return Candidates.of(top_and_bottom(s, req.k, req.lowest))


def _raw(space: IndexSpace) -> bool:
    return space.whiten == "none" and not space.normalize
