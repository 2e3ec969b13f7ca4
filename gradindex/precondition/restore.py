"""Rewrite a transcoded index's missing or damaged ``basis.h5`` from its EK-FAC fit (issue 33 item 9).

The ``ekfac`` basis of rows transcoded from raw rows is a function of the fit alone: each layer's ``Q_S``, ``Q_A``
and ``(Λ* + δ)^{-1/2}`` (:func:`~gradindex.precondition.compact.eigen_basis` at the transcode's damping), and
``precond/ekfac.h5`` keeps that fit in float64, so the file is rewritten bitwise as the build wrote it, with no
model pass and no rebuild. ``gradindex build ... --repair`` (what ``verify`` and a refused query advise) does it
first. A ``kfac``/``eigen`` projection basis is no function of a fit: that same build makes it again with its own
factor pass (the maps checked against the digest the manifest records, so the rows keep their meaning); where
neither can give it back, the error names the rebuild.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from gradindex.checksum import Damage, DamagedIndexError, move_aside
from gradindex.precondition.compact import eigen_basis
from gradindex.precondition.files import check_precond, precond_path, read_attrs, read_factors
from gradindex.spec.manifest import Manifest, baked_damping, build_command, manifest_path
from gradindex.store.basis import BASIS_FILE, RowBasis, check_basis, made_by_factor_pass, unrestorable, write_basis

log = logging.getLogger("gradindex")


def restore_basis(index_dir: str | os.PathLike, manifest: dict | None = None) -> bool:
    """Rewrite ``basis.h5`` of a complete index when it is missing or damaged and its EK-FAC fit holds it;
    whether it did. A damaged one is moved to ``damaged/`` first. One a ``kfac``/``eigen`` projection basis's
    factor pass made (complete or killed build: it is written before any row) is left to the build that calls this
    (it makes it again); where neither can give it back, a :class:`DamagedIndexError` says why and names the
    rebuild."""
    d = Path(index_dir)
    if manifest is None:
        if not manifest_path(d).exists():
            return False
        manifest = Manifest.read(d).data
    if manifest.get("status") != "complete" and not made_by_factor_pass(manifest):
        return False  # (a killed build's resume reads a kept factor-pass basis: a damaged one must not be reused)
    damage = check_basis(d, manifest)
    if not damage:
        return False
    if made_by_factor_pass(manifest):  # (the build's own factor pass makes it again, checked against its digest)
        move_aside(d, [BASIS_FILE], keep_records=True)  # (where it cannot: a copy put back is checked against it)
        log.warning("%s is %s: the build's factor pass makes it again", BASIS_FILE, damage[0].problem)
        return False
    why = unrestorable(manifest) or _fit_problem(d, manifest)
    if why:
        raise _cannot(d, manifest, damage[0], why)
    damping = baked_damping(manifest)
    fit = read_factors(precond_path(d, "ekfac"))
    basis = eigen_basis(RowBasis(), {n: (f.Q_S, f.Q_A, f.Lambda) for n, f in fit.items()}, damping)
    move_aside(d, [BASIS_FILE])
    write_basis(d, basis, {"source": Manifest(manifest).data_fingerprint, "damping": damping})
    log.warning("rewrote %s (%s) from precond/ekfac.h5, the EK-FAC fit the rows were transcoded with",
                BASIS_FILE, damage[0].problem)
    return True


def _fit_problem(d: Path, manifest: dict) -> str:
    """Why ``precond/ekfac.h5`` cannot give the basis back: damaged, or not the fit the rows were transcoded with."""
    damage = [x for x in check_precond(d, manifest) if x.file == "precond/ekfac.h5"]
    if damage:
        return f"precond/ekfac.h5, the EK-FAC fit it is made from, is {damage[0].problem} too"
    fit = read_attrs(precond_path(d, "ekfac")).get("fit")
    recorded = Manifest(manifest).build["basis"].get("fit")
    if recorded is None or json.loads(fit or "null") != json.loads(json.dumps(recorded, default=str)):
        return "precond/ekfac.h5 is not the EK-FAC fit the rows were transcoded with (refitted since)"
    return ""


def _cannot(d: Path, manifest: dict, damage: Damage, why: str) -> DamagedIndexError:
    rebuild = build_command(d, manifest, extra="--overwrite")
    return DamagedIndexError(f"{BASIS_FILE} of {str(d)!r} is {damage.problem} and cannot be rewritten from the "
                             f"index's fit files: {why}; rebuild the index with `{rebuild}`")
