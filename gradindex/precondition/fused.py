"""The default build's stages after the capture: the EK-FAC fit and the transcode, each row rotated once.

Separately they read the store three times, rotating every row into the Kronecker eigenbasis each
time: the fit's first pass (``Λ*``, K-FAC self-influence), its second (EK-FAC self-influence, which
needs the finished ``Λ*``), then the transcode. Fused:

1. one store pass (:func:`gradindex.precondition.fit.store_fit`): factors from the capture, their
   eigenbases, then every row rotated once for ``Λ*`` and the K-FAC self-influence; the rotated rows
   are kept on disk as float16 (:mod:`gradindex.precondition.rotated`);
2. the transcode (:func:`gradindex.precondition.compact.compact_rows`) reads those rotated rows back
   (not the store) and only scales them, ``W = R ⊙ (Λ* + δ)^{-1/2}``, codes them, and takes each row's
   EK-FAC self-influence from the row it codes: ``‖W‖² = ⟨(H + δI)⁻¹ Ĝ, Ĝ⟩`` (``Λ* ≥ 0``, so no floor
   acts); each shard's rotated rows are deleted once it is coded. Where the disk has no room for the
   copy (:func:`keeps_copy`) the transcode rotates the store's rows again instead.

Both stream in shard order with memory bounded by a block, and resume after a kill: the fit is
recomputed (the same numbers, the rotated rows written again), finished shards of the transcode are
kept, and the self-influence of their rows is read again from the rotated rows in the same blocks.
The rows equal those of ``gradindex precondition --method ekfac`` followed by ``gradindex compact``
up to the float16 rounding of the kept rotated rows (≤ 2⁻¹² of a row's largest number, against the
int4 step of 1/7 of it).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from gradindex.diskspace import free_bytes
from gradindex.distributed import SOLO, Team
from gradindex.heap import bound_heap
from gradindex.precondition.compact import STAGING, compact_rows, finish_transcode, swap_in
from gradindex.precondition.files import precond_path, write_precond
from gradindex.precondition.fit import FitConfig, fit_store, register_fits, store_fit
from gradindex.precondition.rotated import RotatedRows
from gradindex.spec.manifest import Manifest
from gradindex.store.codes import row_bytes


def keeps_copy(d: Path, manifest: dict, storage: str) -> bool:
    """Whether ``d``'s disk holds the rotated copy beside the coded rows (with 10% to spare); without the
    copy the transcode rotates each row again, from the store (the same numbers up to round-off)."""
    m = Manifest(manifest)
    dims, examples = [s.dim for s in m.layers.values()], m.examples
    coded = examples * sum(row_bytes(storage, x) for x in dims)
    return free_bytes(d) > 1.1 * (2 * examples * sum(dims) + coded)


def fit_and_transcode(index_dir: str | os.PathLike, cfg: FitConfig, storage: str, model=None, tokenizer=None,
                      data=None, progress: bool = False, manifest: dict | None = None,
                      sample_correction: bool = False, team: Team = SOLO) -> dict:
    """Fit EK-FAC (and K-FAC) on ``index_dir``'s raw rows and rewrite them in place in its whitened
    eigenbasis at ``cfg.damping`` as ``storage`` codes; return the new manifest. The caller holds the
    directory's lock (the pipeline); ``model``/``tokenizer``/``data`` as for :func:`fit_preconditioner`.
    ``sample_correction``: ``Λ*`` too from ``cfg.fit_examples``'s sample only (the fit a sampled build makes,
    :mod:`gradindex.precondition.sampled`, here over the stored rows: its reference). ``team``: the ranks of a
    build that share the store pass and the transcode, each over its own store files (every rank calls this
    with the lead's ``manifest``; the empirical Fisher of the build pass's factors: :func:`team_fits`); the lead
    writes the fits and swaps the rows in. The same bytes as one process."""
    if cfg.method != "ekfac" or cfg.space != "stored":
        raise ValueError("the fused transcode fits EK-FAC on the stored rows (method 'ekfac', space 'stored')")
    d = Path(index_dir)
    bound_heap()  # memory flat in N over the two passes (gradindex.heap)
    t0 = time.perf_counter()
    manifest, keep = team.on_lead(lambda: _begin(d, manifest, storage, team))
    if Manifest.of(manifest).basis_kind == "ekfac":
        return manifest
    with team.each(lambda: fit_store(d, manifest, full_check=False)) as ix:
        manifest = ix.manifest
        rotated = RotatedRows(d) if keep else None
        fitted = store_fit(ix, cfg, model, tokenizer, data, progress, ekfac_self_influence=False, spill=rotated,
                           sample_correction=sample_correction, team=team)
        ek, _ = fitted.written["ekfac"]
        curvature = {n: (f.Q_S, f.Q_A, f.Lambda) for n, f in ek.items()}
        new, si = compact_rows(ix, d / STAGING, curvature, fitted.fit, cfg.damping, storage, overwrite=True,
                               block=cfg.block, progress=progress, self_influence=True, rotated=rotated, team=team)

    def finish() -> dict:  # (every rank's shards are coded: the last round of the transcode waited for them)
        if rotated is not None:
            rotated.discard()
        write_precond(precond_path(d, "ekfac"), "ekfac", manifest, fitted.layers, ek, si, cfg.damping, fitted.fit)
        fitted.written["ekfac"] = (ek, si)
        register_fits(d, cfg, manifest, fitted, time.perf_counter() - t0)
        return swap_in(d, manifest, new, cfg.damping)  # (the manifest register_fits wrote)

    return team.on_lead(finish)


def _begin(d: Path, manifest: dict | None, storage: str, team: Team) -> tuple[dict, bool]:
    """``(manifest, whether the rotated rows are kept)``, once an interrupted swap is finished (the lead's work
    before a team's store pass; a team's ranks share the rotated rows' directory, cleared here)."""
    finish_transcode(d)
    if manifest is None or manifest.get("status") != "complete":
        manifest = Manifest.read(d).data
    if team.size > 1:
        RotatedRows(d).discard()
    return manifest, keeps_copy(d, manifest, storage)


def team_fits(cfg: FitConfig) -> bool:
    """Whether a build's ranks can share :func:`fit_and_transcode` of ``cfg``: its factors from the build pass
    and ``Λ*`` from the stored rows (the empirical Fisher on every example), no model pass on the lead alone."""
    return cfg.method == "ekfac" and cfg.space == "stored" and cfg.fisher == "empirical" and not cfg.fit_data \
        and not cfg.fit_examples
