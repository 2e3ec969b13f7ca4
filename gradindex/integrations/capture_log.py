"""The capture log: rows as a training loop produces them, in any order, one folder per rank.

``OUT/capture/rank-RRRRR/part-NNNNN.h5`` each holds up to ``part_rows`` rows:

* ``ids`` int64: the training data set row of each gradient (the key every later stage uses);
* ``step`` int64 (optimizer updates done before it), ``epoch`` float64, ``lr`` float64,
  ``loss_scale`` float64 (the factor the loop's loss put on each example's summed token loss, undone
  in the stored rows), ``loss`` float32, ``num_tokens`` int32, ``finite`` bool, ``token_hash`` uint8
  ``[n, 16]``;
* group ``grads`` with one float32 ``[n, D_layer]`` dataset per hooked layer.

A row appears once per time the loop saw the example (an epoch each). Rows are written a few hundred
at a time, each write flushed and its count committed in the attribute ``committed``, so a killed
run loses at most the rows not yet written.
:func:`gradindex.integrations.assemble.assemble_store` turns the parts of all ranks into the
id-ordered store; because rows are keyed by data set id, a rank-sharded writer only needs its own
``rank-RRRRR`` folder.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import h5py
import numpy as np

from gradindex.spec import layout

LOG_DIR = layout.CAPTURE_LOG_DIR
COLUMNS = {
    "ids": np.int64, "step": np.int64, "epoch": np.float64, "lr": np.float64, "loss_scale": np.float64,
    "loss": np.float32, "num_tokens": np.int32, "finite": np.bool_,
}


def rank_dir(out_dir: str | Path, rank: int) -> Path:
    return Path(out_dir) / LOG_DIR / f"rank-{rank:05d}"


class CaptureLog:
    """Appends micro-batches of rows to ``rank-RRRRR/part-*.h5`` files."""

    def __init__(self, folder: Path, layer_dims: dict[str, int], part_rows: int = 4096, buffer_rows: int = 256):
        self.folder = Path(folder)
        self.buffer_rows = max(1, min(buffer_rows, part_rows))
        self._buf: list = []
        self._buffered = 0
        self.layer_dims = layer_dims
        self.part_rows = max(1, part_rows)
        self.file: h5py.File | None = None
        self.parts = len(list(self.folder.glob("part-*.h5"))) if self.folder.exists() else 0
        self.rows = 0

    def _new_part(self) -> h5py.File:
        self.close()
        self.folder.mkdir(parents=True, exist_ok=True)
        f = h5py.File(self.folder / f"part-{self.parts:05d}.h5", "w")
        self.parts += 1
        f.attrs["committed"] = 0
        chunk = min(256, self.part_rows)
        for k, dt in COLUMNS.items():
            f.create_dataset(k, (0,), maxshape=(None,), dtype=dt, chunks=(chunk,))
        f.create_dataset("token_hash", (0, 16), maxshape=(None, 16), dtype=np.uint8, chunks=(chunk, 16))
        g = f.create_group("grads")
        for name, d in self.layer_dims.items():
            rows = max(1, min(chunk, (1 << 20) // max(1, 4 * d)))
            g.create_dataset(name, (0, d), maxshape=(None, d), dtype=np.float32, chunks=(rows, d))
        self.file = f
        return f

    def append(self, grads: dict[str, np.ndarray], token_hash: np.ndarray, **columns: np.ndarray) -> None:
        """Buffer one micro-batch (every :data:`COLUMNS` entry, ``token_hash`` and each layer's rows).

        Buffers are written every ``buffer_rows`` rows (HDF5 calls cost ~0.1 s per write of a
        16-layer batch, several % of a training step), and at :meth:`close`.
        """
        self._buf.append((grads, token_hash, columns))
        self._buffered += len(columns["ids"])
        if self._buffered >= self.buffer_rows:
            self.write()

    def write(self) -> None:
        """Write the buffered rows and commit them."""
        if not self._buf:
            return
        grads = {n: np.concatenate([b[0][n] for b in self._buf]) for n in self.layer_dims}
        token_hash = np.concatenate([b[1] for b in self._buf])
        columns = {k: np.concatenate([np.asarray(b[2][k]) for b in self._buf]) for k in COLUMNS}
        self._buf, self._buffered = [], 0
        n = len(columns["ids"])
        f = self.file
        if f is None or int(f.attrs["committed"]) + n > self.part_rows:
            f = self._new_part()
        n0 = int(f.attrs["committed"])
        for k in COLUMNS:
            f[k].resize(n0 + n, axis=0)
            f[k][n0:] = columns[k]
        f["token_hash"].resize(n0 + n, axis=0)
        f["token_hash"][n0:] = token_hash
        for name, v in grads.items():
            ds = f["grads"][name]
            ds.resize(n0 + n, axis=0)
            ds[n0:] = v
        f.flush()
        f.attrs["committed"] = n0 + n
        f.flush()
        self.rows += n

    def close(self) -> None:
        self.write()
        if self.file is not None:
            self.file.close()
            self.file = None


def log_parts(out_dir: str | Path) -> list[Path]:
    """Every part file of every rank, in (rank, part) order."""
    return sorted((Path(out_dir) / LOG_DIR).glob("rank-*/part-*.h5"))


def read_columns(path: Path, names: tuple[str, ...] = ("ids", "step")) -> dict[str, np.ndarray]:
    """Committed rows' columns of one part (rows past ``committed`` are a torn append)."""
    with h5py.File(path, "r") as f:
        n = int(f.attrs["committed"])
        return {k: f[k][:n] for k in names}


def read_rows(path: Path, local: np.ndarray, layers: list[str]) -> Iterator[tuple[str, np.ndarray]]:
    """``(name, values)`` of rows ``local`` (sorted, unique) of one part: every column, then each layer."""
    with h5py.File(path, "r") as f:
        for k in (*COLUMNS, "token_hash"):
            yield k, f[k][local]
        for name in layers:
            yield f"grads/{name}", f["grads"][name][local]
