"""Fast reads of store rows (the store owns its shard bytes): blocks of one layer, random rows for re-ranking.

The store's per-layer datasets are chunked, uncompressed codes (``gradindex/store/shards.py``:
float32, float16, int8 or packed int4). An uncompressed chunk is a dense C-order
``[chunk_rows, W]`` array at a fixed file offset, so once the chunk table is read
(``chunk_iter``), a random row is one memory-mapped slice: ~3 µs instead of the ~40 µs h5py's
point selection costs. Reads are sorted by file offset; integer codes are decoded with the rows'
scales (held in memory, 4 bytes a row). Datasets written any other way (filters) fall back to
:meth:`Store.read_rows`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence

import h5py
import numpy as np
from numpy.lib.stride_tricks import as_strided

from gradindex.store import Store
from gradindex.store.codes import code_dtype, decode, has_scale


def iter_layer(store: Store, layer: str, start: int = 0,
               block: int = 8192) -> Iterator[tuple[int, np.ndarray]]:
    """Yield ``(first_row, [n, D] float32)`` blocks of one layer from row ``start`` on."""
    for ids, grads in store.iter_blocks([layer], block, start):
        yield int(ids[0]), grads[layer]


class _Plain:
    """Chunk table of one uncompressed dataset: row → byte offset in its file."""

    def __init__(self, ds: h5py.Dataset):
        self.rows_per_chunk, self.width = ds.chunks[0], ds.shape[1]
        self.itemsize = ds.dtype.itemsize
        offsets: dict[int, int] = {}
        r = self.rows_per_chunk
        ds.id.chunk_iter(lambda ci: offsets.__setitem__(ci.chunk_offset[0] // r, ci.byte_offset))
        n_chunks = -(-ds.shape[0] // self.rows_per_chunk)
        if len(offsets) != n_chunks:
            raise ValueError("unallocated chunks")
        self.offsets = np.array([offsets[i] for i in range(n_chunks)], dtype=np.int64)

    def byte_offsets(self, local: np.ndarray) -> np.ndarray:
        return self.offsets[local // self.rows_per_chunk] + (local % self.rows_per_chunk) * (self.itemsize * self.width)


def _plain(ds: h5py.Dataset, storage: str) -> bool:
    return (ds.dtype == code_dtype(storage) and ds.chunks is not None and ds.chunks[1] == ds.shape[1]
            and not ds.compression and not ds.shuffle and not ds.fletcher32 and ds.scaleoffset is None
            and hasattr(ds.id, "chunk_iter"))


PREAD = hasattr(os, "preadv")
"""Rows are read with ``preadv`` (a copy from the page cache) where the OS has it, else gathered from a memory map,
whose page faults map the neighbouring cached pages too: over 10^6 rows the re-rank's RSS grew by GBs of store."""


