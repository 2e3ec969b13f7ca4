"""The ``sketch`` tier: two stages. An in-RAM int8 sketch of each example's whole-model row
(:mod:`gradindex.index.sketch`, ``sketch_bytes`` a row) ranks every example, then the top ``C``
(:func:`gradindex.index.cost.sketch_candidates`) are re-ranked exactly from the store: ``N × m`` numbers scanned plus
``C`` rows read. Its files: :mod:`gradindex.index.tiers.sketch_files`."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from gradindex.errors import CorruptFileError
from gradindex.index.cost import READ_BYTES_S, ROW_READ_S, SKETCH_NS, LookupCost, sketch_candidates
from gradindex.index.files import index_command
from gradindex.index.sketch import SKETCH_BYTES, SketchIndex, kernel_setting
from gradindex.index.space import IndexSpace
from gradindex.index.tiers.base import (
    BuildJob,
    CandidateRequest,
    Candidates,
    RowShape,
    Tier,
    TierSource,
    register_tier,
    top_and_bottom,
    with_factors,
)
from gradindex.index.tiers.sketch_files import build_sketch, load_sketch, sketch_files


@register_tier
class SketchTier(Tier):
    """A first stage over every example's sketch, an exact re-rank of its top ``C``; ``auto``'s choice in the raw
    space when the store scan is too slow or too large for the page cache."""

    name = "sketch"
    auto_order = 1

    def suits(self, rows: RowShape, space: IndexSpace, ram_bytes: int) -> bool:
        return space.whiten == "none" and not space.normalize

    def sketch_codes(self) -> int:
        """Code bytes of one example's sketch: ``sketch_bytes`` less its 4-byte scale (at least 1)."""
        return max(1, (self.cfg.sketch_bytes or SKETCH_BYTES) - 4)

    def cost(self, rows: RowShape, candidates: int | None = None) -> LookupCost:
        n = rows.n
        norms = 4 * n * rows.layers
        m = self.sketch_codes()
        c = min(n, candidates or sketch_candidates(n))
        secs = n * m * SKETCH_NS * 1e-9 + c * (ROW_READ_S + rows.row_bytes / READ_BYTES_S)
        held = n * (m + 4) + norms
        return LookupCost(self.name, secs, held, held, n * (m + 4) + c * rows.row_bytes)

    def key(self) -> dict:
        return {"sketch_bytes": self.cfg.sketch_bytes}

    def build(self, job: BuildJob) -> int:
        super().build(job)
        build_sketch(job.store, job.pre, job.cfg, job.out, job.meta, job.inv, job.progress, job.share)
        return 0

    @classmethod
    def files(cls, meta: dict, layers: Sequence[str] | None = None) -> list[str]:
        return sketch_files(meta)

    @classmethod
    def written_bytes(cls, meta: dict) -> int:
        return super().written_bytes(meta) + int((meta.get("sketch") or {}).get("bytes", 0))

    @classmethod
    def describe(cls, meta: dict) -> str:
        return f"sketch of {meta['sketch']['spec']['m']} int8 numbers per example"

    def open(self, source: TierSource) -> None:
        kernel_setting()  # (a wrong GRADINDEX_SKETCH_KERNEL named as such, before any code is read)
        try:
            self.sketch: SketchIndex = load_sketch(source.folder, source.meta, source.n)
        except (OSError, ValueError) as e:
            raise CorruptFileError(f"the sketch tier in {str(source.folder)!r} is unreadable ({e}); rebuild the "
                                   f"indices with `{index_command(source.index_dir)}`") from None

    def first_stage(self, req: CandidateRequest, c: int) -> list[np.ndarray]:
        """Per query, the ids of the top ``c`` (and bottom ``c`` when ``req.lowest``) sketch estimates of the summed
        score over ``req.layers`` (the other layers' parts of the query sketch are zero), with the same per-example
        factors as the exact score."""
        yq = self.sketch.sketch.apply(req.u, list(req.layers))  # [Q, m]
        s = self.sketch.scores(yq).astype(np.float64)  # [Q, N]
        s = with_factors(self.source, s, req.layers, req.cosine, req.scale)
        return top_and_bottom(s, c, c if req.lowest else 0, margin=0)

    def candidates(self, req: CandidateRequest) -> Candidates:
        c = max(req.candidates or sketch_candidates(self.source.n), req.k, req.lowest)
        return Candidates.of(self.first_stage(req, c))
