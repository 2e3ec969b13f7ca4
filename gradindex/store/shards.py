"""The HDF5 gradient store: row-sharded files of per-example projected gradients.

Contract (other tools read it). Each ``store/shard-NNNNN.h5`` holds

* ``ids`` int64 ``[n]``: 0-based row of each example in the input data;
* group ``grads`` with one code dataset per hooked layer, named by the module's qualified name;
  row ``i`` is example ``ids[i]``'s flattened ``[k_g, k_a]`` matrix (row-major, ``D_layer``
  numbers, attribute ``dim``), coded as the file's attribute ``storage`` says
  (:mod:`gradindex.store.codes`): ``fp32`` float32 / ``fp16`` float16 ``[n, D]``, ``int8`` int8
  ``[n, D]``, ``int4`` uint8 ``[n, ceil(D/2)]`` (two codes a byte);
* group ``scales`` (``int8``/``int4`` only): one float32 ``[n]`` per layer, the row's step ``s``
  (``x̂ = code · s``);
* ``loss`` float32, ``num_tokens`` int32, ``token_hash`` uint8 ``[n, 16]``, ``finite`` bool.

Readers (:class:`Store`, :class:`gradindex.index.RowReader`) decode to float32 transparently.
A committed shard's content hash is recorded outside it, in ``checksums.json``
(:mod:`gradindex.checksums`).

Shard ``k`` holds ids ``[k*S, min((k+1)*S, N))``. A shard is written as ``.h5.partial``, flushed
after every batch with its committed row count in the attribute ``committed``, and renamed to
``.h5`` when full, so a killed build loses at most the batch in flight (or, if the kill corrupted
the partial file's metadata, that one shard, which is then recomputed).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import h5py
import numpy as np

from gradindex.checksum import (
    ROW_HASHES,
    Damage,
    DamagedIndexError,
    check_files,
    damage_error,
    read_checksums,
    record,
    row_hash_path,
    row_hashes,
    shard_of,
)
from gradindex.diskspace import reserve
from gradindex.spec import layout
from gradindex.spec.layout import shard_name
from gradindex.spec.manifest import Manifest
from gradindex.store.codes import check_storage, code_dtype, code_width, decode, encode, has_scale, row_bytes

STORE_DIR = layout.STORE_DIR
OPEN_SHARDS = 16
"""Shard files a :class:`Store` keeps open (least recently used closed first); reads go shard by shard."""
SCALARS = {"loss": np.float32, "num_tokens": np.int32, "finite": np.bool_}
NO_CHUNK_CACHE = {"rdcc_nbytes": 0}
"""h5py options of a file whose rows are written (or read) once, in order: no chunk cache. HDF5's default
(1 MiB per dataset, per open file) kept the rows written so far in memory: 1.1 GB of anonymous RSS after
1,000 SmolLM2 rows of 210 layers in float16 (the build's RSS grew with N); without it the same writes
hold 49 MB and take half the time (the rows go straight to the file: uncompressed chunks)."""


def write_row_hashes(shard: Path, block_bytes: int = 1 << 26) -> Path:
    """Hash every row of every layer of a sealed shard into its sidecar (:data:`gradindex.checksum.ROW_HASHES`,
    :func:`gradindex.checksum.row_hashes`); its path."""
    with h5py.File(shard, "r") as f:
        layers = list(f["grads"])
        n = int(f["ids"].shape[0])
        out = np.zeros((n, len(layers)), dtype=np.uint64)
        for j, name in enumerate(layers):
            ds, sc = f["grads"][name], f["scales"][name] if "scales" in f else None
            step = max(1, block_bytes // max(1, ds.dtype.itemsize * ds.shape[1]))
            for s in range(0, n, step):
                e = min(n, s + step)
                out[s:e, j] = row_hashes(ds[s:e], None if sc is None else sc[s:e], np.arange(s, e))
    path = row_hash_path(shard)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        np.save(fh, out)
    os.replace(tmp, path)
    return path



class ShardWriter:
    """Appends committed batches to one shard; resumable."""

    def __init__(self, path: Path, first_id: int, n_rows: int, layer_dims: dict[str, int], fingerprint: str,
                 storage: str = "fp32"):
        self.final = path
        self.storage = check_storage(storage)
        self.partial = path.with_name(path.name + ".partial")
        self.first_id, self.n_rows = first_id, n_rows
        self.layer_dims = layer_dims
        self.fingerprint = fingerprint
        self.file: h5py.File | None = None
        self.committed = 0
        self._handles: dict[str, h5py.Dataset] = {}
        self._handles_of: h5py.File | None = None  # the file they belong to
        self._chunks: list[tuple[int, int]] | None = None  # (rows, bytes a row) of each dataset's chunks

    def open(self) -> int:
        """Open (creating or resuming) and return the number of rows already committed."""
        if self.partial.exists():
            try:
                f = h5py.File(self.partial, "r+", **NO_CHUNK_CACHE)
                ok = (f.attrs.get("fingerprint") == self.fingerprint
                      and f.attrs.get("storage", "fp32") == self.storage)
                committed = int(f.attrs.get("committed", 0))
            except Exception:  # noqa: BLE001 - a torn HDF5 file: start this shard over
                ok, f = False, None
            if ok:
                self.file, self.committed = f, committed
                for ds in self._datasets():
                    ds.resize(committed, axis=0)
                return committed
            if f is not None:
                f.close()
            self.partial.unlink()
        f = h5py.File(self.partial, "w", **NO_CHUNK_CACHE)
        f.attrs["fingerprint"] = self.fingerprint
        f.attrs["first_id"] = self.first_id
        f.attrs["committed"] = 0
        f.attrs["storage"] = self.storage
        chunk = max(1, min(256, self.n_rows))
        f.create_dataset("ids", (0,), maxshape=(self.n_rows,), dtype=np.int64, chunks=(chunk,))
        for k, dt in SCALARS.items():
            f.create_dataset(k, (0,), maxshape=(self.n_rows,), dtype=dt, chunks=(chunk,))
        f.create_dataset("token_hash", (0, 16), maxshape=(self.n_rows, 16), dtype=np.uint8, chunks=(chunk, 16))
        g = f.create_group("grads")
        sc = f.create_group("scales") if has_scale(self.storage) else None
        for name, d in self.layer_dims.items():
            rows = max(1, min(chunk, (1 << 20) // max(1, row_bytes(self.storage, d))))
            w = code_width(self.storage, d)
            ds = g.create_dataset(name, (0, w), maxshape=(self.n_rows, w), dtype=code_dtype(self.storage),
                                  chunks=(rows, w))
            ds.attrs["dim"] = d
            if sc is not None:
                sc.create_dataset(name, (0,), maxshape=(self.n_rows,), dtype=np.float32, chunks=(chunk,))
        self.file, self.committed = f, 0
        return 0

    def _append_bytes(self, n0: int, n: int) -> int:
        """The most appending rows ``n0:n0+n`` adds to the file: the whole chunks they start, per dataset."""
        if self._chunks is None:
            self._chunks = [(ds.chunks[0], int(np.prod(ds.chunks[1:], dtype=np.int64)) * ds.dtype.itemsize)
                            for ds in self._datasets()]
        total = 1 << 16  # (metadata)
        for rows, per_row in self._chunks:
            total += (-(-(n0 + n) // rows) - -(-n0 // rows)) * rows * per_row
        return total

    def _datasets(self) -> Iterator[h5py.Dataset]:
        return iter(self._ds().values())

    def _ds(self) -> dict[str, h5py.Dataset]:
        """The open file's datasets by path, looked up once per open (h5py's lookups by name were a fifth
        of the write path's time at batch 32)."""
        if self._handles_of is not self.file:
            f = self._handles_of = self.file
            paths = ["ids", "token_hash", *SCALARS, *(f"grads/{n}" for n in f["grads"]),
                     *(f"scales/{n}" for n in f.get("scales", ()))]
            self._handles = {k: f[k] for k in paths}
        return self._handles

    def append(self, ids: np.ndarray, grads: dict[str, np.ndarray], **columns: np.ndarray) -> None:
        """Write one batch and commit it (flush, then bump ``committed``)."""
        f, n0, n = self.file, self.committed, len(ids)
        if n0 + n > self.n_rows:
            raise ValueError(f"shard {self.final.name} overflows: {n0}+{n} > {self.n_rows}")
        reserve(self.partial, self._append_bytes(n0, n))
        ds = self._ds()
        for d in ds.values():
            d.resize(n0 + n, axis=0)
        ds["ids"][n0:] = ids
        for k, v in columns.items():
            ds[k][n0:] = v
        for name, v in grads.items():
            codes, scale = encode(v, self.storage)
            ds[f"grads/{name}"][n0:] = codes
            if scale is not None:
                ds[f"scales/{name}"][n0:] = scale
        f.flush()
        self.committed = n0 + n
        f.attrs["committed"] = self.committed
        f.flush()

    def finish(self) -> None:
        """:meth:`seal`, then :meth:`commit`."""
        self.seal()
        self.commit()

    def seal(self) -> None:
        """Check the shard is full and close it (it stays ``.partial`` until :meth:`commit`)."""
        if self.committed != self.n_rows:
            raise RuntimeError(f"shard {self.final.name} has {self.committed}/{self.n_rows} rows")
        self.file.close()
        self.file = None

    def commit(self) -> None:
        """Hash its rows into the sidecar (:func:`write_row_hashes`), record the sealed file's
        and the sidecar's hashes in the index's ``checksums.json``, then rename the shard into place.

        Safe on another thread (the builder overlaps it with the next shard's capture).
        """
        sidecar = write_row_hashes(self.partial)  # per-row hashes, checked as queries read rows
        record(self.final.parent.parent, [self.partial, sidecar],
               [f"{STORE_DIR}/{self.final.name}", f"{STORE_DIR}/{sidecar.name}"])
        os.replace(self.partial, self.final)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None

    def abort(self) -> None:
        """Close after a failed write (a full disk), ignoring the close's own errors: the committed rows
        stay in ``.partial`` for a resume, and no open HDF5 handle is left to fail again at exit."""
        f, self.file = self.file, None
        if f is not None:
            try:
                f.close()
            except Exception:  # noqa: BLE001 - the write already failed; the resume checks the file
                pass


def repair_command(index_dir: Path) -> str:
    """The command that rewrites a damaged store file of ``index_dir`` (its build's ``--repair``; for a part of a
    sharded index, the whole sharded index's build: :func:`~gradindex.spec.manifest.build_command`)."""
    try:
        return Manifest.read(index_dir).build_command(index_dir)
    except (OSError, ValueError):
        return "gradindex build ... --repair"


class Store:
    """Read access to an index directory's store, by blocks or by rows."""

    def __init__(self, index_dir: str | os.PathLike):
        self.dir = Path(index_dir) / STORE_DIR
        paths = sorted(self.dir.glob(layout.SHARD_GLOB))
        if not paths:
            raise FileNotFoundError(
                f"no store shards in {str(self.dir)!r}; build the index first (`gradindex build`)"
            )
        self.paths = paths
        self._check_sizes()
        self.first_ids: list[int] = []
        self.sizes: list[int] = []
        for p in paths:
            try:
                with h5py.File(p, "r") as f:
                    self.first_ids.append(int(f.attrs["first_id"]))
                    self.sizes.append(int(f["ids"].shape[0]))
                    storage = str(f.attrs.get("storage", "fp32"))
                    if p is paths[0]:
                        self.storage = storage
                        self.layers = list(f["grads"])
                        self.dims = {n: int(f["grads"][n].attrs.get("dim", f["grads"][n].shape[1]))
                                     for n in self.layers}
                    elif storage != self.storage:
                        raise OSError(f"it holds {storage} rows, {paths[0].name} {self.storage} rows")
            except (OSError, RuntimeError, KeyError) as e:
                raise self.damaged_error(p, e) from None
        self.n = int(sum(self.sizes))
        self._starts = np.cumsum([0] + self.sizes)
        self._files: OrderedDict[int, h5py.File] = OrderedDict()
        self._hashes: dict[int, np.ndarray | None] = {}

    def _check_sizes(self) -> None:
        """The cheap guard at open, O(1) a shard: every shard ``checksums.json`` records is there, with the
        size recorded when it was written (``gradindex verify`` hashes every byte)."""
        d = self.dir.parent
        names = {f"{STORE_DIR}/{p.name}" for p in self.paths}
        numbers = [int(p.stem.removeprefix("shard-")) for p in self.paths if p.stem.removeprefix("shard-").isdigit()]
        gap = {f"{STORE_DIR}/{shard_name(k)}" for k in range(max(numbers, default=-1))} - names  # unrecorded too
        files = read_checksums(d)
        shards = sorted(n for n in files if n.startswith(f"{STORE_DIR}/shard-") and n.endswith((".h5", ROW_HASHES))
                        and shard_of(n) not in gap)
        problems = [Damage(n, "missing") for n in sorted(gap)]
        problems += check_files(d, shards, full=False, sample=False, files=files)
        if problems:  # the repair command reads the manifest: only now
            repair = repair_command(d)
            raise damage_error(d, [replace(x, repair=repair) for x in problems])

    def damaged_error(self, path: Path, e: BaseException) -> DamagedIndexError:
        """The error of a shard h5py cannot read: it names the file, ``gradindex verify`` and the repair."""
        d = self.dir.parent
        why = str(e).strip() or type(e).__name__
        return damage_error(d, [Damage(f"{STORE_DIR}/{path.name}", f"unreadable: {why}", repair_command(d))])

    def __len__(self) -> int:
        return self.n

    def _file(self, k: int) -> h5py.File:
        """Shard ``k`` open for reading; the :data:`OPEN_SHARDS` most recently used stay open (each open HDF5
        file holds ~0.8 MB of caches: all 245 shards of 10^6 rows held 187 MB)."""
        if k in self._files:
            self._files.move_to_end(k)
            return self._files[k]
        try:
            f = h5py.File(self.paths[k], "r")
        except (OSError, RuntimeError) as e:
            raise self.damaged_error(self.paths[k], e) from None
        self._files[k] = f
        while len(self._files) > OPEN_SHARDS:
            self._files.popitem(last=False)[1].close()
        return f

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def column(self, name: str) -> np.ndarray:
        """A per-example column over all shards (``ids``, ``loss``, ``num_tokens``, ...)."""
        return np.concatenate([self._read(k, lambda f: f[name][:]) for k in range(len(self.paths))])

    def shard_columns(self, k: int, names: Sequence[str], start: int, stop: int) -> dict[str, np.ndarray]:
        """Per-example columns ``names`` of shard ``k``'s rows ``start:stop`` (shard-local)."""
        return self._read(k, lambda f: {c: f[c][start:stop] for c in names})

    def _read(self, k: int, read):
        """``read(file)`` on shard ``k``; an h5py failure (a damaged file) becomes a clear DamagedIndexError."""
        f = self._file(k)
        try:
            return read(f)
        except (OSError, RuntimeError) as e:
            raise self.damaged_error(self.paths[k], e) from None

    def _decode(self, k: int, name: str, sel) -> np.ndarray:
        """Rows ``sel`` (a slice or sorted unique indices) of one layer of shard ``k``, as float32."""
        def read(f: h5py.File) -> tuple[np.ndarray, np.ndarray | None]:
            return f["grads"][name][sel], (f["scales"][name][sel] if has_scale(self.storage) else None)

        codes, scales = self._read(k, read)
        self.verify_rows(k, name, sel, codes, scales)
        return decode(codes, scales, self.storage, self.dims[name])

    def _row_hashes(self, k: int) -> np.ndarray | None:
        """Shard ``k``'s per-row hashes ``[n, L]`` (memory-mapped), or None for a shard written without them."""
        if k not in self._hashes:
            p = row_hash_path(self.paths[k])
            try:
                self._hashes[k] = np.load(p, mmap_mode="r") if p.exists() else None
            except (OSError, ValueError) as e:
                raise damage_error(self.dir.parent, [Damage(f"{STORE_DIR}/{p.name}", f"unreadable: {e}",
                                                            repair_command(self.dir.parent))]) from None
        return self._hashes[k]

    def verify_rows(self, k: int, name: str, sel, codes: np.ndarray, scales: np.ndarray | None) -> None:
        """Refuse rows ``sel`` (a slice or row numbers) of shard ``k`` whose codes or scale, as read, differ
        from the hashes recorded when the shard was written (:data:`gradindex.checksum.ROW_HASHES`)."""
        rows = np.arange(sel.start or 0, sel.stop) if isinstance(sel, slice) else np.asarray(sel)
        bounds = [(k, 0, len(rows))]
        expected = self.expected_hashes(bounds, rows)
        if expected is not None:
            self.verify_gathered(bounds, rows, name, codes, scales, expected)

    def expected_hashes(self, bounds: list[tuple[int, int, int]], local: np.ndarray
                        ) -> tuple[np.ndarray, np.ndarray] | None:
        """The recorded hashes ``[n, L]`` of rows ``local`` grouped by shard (``bounds``: ``(shard, start,
        stop)`` into ``local``) and a mask of the rows that have them; None where none has (old shards)."""
        out, have = np.zeros((len(local), len(self.layers)), np.uint64), np.zeros(len(local), bool)
        for k, a, b in bounds:
            hashes = self._row_hashes(k)
            if hashes is not None:
                out[a:b], have[a:b] = hashes[local[a:b]], True
        return (out, have) if have.any() else None

    def verify_gathered(self, bounds: list[tuple[int, int, int]], local: np.ndarray, name: str, codes: np.ndarray,
                        scales: np.ndarray | None, expected: tuple[np.ndarray, np.ndarray]) -> None:
        """:meth:`verify_rows` for rows of many shards at once (:meth:`expected_hashes`' grouping and hashes)."""
        hashes, have = expected
        bad = (row_hashes(codes, scales, local) != hashes[:, self.layers.index(name)]) & have
        if bad.any():
            i = int(np.argmax(bad))
            k, a, b = next((k, a, b) for k, a, b in bounds if a <= i < b)
            d = self.dir.parent
            rows = local[a:b][bad[a:b]][:5].tolist()
            what = f"rows {rows} of layer {name!r} differ from the hashes recorded when they were written"
            raise damage_error(d, [Damage(f"{STORE_DIR}/{self.paths[k].name}", what, repair_command(d))])

    def iter_blocks(
        self, layers: Sequence[str] | None = None, block: int = 4096, start: int = 0, stop: int | None = None
    ) -> Iterator[tuple[np.ndarray, dict[str, np.ndarray]]]:
        """Yield ``(ids [n], {layer: [n, D]})`` in store order from row ``start`` (to ``stop``), ``block``
        rows at a time (a block never spans two shards)."""
        layers = list(layers or self.layers)
        stop = self.n if stop is None else stop
        for k in range(len(self.paths)):
            first = self.first_ids[k]
            if first + self.sizes[k] <= start or first >= stop:
                continue
            end = min(self.sizes[k], stop - first)
            for s in range(max(0, start - first), end, block):
                e = min(s + block, end)
                ids = self._read(k, lambda f, s=s, e=e: f["ids"][s:e])
                yield ids, {n: self._decode(k, n, slice(s, e)) for n in layers}

    def positions(self, ids: np.ndarray) -> np.ndarray:
        """Global store positions of example ids (ids are the contiguous rows ``0..N-1``)."""
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.n):
            raise IndexError(f"example ids must lie in [0, {self.n}); got {ids.min()}..{ids.max()}")
        return ids

    def read_rows(self, ids: np.ndarray, layers: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """Rows for the given example ids (any order), with one sorted read per shard."""
        layers = list(layers or self.layers)
        pos = self.positions(ids)
        out = {n: np.empty((len(pos), self.dims[n]), dtype=np.float32) for n in layers}
        order = np.argsort(pos, kind="stable")
        sp = pos[order]
        shard = np.searchsorted(self._starts, sp, side="right") - 1
        for k in np.unique(shard):
            sel = np.nonzero(shard == k)[0]
            local = sp[sel] - self._starts[k]
            uniq, inv = np.unique(local, return_inverse=True)
            for n in layers:
                rows = self._decode(int(k), n, uniq)
                out[n][order[sel]] = rows[inv]
        return out
