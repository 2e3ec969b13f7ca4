"""The sketch tier's files: built from the store in one resumable pass, loaded into RAM for search.

``faiss/sketch.codes.npy`` (uint8 ``[N, m]``, FAISS's direct-signed layout ``code + 128``) and
``faiss/sketch.scales.npy`` (float32 ``[N]``) hold every example's sketch
(:mod:`gradindex.index.sketch`); ``index.json``'s ``sketch`` entry holds its spec (seed, layer
widths and parts), the files and, while building, the rows done. A killed build resumes from the
rows of the last checkpoint (written every ``checkpoint_seconds``); the part allocation is fixed
at the start from a seeded sample of rows, so a resumed build sketches the same way.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from gradindex.checksum import record
from gradindex.errors import CorruptFileError
from gradindex.index.config import IndexConfig
from gradindex.index.files import META, write_json
from gradindex.index.sketch import Sketch, SketchIndex, allocate, encode_sketch
from gradindex.index.space import Preconditioners, index_vectors
from gradindex.progress import progress_bar
from gradindex.store import Store
from gradindex.store.rows import RowReader

CODES = "sketch.codes.npy"
SCALES = "sketch.scales.npy"
ENERGY_ROWS = 256
"""Rows sampled (seeded) to share the sketch among the layers by their mean squared norm."""


def sketch_files(meta: dict | None) -> list[str]:
    """The sketch's file names in an ``index.json`` (none when it has no sketch)."""
    sk = (meta or {}).get("sketch")
    return [sk["codes"], sk["scales"]] if sk else []


def _spec(store: Store, pre: Preconditioners, cfg: IndexConfig, inv: np.ndarray | None) -> Sketch:
    """The sketch: layer parts in proportion to the layers' mean squared index-space norms."""
    N = len(store)
    rows = np.sort(np.random.default_rng(cfg.seed).choice(N, size=min(N, ENERGY_ROWS), replace=False))
    x = RowReader(store, store.layers).read(rows)
    energy = {}
    for n in store.layers:
        v = index_vectors(cfg.space, pre, n, x[n], None if inv is None else inv[rows])
        energy[n] = float(np.einsum("ij,ij->", v, v, dtype=np.float64) / len(rows))
    m = max(1, cfg.sketch_bytes - 4)
    return Sketch(cfg.seed, dict(store.dims), allocate(dict(store.dims), energy, m))


def build_sketch(store: Store, pre: Preconditioners, cfg: IndexConfig, out: Path, meta: dict,
                 inv: np.ndarray | None, progress: bool) -> None:
    """Write (or finish) ``out/sketch.*`` for every stored row; ``meta['sketch']`` records it."""
    N = len(store)
    sk = meta.get("sketch")
    codes_p, scales_p = out / CODES, out / SCALES
    if sk and codes_p.exists() and scales_p.exists():
        sketch, done = Sketch.from_dict(sk["spec"]), int(sk["rows"])
        codes = np.load(codes_p, mmap_mode="r+")
        scales = np.load(scales_p, mmap_mode="r+")
        if codes.shape != (N, sketch.m) or scales.shape != (N,):
            sk = None
    if not sk or not (codes_p.exists() and scales_p.exists()):
        sketch, done = _spec(store, pre, cfg, inv), 0
        codes = np.lib.format.open_memmap(codes_p, mode="w+", dtype=np.uint8, shape=(N, sketch.m))
        scales = np.lib.format.open_memmap(scales_p, mode="w+", dtype=np.float32, shape=(N,))
    meta["sketch"] = {"spec": sketch.to_dict(), "rows": done, "codes": CODES, "scales": SCALES, "bytes": 0}
    write_json(out / META, meta)
    codes = _RowWriter(codes)  # (the codes by plain writes: a written memory map's pages count in the RSS)
    per_row = 4 * sum(store.dims.values())
    block = max(1, min(cfg.block, cfg.block_bytes // max(1, per_row)))
    bar = progress_bar(total=N, initial=done, unit="ex", desc="sketch", disable=not progress)
    last = time.perf_counter()
    try:
        for ids, x in store.iter_blocks(store.layers, block, done):
            s = int(ids[0])
            v = {n: index_vectors(cfg.space, pre, n, x[n], None if inv is None else inv[s:s + len(ids)])
                 for n in store.layers}
            codes[s], scales[s:s + len(ids)] = encode_sketch(sketch.apply(v))
            bar.update(len(ids))
            if time.perf_counter() - last >= cfg.checkpoint_seconds:
                _checkpoint(codes, scales, out, meta, s + len(ids))
                last = time.perf_counter()
        _checkpoint(codes, scales, out, meta, N)
    finally:
        bar.close()
        codes.close()
    del scales
    record(out.parent, [codes_p, scales_p], [f"{out.name}/{CODES}", f"{out.name}/{SCALES}"])
    meta["sketch"]["bytes"] = int(codes_p.stat().st_size + scales_p.stat().st_size)
    write_json(out / META, meta)


class _RowWriter:
    """Rows of a ``.npy`` memory map's file written with ``os.pwrite`` from row ``s`` on (``w[s] = rows``)."""

    def __init__(self, mm: np.memmap):
        self.path, self.offset, self.row = mm.filename, int(mm.offset), int(mm.shape[1] * mm.dtype.itemsize)
        del mm
        self.fd = os.open(self.path, os.O_WRONLY)

    def __setitem__(self, s: int, rows: np.ndarray) -> None:
        data = np.ascontiguousarray(rows).view(np.uint8).reshape(-1)
        at, done = self.offset + s * self.row, 0
        while done < len(data):
            done += os.pwrite(self.fd, memoryview(data[done:]), at + done)

    def flush(self) -> None:
        os.fsync(self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _checkpoint(codes: _RowWriter, scales: np.ndarray, out: Path, meta: dict, rows: int) -> None:
    codes.flush()
    scales.flush()
    meta["sketch"]["rows"] = int(rows)
    write_json(out / META, meta)


def load_sketch(folder: Path, meta: dict, n: int) -> SketchIndex:
    """The sketch tier of a complete ``index.json``, its codes copied into a FAISS index in RAM."""
    sk = meta["sketch"]
    sketch = Sketch.from_dict(sk["spec"])
    codes = np.load(Path(folder) / sk["codes"], mmap_mode="r")
    scales = np.load(Path(folder) / sk["scales"])
    if codes.shape != (n, sketch.m) or scales.shape != (n,):
        raise CorruptFileError(f"the sketch in {str(folder)!r} holds {codes.shape} codes, expected ({n}, {sketch.m})")
    return SketchIndex(sketch, codes, scales)
