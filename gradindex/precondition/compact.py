"""Transcode an index's store into the EK-FAC whitened eigenbasis (``gradindex compact IDX --basis ekfac``,
and in place at the end of ``gradindex build``, whose default it is).

Each stored row ``Ĝ`` becomes ``(Q_Sᵀ Ĝ Q_A) ⊙ (Λ* + δ)^{-1/2}`` with the index's fitted EK-FAC
(``δ = damping × mean Λ*``). Plain inner products of the new rows are EK-FAC influence at that
damping, and every coordinate has comparable scale, which is what low-bit codes need (issue 11:
int4 codes of whitened rows keep ~99% of full-space EK-FAC's quality). The new index is written
to another directory through the store's own writer (:class:`gradindex.store.ShardWriter`), shard
by shard, so a killed transcode resumes; the source is never modified. Its ``basis.h5`` holds the
source's pre-projection maps (if any) and the rotation, so queries are mapped the same way.

:func:`transcode_in_place` does the same inside one index directory: it compacts into
``INDEX_DIR/eigenbasis.partial/``, then swaps the new store in under a journal
(``transcode.json``) so that a kill at any point resumes, and keeps the EK-FAC/K-FAC fits (they
answer token explanations and self-influence at the fitted damping).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from gradindex.distributed import SOLO, Team
from gradindex.methods import DEFAULT_DAMPING
from gradindex.precondition.apply import absolute_damping
from gradindex.precondition.ekfac import block_rows
from gradindex.precondition.preconditioner import load_preconditioner
from gradindex.precondition.rotated import RotatedRows
from gradindex.progress import progress_bar
from gradindex.spec.manifest import Manifest, manifest_path, rows_of, write_manifest
from gradindex.store import STORE_DIR, ShardWriter, Store, shard_name
from gradindex.store.basis import index_basis, stored_rows, write_basis
from gradindex.store.codes import check_storage
from gradindex.store.opened import OpenStore, opened
from gradindex.store.swap import JOURNAL, STAGING, finish_transcode, swap_in  # noqa: F401 (re-exported)

log = logging.getLogger("gradindex")
COLUMNS = ("loss", "num_tokens", "finite", "token_hash")


def compact_eigenbasis(src: str | os.PathLike | OpenStore, out: str | os.PathLike, damping: float = DEFAULT_DAMPING,
                       storage: str | None = None, overwrite: bool = False, block: int = 1024,
                       progress: bool = False) -> dict:
    """Write ``out``: the rows of ``src`` (an open index, or a path opened here) in the EK-FAC whitened
    eigenbasis, coded as ``storage`` (default: the source's); return its manifest."""
    with opened(src, "compact it") as ix:
        if ix.described.basis_kind == "ekfac":
            raise ValueError(f"{str(ix.dir)!r} is already in the ekfac eigenbasis")
        if "ekfac" not in ix.described.preconditioners:
            raise FileNotFoundError(f"{str(ix.dir)!r} has no EK-FAC fit to rotate into; run "
                                    f"`gradindex precondition {ix.dir} --method ekfac` first")
        P = load_preconditioner(ix, "ekfac")
        curvature = {n: (P.curvature[n]["Q_S"], P.curvature[n]["Q_A"], P.curvature[n]["Lambda"]) for n in P.layers}
        fit = ix.described.preconditioners["ekfac"].get("fit", {})
        return compact_rows(ix, out, curvature, fit, damping, storage, overwrite, block, progress)[0]


def compact_rows(ix: OpenStore, out: str | os.PathLike, curvature: dict, fit: dict,
                 damping: float, storage: str | None, overwrite: bool, block: int, progress: bool,
                 self_influence: bool = False, rotated: RotatedRows | None = None,
                 team: Team = SOLO) -> tuple[dict, np.ndarray | None]:
    """The compact itself, from ``curvature`` (layer → ``(Q_S, Q_A, Λ*)``) of the fit recorded as ``fit``.

    Streams the store in shard order, ``block`` rows at a time (fewer where a block of all layers
    would pass :data:`~gradindex.precondition.ekfac.BLOCK_BYTES`), so memory does not grow with the
    store. ``self_influence``: also return each row's ``[N, L]`` ``‖whitened row‖²`` before coding
    (the EK-FAC self-influence at ``damping``), recomputed for the rows a resumed run finds written.
    ``rotated``: the rows already rotated into ``curvature``'s eigenbasis by the fit pass
    (:mod:`gradindex.precondition.rotated`): they are only scaled, and each shard's are deleted once coded.
    ``team``: the ranks sharing the shards (:class:`~gradindex.distributed.Team`; each codes its own, the lead
    writes the manifest and basis and gets every row's self-influence).
    """
    t0 = time.perf_counter()
    src, out, manifest, shapes, store = ix.dir, Path(out), ix.manifest, ix.shapes, ix.store
    if out.resolve() == src.resolve():
        raise ValueError("--out must be another directory (the source index is never modified)")
    storage = check_storage(storage or ix.described.storage)
    basis = eigen_basis(index_basis(src, manifest), curvature, damping)
    new = eigen_manifest(manifest, storage, damping, fit)

    def start() -> None:
        _prepare(out, new, overwrite)
        write_manifest(out, new)  # first: a kill from here on leaves an unfinished compact that a re-run resumes
        write_basis(out, basis, {"source": ix.described.data_fingerprint, "damping": damping})
        (out / STORE_DIR).mkdir(exist_ok=True)

    team.on_lead(start)
    with progress_bar(total=len(store), unit="ex", desc="transcode" if self_influence else "compact",
                      disable=not progress) as bar:
        si = np.zeros((len(store), len(shapes))) if self_influence else None
        rows = block_rows(store.dims, list(shapes), block)

        def work(k: int) -> np.ndarray | None:
            _compact_shard(store, k, out, basis, shapes, storage, ix.described.data_fingerprint, rows, si,
                           bar.update, rotated)
            return None if si is None else si[store.first_ids[k]:store.first_ids[k] + store.sizes[k]]

        def combine(k: int, res: np.ndarray | None) -> None:
            if not team.owns(k):  # (another rank's shard)
                bar.update(int(store.sizes[k]))
                if si is not None and team.lead:
                    si[store.first_ids[k]:store.first_ids[k] + store.sizes[k]] = res

        team.rounds(len(store.paths), work, combine)
    new["status"] = "complete"
    new["compact"] = {"source": str(src.resolve()), "seconds": round(time.perf_counter() - t0, 3)}
    team.on_lead(lambda: write_manifest(out, new))
    log.info("compacted %s into the ekfac eigenbasis at %s", src, out)
    return new, si


def eigen_basis(basis, curvature: dict, damping: float):
    """``basis`` (the rows' own, its pre-projection maps kept) turned into the ``ekfac`` one of ``curvature``
    (layer → ``(Q_S, Q_A, Λ*)``): the rotation and the scale ``(Λ* + δ)^{-1/2}`` of every layer."""
    basis.kind, basis.damping = "ekfac", damping
    for n, (Q_S, Q_A, Lam) in curvature.items():
        lam = np.clip(np.asarray(Lam, np.float64), 0.0, None)
        basis.Q_S[n], basis.Q_A[n] = np.asarray(Q_S, np.float64), np.asarray(Q_A, np.float64)
        basis.scale[n] = 1.0 / np.sqrt(lam + absolute_damping(damping, Lam))
    return basis


def eigen_manifest(manifest: dict, storage: str, damping: float, fit: dict) -> dict:
    """The manifest of ``manifest``'s rows in the EK-FAC whitened eigenbasis at ``damping`` as ``storage``
    codes (status ``building``, no fits yet): what a compact writes, and a sampled build's main pass."""
    build = Manifest(manifest).build
    new = {**manifest, "status": "building", "preconditioners": {},
           "build": {**build, "storage": storage, "basis": {"kind": "ekfac", "damping": damping,
                                                            "from": build.get("basis", {"kind": "raw"}), "fit": fit}}}
    source = rows_of(manifest)
    if source.basis == "raw":  # (the rows of other bases name their basis in build.basis.from)
        new["rows"] = str(replace(source, transcode=True, damping=damping, storage=storage))
    return new


def _compact_shard(store: Store, k: int, out: Path, basis, shapes: dict, storage: str, fingerprint: str, rows: int,
                   si: np.ndarray | None, advance, rotated: RotatedRows | None = None) -> None:
    """Shard ``k`` of ``store`` into ``out``, resuming a partial one (a run with ``si`` reads the written
    rows again, in the same blocks, for their self-influence: the same numbers as an unbroken run)."""
    first, size = store.first_ids[k], store.sizes[k]
    final = out / STORE_DIR / shard_name(k)
    if final.exists() and si is None:
        advance(size)
        if rotated is not None:
            rotated.drop(k)
        return
    w = None
    done = size
    if not final.exists():
        w = ShardWriter(final, first, size, store.dims, fingerprint, storage)
        done = w.open()
        if done % rows and done != size:  # (written by a run with other blocks: redo it, in these)
            w.close()
            w.partial.unlink()
            done = w.open()
    try:
        start = first if si is not None else first + done
        advance(start - first)
        for ids, coded in _blocks(store, k, rows, start, basis, shapes, rotated):
            pos = store.positions(ids)
            if si is not None:
                si[pos] = np.stack([np.square(coded[n], dtype=np.float64).sum(1) for n in shapes], axis=1)
            if w is not None and ids[0] >= first + done:
                s = int(ids[0] - first)
                w.append(ids, coded, **store.shard_columns(k, COLUMNS, s, s + len(ids)))
            advance(len(ids))
        if w is not None:
            w.finish()
        if rotated is not None:
            rotated.drop(k)
    except BaseException:
        if w is not None:
            w.abort()
        raise


def _blocks(store: Store, k: int, rows: int, start: int, basis, shapes: dict, rotated: RotatedRows | None):
    """``(ids, {layer: whitened rows})`` of shard ``k`` from id ``start``, ``rows`` at a time: the store's
    rows rotated, rounded and scaled (:func:`stored_rows`), or ``rotated``'s rows (rotated and rounded the
    same way) only scaled: the same numbers either way."""
    if rotated is None:
        for ids, grads in store.iter_blocks(None, rows, start, store.first_ids[k] + store.sizes[k]):
            yield ids, {n: stored_rows(basis, n, grads[n], shapes[n]) for n in shapes}
        return
    first, size = store.first_ids[k], store.sizes[k]
    scale = {n: np.asarray(basis.scale[n], np.float32).reshape(-1) for n in shapes}  # [k_g·k_a]
    for s in range(start - first, size, rows):
        e = min(s + rows, size)
        yield np.arange(first + s, first + e, dtype=np.int64), {n: rotated.get(k, n, s, e) * scale[n] for n in shapes}


def _prepare(out: Path, manifest: dict, overwrite: bool) -> None:
    """An empty ``out``, or an unfinished compact of the same source (resumed), or ``overwrite``; never a part of a
    sharded index (:func:`~gradindex.store.builder.refuse_part`)."""
    from gradindex.store.builder import refuse_part

    refuse_part(out, "a compact into it would replace the part by a whole index")
    if not out.exists() or not any(out.iterdir()):
        out.mkdir(parents=True, exist_ok=True)
        return
    if manifest_path(out).exists() and Manifest.read(out).build == Manifest.of(manifest).build:
        return
    if not overwrite:
        raise FileExistsError(f"{str(out)!r} is not empty and holds another index; choose another --out, or "
                              "--overwrite to replace it")
    shutil.rmtree(out)
    out.mkdir(parents=True)


def transcode_in_place(index_dir: str | os.PathLike, damping: float = DEFAULT_DAMPING, storage: str = "int4",
                       progress: bool = False) -> dict:
    """Rewrite ``index_dir``'s rows in the EK-FAC whitened eigenbasis as ``storage`` codes; return the manifest.

    Needs a complete index with an EK-FAC fit. The raw rows are replaced (the fits are kept); the
    manifest's ``transcode`` section keeps the raw build's identity, so a re-run of the same build
    is recognised as done and another one is refused. Resumable at every step.
    """
    d = Path(index_dir)
    finish_transcode(d)
    with OpenStore(d, then="transcode it") as ix:
        if ix.described.basis_kind == "ekfac":
            return ix.manifest
        new = compact_eigenbasis(ix, d / STAGING, damping=damping, storage=storage, overwrite=True,
                                 progress=progress)  # (resumed if the same)
    return swap_in(d, ix.manifest, new, damping)
