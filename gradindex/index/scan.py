"""Exhaustive scans of row codes with FAISS's SIMD scalar-quantizer kernels, over codes FAISS does not own.

The store's codes (:mod:`gradindex.store.codes`) map onto FAISS scalar quantizers exactly:

* ``int4`` (``c`` in ``1..15`` offset by 8, two a byte, element ``2j`` in the low nibble): FAISS's
  ``QT_4bit_uniform`` with ``vmin = -8.5, vdiff = 15`` decodes nibble ``c`` as ``vmin + (c + ½)/15 ·
  vdiff = c - 8``, with the same nibble order;
* ``int8`` (two's-complement ``-127..127``): ``QT_8bit_direct_signed`` decodes byte ``b`` as
  ``b - 128``, so the codes are handed over as ``c XOR 0x80``. Its distance kernel rounds the query
  to integers too: the query is scaled to ``max|u| = 127`` first (:data:`QUERY_LEVELS`) and the
  scores scaled back, which keeps its rounding ~1e-4 of a score;
* ``fp16``: ``QT_fp16``; ``fp32``: a BLAS product (the store's floats are the vectors).

Per-row scales multiply the scores afterwards. A scan copies a block of codes into a scratch index
(``add_sa_codes``), asks for every row's score (``search`` with ``k`` = the block) and empties it, so
nothing is held beyond a block; the scores equal ``decode(codes, scales) @ u`` to float32 rounding.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import faiss
import numpy as np

from gradindex.store.codes import check_storage, codec, decode

QUERY_LEVELS = 127.0
"""The int8 kernels round the query to integers: it is scaled to this largest magnitude first."""


def level_factor(u: np.ndarray) -> np.ndarray:
    """``[Q]`` per-row factor that scales rows ``u`` ``[Q, dim]`` to ``max|u| = 127`` (1 for a zero row)."""
    top = np.abs(u).max(axis=1)
    return np.where(top > 0, top / QUERY_LEVELS, 1.0)


_QT = {"int4": "QT_4bit_uniform", "int8": "QT_8bit_direct_signed", "fp16": "QT_fp16"}


class CodeScanner:
    """Inner products of queries with blocks of ``dim``-wide rows coded as ``storage``."""

    def __init__(self, storage: str, dim: int):
        self.storage, self.dim = check_storage(storage), int(dim)
        self.index = None
        if storage in _QT:
            qt = getattr(faiss.ScalarQuantizer, _QT[storage])
            self.index = faiss.IndexScalarQuantizer(self.dim, qt, faiss.METRIC_INNER_PRODUCT)
            if storage == "int4":
                faiss.copy_array_to_vector(np.array([-8.5, 15.0], np.float32), self.index.sq.trained)
                self.index.is_trained = True
            else:
                self.index.train(np.zeros((1, self.dim), np.float32))

    def prepare(self, u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(query rows for the kernel [Q, dim] float32, factor [Q] to multiply their scores by)``."""
        u = np.ascontiguousarray(u, dtype=np.float32)
        if self.storage != "int8":
            return u, np.ones(len(u), np.float32)
        f = level_factor(u).astype(np.float32)
        return np.ascontiguousarray(u / f[:, None]), f

    def scores(self, codes: np.ndarray, scales: np.ndarray | None, u: np.ndarray,
               factor: np.ndarray | None = None) -> np.ndarray:
        """``[Q, n]`` float32 ``decode(codes, scales) @ u.T`` for ``u`` from :meth:`prepare` (``factor`` its factor)."""
        n = len(codes)
        if self.index is None and self.storage != "fp32":  # a code with no FAISS kernel: decoded, then BLAS
            return (u @ decode(codes, scales, self.storage, self.dim).T) * (1 if factor is None else factor[:, None])
        if self.index is None:  # fp32: the codes are the vectors
            out = u @ np.asarray(codes, np.float32).T
        else:
            c = np.ascontiguousarray(codes).view(np.uint8)
            if self.storage == "int8":
                c = c ^ np.uint8(0x80)
            self.index.add_sa_codes(c.reshape(n, -1))
            try:
                d, i = self.index.search(u, n)
            finally:
                self.index.reset()
            out = np.empty((len(u), n), np.float32)
            np.put_along_axis(out, i, d, axis=1)
        if factor is not None:
            out *= factor[:, None]
        if scales is not None:
            out *= scales[None, :]
        return out


class StoreScan:
    """Every stored row's inner product with per-layer query vectors, from the store's own codes.

    Memory: one block of codes (``block_bytes``) and the ``[Q, N]`` scores; the store stays on disk
    (read through the page cache). Exact up to float32 accumulation within a layer.
    """

    def __init__(self, rows, block_bytes: int = 32 << 20):
        self.rows, self.block_bytes = rows, int(block_bytes)
        self._scanners: list[dict[tuple[str, int], CodeScanner]] = []  # per worker (a scanner is not shareable)

    def _scanner(self, storage: str, width: int, worker: int = 0) -> CodeScanner:
        while len(self._scanners) <= worker:
            self._scanners.append({})
        mine = self._scanners[worker]
        if (storage, width) not in mine:
            mine[storage, width] = CodeScanner(storage, width)
        return mine[storage, width]

    def scores(self, u: dict[str, np.ndarray], layers: list[str]) -> np.ndarray:
        """``[Q, N]`` float64 ``Σ_l ⟨u_l, t_l⟩`` over ``layers`` for every stored row ``t``.

        Fewer queries than threads (FAISS's kernels share out queries, not rows): the layers are shared out
        among threads instead (the kernels release the GIL), each summing its own layers; the SmolLM2 store
        scan of 1,000 rows, 210 layers: 0.39 s on one thread."""
        Q = len(next(iter(u.values())))
        workers = min(faiss.omp_get_max_threads(), len(layers))
        if Q >= workers or workers < 2:
            return self._scores(u, layers)
        with ThreadPoolExecutor(workers) as pool:
            parts = list(pool.map(lambda i: self._scores(u, layers[i::workers], i), range(workers)))
        return np.sum(parts, axis=0)

    def _scores(self, u: dict[str, np.ndarray], layers: list[str], worker: int = 0) -> np.ndarray:
        Q = len(next(iter(u.values())))
        out = np.zeros((Q, len(self.rows.store)), np.float64)
        part = np.zeros((Q, len(self.rows.store)), np.float32)
        for n in layers:
            part[:] = 0.0
            blocks = self.rows.code_blocks(n, self.block_bytes)
            first = next(blocks, None)
            if first is None:
                continue
            s, codes, scales, storage = first
            width = codes.shape[1] * codec(storage).per_code
            un = np.asarray(u[n], np.float32)
            if un.shape[1] < width:  # an odd int4 row pads with the zero code
                un = np.concatenate([un, np.zeros((Q, width - un.shape[1]), np.float32)], axis=1)
            sc = self._scanner(storage, width, worker)
            uq, f = sc.prepare(un)
            part[:, s:s + len(codes)] += sc.scores(codes, scales, uq, f)
            for s, codes, scales, _ in blocks:
                part[:, s:s + len(codes)] += sc.scores(codes, scales, uq, f)
            out += part
        return out
