"""The sketch tier's files: built from the store in one resumable pass, loaded into RAM for search.

``faiss/sketch.codes.npy`` (uint8 ``[N, m]``, FAISS's direct-signed layout ``code + 128``) and
``faiss/sketch.scales.npy`` (float32 ``[N]``) hold every example's sketch
(:mod:`gradindex.index.sketch`); ``index.json``'s ``sketch`` entry holds its spec (seed, layer
widths and parts), the files and, while building, the rows done. A killed build resumes from the
store file of the last checkpoint (written every ``checkpoint_seconds``, at a file's end); the part allocation is
fixed at the start from a seeded sample of rows, so a resumed build sketches the same way. Under torchrun each rank
encodes its own store files and rank 0 writes them (:func:`encode_files`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from gradindex.checksum import record
from gradindex.distributed import SOLO, Share, Team
from gradindex.errors import CorruptFileError
from gradindex.index.config import IndexConfig
from gradindex.index.files import META, write_json
from gradindex.index.sketch import Sketch, SketchIndex, allocate, encode_sketch
from gradindex.index.space import IndexSpace, Preconditioners, index_vectors
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
                 inv: np.ndarray | None, progress: bool, share: Share | None = None) -> None:
    """Write (or finish) ``out/sketch.*`` for every stored row; ``meta['sketch']`` records it. ``share``: a
    torchrun build's ranks each encode their own store files (:func:`encode_files`), rank 0 writes them."""
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
    team = job_team(share, sketch, cfg.space, block, done, inv)
    bar = progress_bar(total=N, initial=done, unit="ex", desc="sketch", disable=not progress)
    held = {"scales": scales, "last": time.perf_counter()}  # (the memory map goes before the files are hashed)
    del scales

    def write(k: int, c: np.ndarray, sc: np.ndarray) -> None:
        s = int(store.first_ids[k])
        codes[s], held["scales"][s:s + len(sc)] = c, sc
        bar.update(len(sc) - max(0, min(len(sc), done - s)))
        if time.perf_counter() - held["last"] >= cfg.checkpoint_seconds:
            _checkpoint(codes, held["scales"], out, meta, s + len(sc))
            held["last"] = time.perf_counter()

    try:
        encode_files(store, pre, cfg.space, sketch, block, done, team, inv, write)
        _checkpoint(codes, held["scales"], out, meta, N)
    finally:
        bar.close()
        codes.close()
        held.clear()
    record(out.parent, [codes_p, scales_p], [f"{out.name}/{CODES}", f"{out.name}/{SCALES}"])
    meta["sketch"]["bytes"] = int(codes_p.stat().st_size + scales_p.stat().st_size)
    write_json(out / META, meta)


def job_team(share: Share | None, sketch: Sketch, space: IndexSpace, block: int, done: int,
             inv: np.ndarray | None) -> Team:
    """The ranks that encode the sketch with rank 0: every rank where ``share`` hands the pass out and the space
    needs neither the preconditioner nor the whole index's norms (the sketch tier's raw space), else rank 0 alone."""
    if share is None or space.whiten != "none" or inv is not None:
        return SOLO
    return share("sketch", sketch.to_dict(), space, block, done)


def encode_files(store: Store, pre: Preconditioners | None, space: IndexSpace, sketch: Sketch, block: int,
                 done: int, team: Team = SOLO, inv: np.ndarray | None = None,
                 write: Callable[[int, np.ndarray, np.ndarray], None] | None = None) -> None:
    """Every store file's sketch codes and scales from the file holding row ``done`` on, each by the rank that owns
    it (:meth:`~gradindex.distributed.Team.rounds`: file ``k`` on rank ``k % size``); ``write(k, codes, scales)``
    on rank 0, in file order (other ranks pass none). A file is encoded whole, so a resumed build redoes the one it
    stopped in: its codes come out the same."""
    def work(k: int) -> tuple[np.ndarray, np.ndarray] | None:
        first, size = int(store.first_ids[k]), int(store.sizes[k])
        if first + size <= done:
            return None
        c, sc = [], []
        for ids, x in store.iter_blocks(store.layers, block, first, first + size):
            s = int(ids[0])
            v = {n: index_vectors(space, pre, n, x[n], None if inv is None else inv[s:s + len(ids)])
                 for n in store.layers}
            a, b = encode_sketch(sketch.apply(v))
            c.append(a)
            sc.append(b)
        return np.concatenate(c), np.concatenate(sc)

    def combine(k: int, res: tuple[np.ndarray, np.ndarray] | None) -> None:
        if res is not None and write is not None:
            write(k, *res)

    team.rounds(len(store.paths), work, combine)


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
