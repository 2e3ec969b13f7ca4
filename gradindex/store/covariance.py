"""The K-FAC factor sums a capture pass stores in each shard: group ``covariance`` (``Σ ā āᵀ``, ``Σ ḡ ḡᵀ`` of
the projected sides) and ``covariance_full`` (unprojected, upper triangles summed); tokens as an attribute.

The store owns these bytes: the build writes them (:func:`write_covariance`), the fits read them
(:func:`read_covariance`); nothing outside ``gradindex.store`` opens a shard file.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import h5py
import numpy as np

from gradindex.capture.gram import upper_to_symmetric
from gradindex.diskspace import reserve

GROUPS = ("covariance", "covariance_full")


def write_covariance(file: h5py.File, kfac=None, full=None, full_rows: str = "") -> None:
    """Store a shard's sums from a capture's :class:`~gradindex.capture.KfacSums` (``kfac``) and
    :class:`~gradindex.capture.FullSums` (``full``), where collected, then reset them;
    ``full_rows``: the digest of the examples the full sums take (empty: all), an attribute of their group.
    The disk's room for them is checked first (:func:`~gradindex.diskspace.reserve`): HDF5 failing on a
    full disk inside a write left the file unclosable (the process crashed, rc 139, issue 33 item 7)."""
    sums = [(group, s) for group, s in zip(GROUPS, (kfac, full), strict=True) if s is not None and s.A]
    need = sum((8 if g == "covariance" else 16) * x.numel() for g, s in sums for d in (s.A, s.S)  # (float64;
               for x in d.values())  # full: triangles, whole)
    reserve(file.filename, (1 << 16) + need)
    for group, s in sums:
        g = file.create_group(group)
        if group == "covariance_full" and full_rows:
            g.attrs["rows"] = full_rows
        read = upper_to_symmetric if group == "covariance_full" else np.asarray  # full: upper triangles summed
        for n in s.layers:
            if n in s.A:
                grp = g.create_group(n)
                grp["A"] = read(s.A[n].cpu().numpy())
                grp["S"] = read(s.S[n].cpu().numpy())
                grp.attrs["tokens"] = s.tokens[n]
        s.clear()


def read_covariance(path: str | Path, group: str, layers: Sequence[str]) -> dict[str, tuple] | None:
    """``{layer: (A, S, tokens)}`` of one shard's ``group``, or None when it lacks the group or a layer."""
    if group not in GROUPS:
        raise ValueError(f"covariance group {group!r} is not one of {GROUPS}")
    with h5py.File(path, "r") as f:
        grp = f.get(group)
        if grp is None or any(n not in grp for n in layers):
            return None
        return {n: (grp[n]["A"][:], grp[n]["S"][:], int(grp[n].attrs["tokens"])) for n in layers}


def covariance_rows(path: str | Path, group: str = "covariance_full") -> str | None:
    """The digest of the examples one shard's ``group`` sums take (``""``: all of them), or None without it."""
    with h5py.File(path, "r") as f:
        grp = f.get(group)
        return None if grp is None else str(grp.attrs.get("rows", ""))


def rows_digest(rows) -> str:
    """The digest a shard's full sums record for the examples they take (sorted data indices)."""
    import hashlib

    return hashlib.sha256(np.asarray(rows, dtype=np.int64).tobytes()).hexdigest()[:32]
