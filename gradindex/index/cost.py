"""What a lookup costs: the measured per-number costs the tiers' estimates are made of (:meth:`Tier.cost
<gradindex.index.tiers.Tier.cost>`; the ``store`` and ``sketch`` tiers, docs/query.md), and :class:`LookupCost`.

The per-number costs are the scan kernels timed on one core of this project's 2-core machine
(AVX-512); ``benchmarks/lookup.py`` records each estimate beside the measured latency
(``benchmarks/results/lookup-*.json``; on a loaded machine the measurements run several-fold
over). A plan (``gradindex plan``) can quote them.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass

SCAN_NS = {"int4": 0.55, "int8": 0.15, "fp16": 0.5, "fp32": 0.35}
"""Seconds × 1e9 per stored number per query of a store scan (FAISS kernels; fp32: BLAS)."""
SKETCH_NS = 0.15
"""Seconds × 1e9 per sketch number per query (every row's score by the int8 matrix product, then the
top ``C``): between the product alone (0.05 at load 3.5) and product plus selection at load 5 (0.24,
``benchmarks/results/sketch_scan.json``), one thread."""
ROW_READ_S = 20e-6
"""Seconds per re-ranked row read from the page cache, plus its bytes at :data:`READ_BYTES_S`."""
READ_BYTES_S = 2e9
"""Bytes per second read (page cache) for the re-rank and the store scan."""
STORE_SCAN_SECONDS = 0.5
"""``auto`` scans the store while one query's scan is estimated at most this long ..."""
STORE_SCAN_RAM_SHARE = 0.25
"""... and the store fits in this share of the machine's memory (the page cache keeps it)."""
DEFAULT_CANDIDATES = 500
"""The fewest examples the sketch tier hands to the exact re-rank (``C``; :func:`sketch_candidates`)."""
CANDIDATE_SHARE = 1e-3
"""... and the share of ``N`` it hands on beyond that: a row's sketch estimate errs by a spread that does not
shrink with ``N``, so the rows that can outrank a true top-10 row grow in proportion to ``N``. On real default
rows (``benchmarks/results/lookup-scale.json``) the first tier's top C held 0.94 / 0.975 of the exact top 10 at
C = 200 / 500 over 10^5 examples, and 0.885 / 0.94 / 0.98 / 0.99 at C = 200 / 500 / 1,000 / 2,000 over 10^6,
each extra candidate costing one row read (~0.1 ms on that model)."""


def sketch_candidates(n: int) -> int:
    """``C`` for ``n`` examples: ``max(DEFAULT_CANDIDATES, ⌈n × CANDIDATE_SHARE⌉)``, at most ``n``."""
    return int(min(n, max(DEFAULT_CANDIDATES, math.ceil(n * CANDIDATE_SHARE))))


@dataclass(frozen=True)
class LookupCost:
    """Estimated cost of one query (seconds exclude the query's own forward/backward)."""

    kind: str
    seconds: float
    ram_bytes: int
    """Memory the open index holds for search (the sketch; norms)."""
    index_bytes: int
    """Bytes the index stage writes (beyond the store)."""
    scanned_bytes: int
    """Bytes read per query."""

    def to_dict(self) -> dict:
        return asdict(self)


def memory_bytes() -> int:
    """Physical memory of this machine (0 when unknown)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0