def _gather(mm: np.ndarray, off: np.ndarray, width: int, dtype: np.dtype) -> np.ndarray:
    """``[len(off), width]`` rows of ``dtype`` starting at byte offsets ``off`` of a byte map."""
    size = dtype.itemsize
    if (off % size == 0).all():  # rows as windows of a typed view: one row-wise gather
        flat = mm[: (mm.size // size) * size].view(dtype)
        windows = as_strided(flat, shape=(flat.size - width + 1, width), strides=(size, size), writeable=False)
        return windows[off // size]
    return mm[off[:, None] + np.arange(size * width)].view(dtype).reshape(-1, width)


PREFETCH_ROWS = 64
"""Reads of at least this many rows first ask the kernel for all of them at once (:meth:`RowReader._prefetch`)."""


class RowReader:
    """Random rows of any layers, by store row id, in one sorted pass per shard file."""

    def __init__(self, store: Store, layers: Sequence[str] | None = None):
        self.store = store
        self.layers = list(layers or store.layers)
        self._tables: list[dict[str, _Plain]] | None = []
        self._maps: list[np.ndarray] = []
        scales: list[dict[str, np.ndarray]] = []
        storage = store.storage
        try:
            for path in store.paths:
                try:
                    with h5py.File(path, "r") as f:
                        g = f["grads"]
                        if not all(_plain(g[n], storage) for n in self.layers):
                            raise ValueError("not plain")
                        self._tables.append({n: _Plain(g[n]) for n in self.layers})
                        scales.append({n: f["scales"][n][:] for n in self.layers} if has_scale(storage) else {})
                except (OSError, RuntimeError) as e:  # h5py cannot read its own structure: a damaged file
                    raise store.damaged_error(path, e) from None
                if not PREAD:  # (the rows' fallback reader)
                    self._maps.append(np.memmap(path, dtype=np.uint8, mode="r"))
        except ValueError:
            self._tables, self._maps, scales = None, [], []
        self._scales: dict[str, np.ndarray] = {  # layer → every row's scale, by store position
            n: np.concatenate([sc[n] for sc in scales]) for n in self.layers} if scales and scales[0] else {}

    @property
    def direct(self) -> bool:
        """Whether rows are read straight from the chunks (else through h5py)."""
        return self._tables is not None

    def read(self, ids: np.ndarray, layers: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """``{layer: [len(ids), D] float32}`` for store rows ``ids`` (any order, repeats allowed).

        Vectorized over the shards the rows fall in (a re-rank's 1,000 rows of a 10^6-row store touch ~240):
        per layer one offset computation, one hash check and one decode for all rows; one ``preadv`` a row."""
        layers = list(layers or self.layers)
        ids = self.store.positions(np.asarray(ids, dtype=np.int64))
        if self._tables is None or not set(layers) <= set(self.layers) or not len(ids):
            return self.store.read_rows(ids, layers)
        starts = np.asarray(self.store.first_ids, dtype=np.int64)
        shard = np.searchsorted(starts, ids, side="right") - 1
        order = np.lexsort((ids, shard))  # by shard, then row: reads in file order
        shard, local = shard[order], ids[order] - starts[shard[order]]
        touched, first = np.unique(shard, return_index=True)
        bounds = list(zip(touched.tolist(), first.tolist(), [*first[1:].tolist(), len(shard)], strict=True))
        expected = self.store.expected_hashes(bounds, local)  # [n, L] and which rows have them, or None
        dt = code_dtype(self.store.storage)
        out = {}
        fds: dict[int, int] = {}
        try:
            if PREAD:
                fds = {k: os.open(self.store.paths[k], os.O_RDONLY) for k, _, _ in bounds}
            offsets = {n: self._offsets(n, bounds, local) for n in layers}
            if PREAD and len(ids) >= PREFETCH_ROWS:
                self._prefetch(fds, bounds, offsets)
            for n in layers:
                width = self._tables[bounds[0][0]][n].width
                rows = np.empty((len(ids), width), dt)
                for k, a, b in bounds:
                    if PREAD:
                        self._pread(k, fds[k], offsets[n][a:b], rows[a:b])
                    else:
                        rows[a:b] = _gather(self._maps[k], offsets[n][a:b], width, dt)
                scales = self._scales[n][ids[order]] if n in self._scales else None
                if expected is not None:
                    self.store.verify_gathered(bounds, local, n, rows, scales, expected)
                x = decode(rows, scales, self.store.storage, self.store.dims[n])
                out[n] = np.empty_like(x)
                out[n][order] = x
        finally:
            for fd in fds.values():
                os.close(fd)
        return out

    def _offsets(self, n: str, bounds: list[tuple[int, int, int]], local: np.ndarray) -> np.ndarray:
        """Byte offsets in their files of layer ``n``'s rows ``local`` (grouped by shard as ``bounds`` says)."""
        off = np.empty(len(local), np.int64)
        for k, a, b in bounds:
            off[a:b] = self._tables[k][n].byte_offsets(local[a:b])
        return off

    def _pread(self, k: int, fd: int, off: np.ndarray, into: np.ndarray) -> None:
        """Rows at byte offsets ``off`` of shard ``k`` (open as ``fd``) into ``into`` ``[len(off), width]``, one
        ``preadv`` a row."""
        nbytes = into.shape[1] * into.itemsize
        for i, o in enumerate(off.tolist()):
            if os.preadv(fd, [memoryview(into[i]).cast("B")], o) != nbytes:
                raise self.store.damaged_error(self.store.paths[k], OSError("short read"))

    def _prefetch(self, fds: dict[int, int], bounds: list[tuple[int, int, int]], offsets: dict[str, np.ndarray]
                  ) -> None:
        """Ask the kernel to read every wanted row now (``POSIX_FADV_WILLNEED``), so that the reads of rows
        outside the page cache overlap instead of waiting one by one (a re-rank of 1,000 rows of 8 layers from
        a cold 12.7 GB store: 8,000 random reads)."""
        if not hasattr(os, "posix_fadvise"):
            return
        try:
            for n, off in offsets.items():
                for k, a, b in bounds:
                    tab = self._tables[k][n]
                    for o in off[a:b].tolist():
                        os.posix_fadvise(fds[k], o, tab.width * tab.itemsize, os.POSIX_FADV_WILLNEED)
        except OSError:  # (advice only)
            pass

    def code_blocks(self, layer: str, max_bytes: int = 32 << 20
                    ) -> Iterator[tuple[int, np.ndarray, np.ndarray | None, str]]:
        """Yield ``(first_row, codes, scales, storage)`` blocks of one layer in store order, at most
        ``max_bytes`` of codes each: the store's own codes (memory-mapped chunks) when read directly,
        else float32 rows decoded through h5py (``storage`` ``fp32``, no scales)."""
        if self._tables is None or layer not in self.layers:
            D = self.store.dims[layer]
            for s, x in iter_layer(self.store, layer, 0, max(1, max_bytes // (4 * max(1, D)))):
                yield s, x, None, "fp32"
            return
        storage, dt = self.store.storage, code_dtype(self.store.storage)
        for k, first in enumerate(self.store.first_ids):
            tab, size = self._tables[k][layer], self.store.sizes[k]
            scales = self._scales[layer][first:first + size] if layer in self._scales else None
            row_bytes = tab.width * tab.itemsize
            per = max(tab.rows_per_chunk, (max_bytes // max(1, row_bytes)) // tab.rows_per_chunk * tab.rows_per_chunk)
            buf = np.empty(min(size, per) * row_bytes, np.uint8)
            fd = os.open(self.store.paths[k], os.O_RDONLY)
            try:
                for s in range(0, size, per):  # whole chunks with pread: a copy from the page cache, no page faults
                    e = min(size, s + per)
                    view = memoryview(buf)
                    for c in range(s // tab.rows_per_chunk, -(-e // tab.rows_per_chunk)):
                        nb = (min(e, (c + 1) * tab.rows_per_chunk) - c * tab.rows_per_chunk) * row_bytes
                        if os.preadv(fd, [view[:nb]], int(tab.offsets[c])) != nb:
                            raise self.store.damaged_error(self.store.paths[k], OSError("short read"))
                        view = view[nb:]
                    codes = buf[:(e - s) * row_bytes].view(dt).reshape(e - s, tab.width)
                    yield first + s, codes, (scales[s:e] if scales is not None else None), storage
            finally:
                os.close(fd)
