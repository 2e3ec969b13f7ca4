"""Transcode an index's store into the EK-FAC whitened eigenbasis (``gradindex compact IDX --basis ekfac``).

Each stored row ``Ĝ`` becomes ``(Q_Sᵀ Ĝ Q_A) ⊙ (Λ* + δ)^{-1/2}`` with the index's fitted EK-FAC
(``δ = damping × mean Λ*``). Plain inner products of the new rows are EK-FAC influence at that
damping, and every coordinate has comparable scale, which is what low-bit codes need (issue 11:
int4 codes of whitened rows keep ~99% of full-space EK-FAC's quality). The new index is written
to another directory through the store's own writer (:class:`gradindex.store.ShardWriter`), shard
by shard, so a killed transcode resumes; the source is never modified. Its ``basis.h5`` holds the
source's pre-projection maps (if any) and the rotation, so queries are mapped the same way.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from gradindex.manifest import manifest_path, read_complete_manifest, row_basis, write_manifest
from gradindex.precondition.apply import absolute_damping
from gradindex.precondition.preconditioner import layer_shapes, load_preconditioner
from gradindex.store import STORE_DIR, ShardWriter, Store, shard_name
from gradindex.store.basis import basis_path, index_basis, to_rows, write_basis
from gradindex.store.codes import check_storage

log = logging.getLogger("gradindex")
COLUMNS = ("loss", "num_tokens", "finite", "token_hash")


def compact_eigenbasis(src: str | os.PathLike, out: str | os.PathLike, damping: float = 0.1,
                       storage: str | None = None, overwrite: bool = False, block: int = 1024,
                       progress: bool = False) -> dict:
    """Write ``out``: ``src``'s rows in the EK-FAC whitened eigenbasis, coded as ``storage``
    (default: the source's); return its manifest."""
    t0 = time.perf_counter()
    src, out = Path(src), Path(out)
    manifest = read_complete_manifest(src, "compact it")
    if row_basis(manifest) == "ekfac":
        raise ValueError(f"{str(src)!r} is already in the ekfac eigenbasis")
    if "ekfac" not in manifest.get("preconditioners", {}):
        raise FileNotFoundError(f"{str(src)!r} has no EK-FAC fit to rotate into; run "
                                f"`gradindex precondition {src} --method ekfac` first")
    if out.resolve() == src.resolve():
        raise ValueError("--out must be another directory (the source index is never modified)")
    storage = check_storage(storage or manifest["build"].get("storage", "fp32"))
    shapes = layer_shapes(manifest)
    P = load_preconditioner(src, "ekfac")
    basis = index_basis(src, manifest)
    basis.kind, basis.damping = "ekfac", damping
    for n in shapes:
        c = P.curvature[n]
        lam = np.clip(np.asarray(c["Lambda"], np.float64), 0.0, None)
        basis.Q_S[n], basis.Q_A[n] = np.asarray(c["Q_S"], np.float64), np.asarray(c["Q_A"], np.float64)
        basis.scale[n] = 1.0 / np.sqrt(lam + absolute_damping(c["Lambda"], damping))
    new = {**manifest, "status": "building", "preconditioners": {},
           "build": {**manifest["build"], "storage": storage, "basis": {"kind": "ekfac", "damping": damping,
                                                    "from": manifest["build"].get("basis", {"kind": "raw"}),
                                                    "fit": manifest["preconditioners"]["ekfac"].get("fit", {})}}}
    _prepare(out, new, overwrite)
    write_basis(out, basis, {"source": manifest["build"]["data_fingerprint"], "damping": damping})
    write_manifest(out, new)
    (out / STORE_DIR).mkdir(exist_ok=True)
    fp = manifest["build"]["data_fingerprint"]
    with Store(src) as store, tqdm(total=len(store), unit="ex", desc="compact", disable=not progress) as bar:
        cols = {c: store.column(c) for c in COLUMNS}
        for k, (first, size) in enumerate(zip(store.first_ids, store.sizes, strict=True)):
            final = out / STORE_DIR / shard_name(k)
            if final.exists():
                bar.update(size)
                continue
            w = ShardWriter(final, first, size, store.dims, fp, storage)
            done = w.open()
            for ids, grads in store.iter_blocks(None, block, first + done):
                if ids[0] >= first + size:
                    break
                rows = {n: to_rows(basis, n, grads[n], shapes[n]) for n in shapes}
                pos = store.positions(ids)
                w.append(ids, rows, **{c: v[pos] for c, v in cols.items()})
                bar.update(len(ids))
            w.finish()
    new["status"] = "complete"
    new["compact"] = {"source": str(src.resolve()), "seconds": round(time.perf_counter() - t0, 3)}
    write_manifest(out, new)
    log.info("compacted %s into the ekfac eigenbasis at %s", src, out)
    return new


def _prepare(out: Path, manifest: dict, overwrite: bool) -> None:
    """An empty ``out``, or an unfinished compact of the same source (resumed), or ``overwrite``."""
    if not out.exists() or not any(out.iterdir()):
        out.mkdir(parents=True, exist_ok=True)
        return
    same = False
    if manifest_path(out).exists() and basis_path(out).exists():
        from gradindex.manifest import read_manifest

        old = read_manifest(out)
        same = old.get("build") == manifest["build"]
    if same:
        return
    if not overwrite:
        raise FileExistsError(f"{str(out)!r} is not empty and holds another index; choose another --out, or "
                              "--overwrite to replace it")
    shutil.rmtree(out)
    out.mkdir(parents=True)
