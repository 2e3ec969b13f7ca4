"""The method language: which scoring methods exist and how a method name is read.

``graddot`` and ``cosine`` need no curvature; ``kfac`` and ``ekfac`` need a fitted
preconditioner; ``adam`` is the inner product of rows stored Adam-preconditioned (an index
built with ``--optimizer-state``, which answers only ``adam``); ``<method>-selfnorm`` divides
by ``sqrt`` of the training example's self-influence. Parse a name once with
:func:`parse_method` and pass the result down.
"""

from __future__ import annotations

import os
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


def fitted_methods(manifest: dict, index_dir: str | os.PathLike) -> list[str]:
    """Fitted methods the manifest registers whose file (``preconditioners[m]["file"]``) is on disk."""
    entries = manifest.get("preconditioners") or {}
    return [m for m in FITTED_METHODS
            if isinstance(entries.get(m), dict) and (Path(index_dir) / str(entries[m].get("file", ""))).is_file()]


def methods_of(manifest: dict, index_dir: str | os.PathLike, selfnorm: bool = False) -> list[str]:
    """Methods an index answers: ``graddot``, ``cosine``, fitted ones; with ``selfnorm`` their ``-selfnorm`` too.

    An index of Adam-preconditioned rows answers ``adam`` only.
    """
    out = [ADAM] if adam_rows(manifest) else list(BASE_METHODS) + fitted_methods(manifest, index_dir)
    if selfnorm:
        out += [m + SELFNORM for m in out if m != "cosine"]
    return out
