"""Rotated rows kept between the fused transcode's fit pass and its coding, so each row is rotated once.

The fit pass (:func:`gradindex.precondition.ekfac.store_pass`) rotates every stored row into the
Kronecker eigenbasis, ``R = Q_Sᵀ Ĝ Q_A``, for ``Λ*``; the transcode codes the same ``R`` scaled by
``(Λ* + δ)^{-1/2}``, which only the finished pass knows. So the pass writes ``R`` here,
``INDEX_DIR/rotated.partial/shard-NNNNN.<j>.f16`` (shard ``k``, ``j``-th layer: ``[n, D_j]`` float16,
row-major, no header), each row divided by its largest magnitude ``m`` (float32 ``[N, L]``, kept in
memory; :func:`~gradindex.store.basis.to_half`). Every other writer of such rows rounds them the same
way (:func:`~gradindex.store.basis.stored_rows`), so the index is the same with or without this copy.
The rounding, at most ``2⁻¹² m``, is ~500x finer than the int4 step (``m/7`` of the whitened row) that
codes it. The transcode reads each shard's rows back (no rotation, no decode of the store) and deletes
them once that shard is coded. Plain file reads and writes, not memory maps, so the
pages are not counted in the process's resident memory.

The files live only while one run of the fused stage runs: a killed run's are discarded and the
next run writes them again (the fit pass is recomputed anyway, :mod:`gradindex.precondition.fused`).
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from gradindex.spec import layout
from gradindex.store.basis import from_half, to_half

ROTATED_DIR = layout.TRANSCODE_ROTATED


class RotatedRows:
    """The fit pass's rotated rows of one store, written shard by shard and read back by the transcode."""

    def __init__(self, index_dir: str | Path):
        self.root = Path(index_dir) / ROTATED_DIR
        self.layers: list[str] = []
        self.dims: list[int] = []
        self.starts = np.zeros(1, np.int64)
        self.peak_bytes = 0
        self._bytes = 0
        self._written: set[tuple[int, int]] = set()

    def attach(self, sizes: Sequence[int], dims: dict[str, int], layers: Sequence[str], clear: bool = True) -> None:
        """Start a pass over a store of shards ``sizes``: discard what an earlier run left (``clear``; a build's
        ranks share the directory, each writing its own shards' files: its lead clears it before they start)."""
        if clear:
            self.discard()
        self.root.mkdir(parents=True, exist_ok=not clear)
        self.layers, self.dims = list(layers), [int(dims[n]) for n in layers]
        self.starts = np.cumsum([0, *sizes]).astype(np.int64)
        self.scale = np.zeros((int(self.starts[-1]), len(self.layers)), np.float32)  # [N, L] row maxima

    def _path(self, k: int, j: int) -> Path:
        return self.root / f"{layout.shard_name(k).removesuffix('.h5')}.{j}.f16"

    def put(self, pos: np.ndarray, layer: str, R: np.ndarray) -> None:
        """Rotated rows ``R`` ``[n, k_g·k_a]`` float32 (:func:`~gradindex.store.basis.rotate_rows`) of ``layer``
        at store positions ``pos`` (consecutive, one shard)."""
        j = self.layers.index(layer)
        k = int(np.searchsorted(self.starts, pos[0], side="right") - 1)
        h, m = to_half(R)
        self.scale[pos, j] = m
        mode = "r+b" if (k, j) in self._written else "wb"
        self._written.add((k, j))
        with open(self._path(k, j), mode) as f:
            f.seek(int(pos[0] - self.starts[k]) * self.dims[j] * 2)
            h.tofile(f)
        self._bytes += h.nbytes
        self.peak_bytes = max(self.peak_bytes, self._bytes)

    def get(self, k: int, layer: str, s: int, e: int) -> np.ndarray:
        """Shard ``k``'s rows ``s:e`` (shard-local) of ``layer``: ``R`` as float32 ``[e-s, D_j]``."""
        j = self.layers.index(layer)
        d = self.dims[j]
        with open(self._path(k, j), "rb") as f:
            f.seek(s * d * 2)
            h = np.fromfile(f, np.float16, (e - s) * d).reshape(e - s, d)
        first = int(self.starts[k])
        return from_half(h, self.scale[first + s:first + e, j])

    def drop(self, k: int) -> None:
        """Shard ``k`` is coded: delete its rows."""
        for j in range(len(self.layers)):
            p = self._path(k, j)
            if p.exists():
                self._bytes -= p.stat().st_size
                p.unlink()

    def discard(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
        self._written.clear()
        self._bytes = 0
