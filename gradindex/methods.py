"""The method language: which scoring methods exist and how a method name is read.

``graddot`` and ``cosine`` need no curvature; ``kfac`` and ``ekfac`` need a fitted
preconditioner; ``adam`` is the inner product of rows stored Adam-preconditioned (an index
built with ``--optimizer-state``, which answers only ``adam``); ``<method>-selfnorm`` divides
by ``sqrt`` of the training example's self-influence. Parse a name once with
:func:`parse_method` and pass the result down.
"""

from __future__ import annotations

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
