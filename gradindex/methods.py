"""The method language: which scoring methods exist and how a method name is read.

``graddot`` and ``cosine`` need no curvature; ``kfac`` and ``ekfac`` need a fitted
preconditioner; ``<method>-selfnorm`` divides by ``sqrt`` of the training example's
self-influence. Parse a name once with :func:`parse_method` and pass the result down.
"""

from __future__ import annotations

BASE_METHODS = ("graddot", "cosine")
FITTED_METHODS = ("kfac", "ekfac")
METHODS = BASE_METHODS + FITTED_METHODS
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


ROW_METHODS = {
    "raw": {m: m for m in METHODS},
    "kfac": {"kfac": "graddot", "ekfac": "ekfac"},
    "ekfac": {"ekfac": "graddot"},
}
"""Per row basis (manifest ``build.basis.kind``): method asked for → operation on the stored rows."""


def row_method(method: str, basis: str = "raw") -> str:
    """The operation on stored rows that answers ``method`` on an index whose rows are in ``basis``.

    Raw rows: every method is itself. K-FAC-whitened rows (``--projection-basis kfac``): their plain
    inner product is K-FAC influence, so ``kfac`` is a dot product of rows and ``ekfac`` the EK-FAC
    fitted on them; ``graddot``/``cosine`` are refused (the rows are not raw gradients). Rows in the
    EK-FAC whitened eigenbasis (``gradindex compact --basis ekfac``): ``ekfac`` is their dot product.
    """
    base, selfnorm = parse_method(method)
    table = ROW_METHODS.get(basis)
    if table is None:
        raise ValueError(f"row basis {basis!r} is not one of {list(ROW_METHODS)}; upgrade gradindex")
    if base not in table:
        raise ValueError(f"method {method!r} does not apply to this index: its rows are stored in the {basis!r} "
                         f"whitened basis, so plain inner products are {basis} influence, not {base}; use one of "
                         f"{sorted(table)} (or rebuild with --projection-basis raw)")
    return table[base] + (SELFNORM if selfnorm else "")
