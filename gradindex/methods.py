"""The method language: which scoring methods exist and how a method name is read.

``graddot`` and ``cosine`` need no curvature; ``kfac`` and ``ekfac`` need a fitted
preconditioner; ``adam`` is the inner product of rows stored Adam-preconditioned (an index
built with ``--optimizer-state``, which answers only ``adam``); ``<method>-selfnorm`` divides
by ``sqrt`` of the training example's self-influence. Parse a name once with
:func:`parse_method` and pass the result down.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

BASE_METHODS = ("graddot", "cosine")
FITTED_METHODS = ("kfac", "ekfac")
ADAM = "adam"
"""Optimizer-aware influence: plain inner products of rows preconditioned by Adam's ``1/(√v + ε)``."""
IDENTITY_METHODS = BASE_METHODS + (ADAM,)
"""Methods whose preconditioner is the identity (on the rows as stored)."""
METHODS = BASE_METHODS + FITTED_METHODS + (ADAM,)
SELFNORM = "-selfnorm"
ALL_METHODS = METHODS + tuple(m + SELFNORM for m in METHODS if m != "cosine")
"""Every method name: ``<method>-selfnorm`` divides by ``sqrt`` of the training example's self-influence."""
DEFAULT_DAMPING = 1e-3
"""Relative damping of ``kfac``/``ekfac`` (a fraction of each layer's mean eigenvalue) unless one is given:
the default of every API and CLI option. Chosen from ``benchmarks/results/damping.json``: full-space
EK-FAC's LDS rises as the damping falls on all three corpora (0.1 → 0.001: +24%, +13%, +14%), the
default int4 codes keep 98-101% of it at every damping, and 0.001 holds 81-88% of the gain down to 1e-4."""
LEGACY_DAMPING = 0.1
"""The default before 0.2 (Kronfluence's ``0.1 × mean eigenvalue`` heuristic): what a record that names no
damping was written with."""


def parse_method(method: str) -> tuple[str, bool]:
    """``'kfac-selfnorm'`` → ``('kfac', True)``; raise on an unknown name."""
    m = str(method).strip().lower()
    selfnorm = m.endswith(SELFNORM)
    base = m[: -len(SELFNORM)] if selfnorm else m
    if base not in METHODS or (selfnorm and base == "cosine"):
        raise ValueError(f"method {method!r} is not one of {list(ALL_METHODS)}")
    return base, selfnorm


def adam_rows(manifest: dict) -> bool:
    """Whether an index's rows are Adam-preconditioned (built with ``--optimizer-state``)."""
    return bool(manifest.get("build", {}).get("optimizer"))


ROW_METHODS = {
    "raw": {m: m for m in METHODS},  # graddot, cosine, kfac, ekfac, adam (on Adam-preconditioned rows)
    "kfac": {"kfac": "graddot", "ekfac": "ekfac"},
    "ekfac": {"ekfac": "graddot"},
}
"""Per row basis (manifest ``build.basis.kind``): method asked for → operation on the stored rows."""
REBUILD_RAW = {"kfac": "--projection-basis raw", "ekfac": "--transcode none"}
"""Per row basis: the ``gradindex build`` option that stores raw rows instead."""


def row_method(method: str, basis: str = "raw") -> str:
    """The operation on stored rows that answers ``method`` on an index whose rows are in ``basis``.

    Raw rows (plain or Adam-preconditioned gradients): every method is itself. K-FAC-whitened rows
    (``--projection-basis kfac``): their plain inner product is K-FAC influence, so ``kfac`` is a
    dot product of rows and ``ekfac`` the EK-FAC fitted on them; ``graddot``/``cosine`` are refused
    (the rows are not raw gradients). Rows in the EK-FAC whitened eigenbasis (``gradindex compact
    --basis ekfac``): ``ekfac`` is their dot product.
    """
    base, selfnorm = parse_method(method)
    return row_base(base, basis, method) + (SELFNORM if selfnorm else "")


def row_base(base: str, basis: str = "raw", method: str | None = None) -> str:
    """:func:`row_method` of a parsed base method (``method``: the name asked for, for the error)."""
    return _row_base(base, basis, method, None)


def _row_base(base: str, basis: str, method: str | None, answers: Sequence[str] | None) -> str:
    table = ROW_METHODS.get(basis)
    if table is None:
        raise ValueError(f"row basis {basis!r} is not one of {list(ROW_METHODS)}; upgrade gradindex")
    if base not in table:
        raise ValueError(f"method {method or base!r} does not apply to this index: its rows are stored in the "
                         f"{basis!r} whitened basis, so plain inner products are {basis} influence, not {base}; "
                         f"use one of {', '.join(answers or sorted(table))} (or rebuild with "
                         f"{REBUILD_RAW.get(basis, '--transcode none')} for raw rows)")
    return table[base]


def index_row_base(manifest: dict, index_dir: str | os.PathLike, base: str, method: str | None = None) -> str:
    """:func:`row_base` on this index's rows; a refusal names every method the index answers
    (:func:`methods_of` with ``-selfnorm``), not only the operations on its rows."""
    basis = str((manifest.get("build", {}).get("basis") or {}).get("kind", "raw"))
    try:
        return _row_base(base, basis, method, None)
    except ValueError:
        if basis not in ROW_METHODS:
            raise
        return _row_base(base, basis, method, methods_of(manifest, index_dir, selfnorm=True))


def fitted_methods(manifest: dict, index_dir: str | os.PathLike) -> list[str]:
    """Fitted methods the manifest registers whose file (``preconditioners[m]["file"]``) is on disk."""
    entries = manifest.get("preconditioners") or {}
    return [m for m in FITTED_METHODS
            if isinstance(entries.get(m), dict) and (Path(index_dir) / str(entries[m].get("file", ""))).is_file()]


def methods_of(manifest: dict, index_dir: str | os.PathLike, selfnorm: bool = False, rows: bool = False) -> list[str]:
    """Methods an index answers: ``graddot``, ``cosine``, fitted ones; with ``selfnorm`` their ``-selfnorm`` too.

    An index of Adam-preconditioned rows answers ``adam`` only; one whose rows are in a whitened
    basis answers the methods of :data:`ROW_METHODS` whose operation on its rows is available
    (``rows=True``: the operations on the stored rows themselves, whatever their basis).
    """
    out = [ADAM] if adam_rows(manifest) else list(BASE_METHODS) + fitted_methods(manifest, index_dir)
    basis = str((manifest.get("build", {}).get("basis") or {}).get("kind", "raw"))
    if basis != "raw" and not rows:
        table = ROW_METHODS.get(basis, {})
        out = [m for m in table if table[m] in out]
    if selfnorm:
        out += [m + SELFNORM for m in out if m != "cosine"]
    return out


PREFERRED = ("ekfac", "kfac", ADAM, "graddot")
"""The method a command uses when none is given: the first one the index answers (EK-FAC kept the
most of leave-one-out quality in benchmarks/fidelity.py; docs/math.md)."""


def default_method(manifest: dict, index_dir: str | os.PathLike, prefer: Sequence[str] = PREFERRED) -> str:
    """The first method of ``prefer`` the index answers (else the first one it answers)."""
    answers = methods_of(manifest, index_dir)
    return next((m for m in prefer if m in answers), answers[0])
