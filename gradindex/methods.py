"""The method language: which scoring methods exist (:data:`REGISTRY`) and how a method name is read.

Each method is one :class:`Method` record (what it needs fitted, how it applies, its
self-influence, which row bases answer it, where it can be used); every list of methods (CLI
choices, each app's methods, "which methods does this index answer") is derived from the registry,
so a new method is one :func:`register` call.

``graddot`` and ``cosine`` need no curvature; ``kfac`` and ``ekfac`` need a fitted
preconditioner; ``adam`` is the inner product of rows stored Adam-preconditioned (an index
built with ``--optimizer-state``, which answers only ``adam``); ``<method>-selfnorm`` divides
by ``sqrt`` of the training example's self-influence. Parse a name once with
:func:`parse_method` and pass the result down.
"""

from __future__ import annotations

import importlib
import math
import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gradindex.spec.manifest import adam_rows, row_basis  # noqa: F401  (adam_rows: re-exported)
from gradindex.spec.rows import DEFAULT_DAMPING, LEGACY_DAMPING  # noqa: F401  (re-exported)

APPS = ("query", "serve", "explain", "outliers", "dedup", "audit")
"""Where a method can be used: ``gradindex query`` / the engine, the server, explain, outliers, dedup, audit."""


@dataclass(frozen=True)
class Method:
    """One scoring method: what it needs fitted, how it applies, and where it answers.

    A method is answered on an index by an *operation on its stored rows* (:attr:`row_bases`): on
    raw rows every method is its own operation; on rows stored in a whitened basis the operation is
    the one whose inner product equals the method (e.g. ``kfac`` on K-FAC-whitened rows is ``graddot``).
    """

    name: str
    fitted: str | None = None
    """The preconditioner file it needs fitted (``precond/<fitted>.h5``); ``None``: the identity on the
    rows as stored (nothing to fit)."""
    normalize: bool = False
    """Scores are cosines: query and training vectors divided by their norms."""
    self_influence: str = "dot"
    """What ``-selfnorm`` divides by: ``dot`` ``⟨g, g⟩``, ``preconditioned`` ``⟨H⁻¹g, g⟩`` (with
    :attr:`fitted`'s curvature), ``unit`` (cosine: 1, so ``-selfnorm`` does not apply)."""
    rows: str = "raw"
    """The rows it reads: ``raw`` gradients, ``adam`` (Adam-preconditioned, built with
    ``--optimizer-state``) or ``trajectory`` (a ``gradindex trajectory`` index over checkpoints)."""
    row_bases: Mapping[str, str] = field(default_factory=dict)
    """Row basis (manifest ``build.basis.kind``) → the operation on such rows that answers it."""
    apps: frozenset[str] = frozenset(APPS)
    """Where it can be used (:data:`APPS`)."""
    rank: int = 100
    """Preference when a command is given no method: the lowest rank the index answers wins."""
    summary: str = ""
    curvature: object = None
    """With :attr:`fitted`: the :class:`~gradindex.precondition.curvature.Curvature` that fits, applies and stores
    it (the class, or ``module:Class`` imported when first used: :func:`resolve`)."""
    engine: object = None
    """The engine that answers indices of its :attr:`rows` when they are not an ordinary index (the class, or
    ``module:Class``; its ``opens(index_dir)`` claims a directory); None: :class:`~gradindex.query.QueryEngine`."""

    @property
    def selfnorm(self) -> bool:
        """Whether ``<name>-selfnorm`` exists."""
        return self.self_influence != "unit"


REGISTRY: dict[str, Method] = {}
"""Every method by name, in the order lists show them (:func:`register` adds one)."""


def register(method: Method) -> Method:
    """Add (or replace) a method; every list of methods (CLI choices, apps, :func:`methods_of`) follows."""
    REGISTRY[method.name] = method
    return method


def method_spec(base: str) -> Method:
    """The registered method ``base`` (a base name, no ``-selfnorm``)."""
    try:
        return REGISTRY[base]
    except KeyError:
        raise ValueError(f"method {base!r} is not one of {list(all_methods())}") from None


def all_methods(app: str | None = None, selfnorm: bool = True) -> tuple[str, ...]:
    """Every method name (``app``: those usable there), with the ``-selfnorm`` variants unless ``selfnorm=False``."""
    ms = [m for m in REGISTRY.values() if app is None or app in m.apps]
    return tuple(m.name for m in ms) + (tuple(m.name + SELFNORM for m in ms if m.selfnorm) if selfnorm else ())


SELFNORM = "-selfnorm"
register(Method("graddot", row_bases={"raw": "graddot"}, rank=4,
                summary="inner products of the gradients (no preconditioner)"))
register(Method("cosine", normalize=True, self_influence="unit", row_bases={"raw": "cosine"},
                apps=frozenset({"query", "serve"}), summary="cosine of the gradients"))
register(Method("kfac", fitted="kfac", self_influence="preconditioned", row_bases={"raw": "kfac", "kfac": "graddot"},
                rank=2, summary="K-FAC influence ⟨(S ⊗ A + δ)⁻¹ g_q, g_t⟩",
                curvature="gradindex.precondition.fit:KFAC"))
register(Method("ekfac", fitted="ekfac", self_influence="preconditioned",
                row_bases={"raw": "ekfac", "kfac": "ekfac", "ekfac": "graddot"}, rank=1,
                summary="EK-FAC influence (corrected eigenvalues)", curvature="gradindex.precondition.fit:EKFAC"))
register(Method("adam", rows="adam", row_bases={"raw": "adam"}, apps=frozenset(APPS) - {"outliers", "dedup", "audit"},
                rank=3, summary="inner products of rows preconditioned by Adam's 1/(√v + ε)"))
register(Method("tracin", rows="trajectory", self_influence="unit", apps=frozenset({"query"}),
                summary="Σ_c η_c ⟨g_q^c, g_t^c⟩ over checkpoints (a `gradindex trajectory` index)",
                engine="gradindex.apps.tracin:TracInEngine"))
ADAM = "adam"
"""Optimizer-aware influence: plain inner products of rows preconditioned by Adam's ``1/(√v + ε)``."""
VOCABULARY = {  # which registered methods each list holds (:func:`names`: read now, never a snapshot)
    "base": lambda m: m.rows == "raw" and m.fitted is None,
    "fitted": lambda m: bool(m.fitted),
    "identity": lambda m: m.fitted is None and m.rows != "trajectory",  # (the identity on the rows as stored)
    "indexed": lambda m: m.rows != "trajectory",  # (answered by an index of stored rows)
}


def names(kind: str) -> tuple[str, ...]:
    """The registered methods of one :data:`VOCABULARY` list (``base``, ``fitted``, ``identity``, ``indexed``)."""
    return tuple(m.name for m in REGISTRY.values() if VOCABULARY[kind](m))


def resolve(ref):
    """``ref``, or the object its ``module:Name`` string names (imported now: a later stage's class)."""
    if not isinstance(ref, str):
        return ref
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)
FLOAT32_TINY, FLOAT32_MAX = 2.0 ** -126, (2 - 2.0 ** -23) * 2.0 ** 127
"""float32's smallest positive normal and largest finite number, exactly (1.1754943508222875e-38 and
3.4028234663852886e+38): the curvature is applied in float32, so a damping outside them vanishes or overflows."""


def as_float32(value: float) -> float:
    """``value`` rounded to the nearest float32 (``inf`` beyond its range), as the float32 arithmetic will hold it.
    The printed literal ``3.4028235e38`` (a little above :data:`FLOAT32_MAX` as a Python float) rounds to it."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def in_float32_range(value: float) -> bool:
    """Whether ``value``, rounded to float32 (:func:`as_float32`), is a finite positive normal float32: the one
    test of the CLI's damping options (:func:`absolute_damping` refuses a δ whose float32 is infinite)."""
    return math.isfinite(value) and FLOAT32_TINY <= as_float32(value) <= FLOAT32_MAX


def absolute_damping(relative: float, eigenvalues) -> float:
    """``δ = relative × mean(Λ)``: the absolute damping a relative one stands for, over a layer's eigenvalues
    ``Λ`` (any array with ``.mean()``); ``relative`` itself when ``Λ`` is all zero. The one place this rule
    lives (build, basis, allocation, sizing and query all call it)."""
    if not (relative > 0 and math.isfinite(relative)):
        raise ValueError(f"damping must be finite and > 0 (a fraction of the mean eigenvalue, e.g. {DEFAULT_DAMPING}), "
                         f"got {relative}")
    mean = float(eigenvalues.mean())
    delta = relative * mean if mean > 0 else float(relative)
    if not math.isfinite(as_float32(delta)):  # (applied in float32: an infinite δ scores every row zero)
        raise ValueError(f"damping {relative:g} is {delta:g} in absolute terms on a layer whose mean eigenvalue is "
                         f"{mean:g}, beyond float32's range ({FLOAT32_MAX:g}); use a damping below "
                         f"{FLOAT32_MAX / mean:.3g} (relative damping is a fraction of each layer's mean eigenvalue, "
                         f"e.g. {DEFAULT_DAMPING})")
    return delta


def parse_method(method: str) -> tuple[str, bool]:
    """``'kfac-selfnorm'`` → ``('kfac', True)``; raise on an unknown name."""
    return _parse(method)


def _parse(method: str) -> tuple[str, bool]:
    """:func:`parse_method`'s work (tests count every parse here, whichever module imported parse_method)."""
    m = str(method).strip().lower()
    selfnorm = m.endswith(SELFNORM)
    base = m[: -len(SELFNORM)] if selfnorm else m
    spec = REGISTRY.get(base)
    if spec is not None and spec.rows == "trajectory":
        raise ValueError(f"method {method!r} sums scores over a training run's checkpoints, so it answers on a "
                         "trajectory index only (`gradindex trajectory DATA --out TRAJ --checkpoint CK1 --checkpoint "
                         f"CK2 ...`, then `gradindex query TRAJ --method {base}`); an index answers one of "
                         f"{list(all_methods_of_rows())}")
    if spec is None or (selfnorm and not spec.selfnorm):
        raise ValueError(f"method {method!r} is not one of {list(all_methods_of_rows())}")
    return base, selfnorm


def all_methods_of_rows() -> tuple[str, ...]:
    """Every method name an index of stored rows answers somewhere (TracIn's trajectory indices aside)."""
    return tuple(n for n in all_methods() if REGISTRY[n.removesuffix(SELFNORM)].rows != "trajectory")


def row_methods() -> dict[str, dict[str, str]]:
    """Per row basis (manifest ``build.basis.kind``): method asked for → operation on the stored rows."""
    out: dict[str, dict[str, str]] = {"raw": {}, "kfac": {}, "ekfac": {}}
    for m in REGISTRY.values():
        for basis, op in m.row_bases.items():
            out.setdefault(basis, {})[m.name] = op
    return out


REBUILD_RAW = {"kfac": "--projection-basis raw", "ekfac": "--transcode none"}
"""Per row basis: the ``gradindex build`` option that stores raw rows instead."""


def row_base(base: str, basis: str = "raw", method: str | None = None) -> str:
    """The operation on stored rows that answers the base method ``base`` on an index whose rows are in
    ``basis`` (``method``: the name asked for, for the error).

    Raw rows (plain or Adam-preconditioned gradients): every method is itself. K-FAC-whitened rows
    (``--projection-basis kfac``): their plain inner product is K-FAC influence, so ``kfac`` is a
    dot product of rows and ``ekfac`` the EK-FAC fitted on them; ``graddot``/``cosine`` are refused
    (the rows are not raw gradients). Rows in the EK-FAC whitened eigenbasis (``gradindex compact
    --basis ekfac``): ``ekfac`` is their dot product.
    """
    return _row_base(base, basis, method, None)


def _row_base(base: str, basis: str, method: str | None, answers: Sequence[str] | None) -> str:
    tables = row_methods()
    table = tables.get(basis)
    if table is None:
        raise ValueError(f"row basis {basis!r} is not one of {list(tables)}; upgrade gradindex")
    if base not in table:
        raise ValueError(f"method {method or base!r} does not apply to this index: its rows are stored in the "
                         f"{basis!r} whitened basis, so plain inner products are {basis} influence, not {base}; "
                         f"use one of {', '.join(answers or sorted(table))} (or rebuild with "
                         f"{REBUILD_RAW.get(basis, '--transcode none')} for raw rows)")
    return table[base]


def index_row_base(manifest: dict, index_dir: str | os.PathLike, base: str, method: str | None = None) -> str:
    """:func:`row_base` on this index's rows; a refusal names every method the index answers
    (:func:`methods_of` with ``-selfnorm``), not only the operations on its rows."""
    basis = row_basis(manifest)
    try:
        return _row_base(base, basis, method, None)
    except ValueError:
        if basis not in row_methods():
            raise
        return _row_base(base, basis, method, methods_of(manifest, index_dir, selfnorm=True))


def fitted_methods(manifest: dict, index_dir: str | os.PathLike) -> list[str]:
    """Fitted methods the manifest registers whose file (``preconditioners[m]["file"]``) is on disk."""
    entries = manifest.get("preconditioners") or {}
    return [m.name for m in REGISTRY.values() if m.fitted and isinstance(entries.get(m.fitted), dict)
            and (Path(index_dir) / str(entries[m.fitted].get("file", ""))).is_file()]


def methods_of(manifest: dict, index_dir: str | os.PathLike, selfnorm: bool = False, rows: bool = False,
               app: str | None = None) -> list[str]:
    """Methods an index answers (the one answer to that question): those whose rows it holds and
    whose fit is on disk; with ``selfnorm`` their ``-selfnorm`` variants too; ``app``: only those
    usable there (:data:`APPS`).

    An index of Adam-preconditioned rows answers ``adam`` only; one whose rows are in a whitened
    basis answers the methods whose operation on its rows (:attr:`Method.row_bases`) is available
    (``rows=True``: the operations on the stored rows themselves, whatever their basis).
    """
    kind = "adam" if adam_rows(manifest) else "raw"
    fitted = set(fitted_methods(manifest, index_dir))
    out = [m.name for m in REGISTRY.values() if m.rows == kind and (m.fitted is None or m.name in fitted)]
    basis = row_basis(manifest)
    if basis != "raw" and not rows:
        table = row_methods().get(basis, {})
        out = [m for m in table if table[m] in out]
    if app is not None:
        out = [m for m in out if app in REGISTRY[m].apps]
    if selfnorm:
        out += [m + SELFNORM for m in out if REGISTRY[m].selfnorm]
    return out


PREFERRED_BY_APP = {"dedup": ("graddot", "ekfac", "kfac")}
"""Apps whose default differs from the ranks: dedup compares the gradients themselves first."""


def preferred(app: str | None = None) -> tuple[str, ...]:
    """Methods by :attr:`Method.rank` (those of rank < 100), the order a command picks from when given none."""
    if app in PREFERRED_BY_APP:
        return PREFERRED_BY_APP[app]
    ranked = sorted((m for m in REGISTRY.values() if m.rank < 100 and (app is None or app in m.apps)),
                    key=lambda m: m.rank)
    return tuple(m.name for m in ranked)


PREFERRED = preferred()
"""The method a command uses when none is given: the first one the index answers (EK-FAC kept the
most of leave-one-out quality in benchmarks/fidelity.py; docs/math.md)."""


def default_method(manifest: dict, index_dir: str | os.PathLike, prefer: Sequence[str] | None = None,
                   app: str | None = None) -> str:
    """The first method of ``prefer`` (default :func:`preferred`) the index answers (else the first it answers)."""
    answers = methods_of(manifest, index_dir, app=app)
    if not answers:
        raise ValueError(f"the index in {str(index_dir)!r} answers none of the methods usable here "
                         f"({', '.join(all_methods(app, selfnorm=False))})")
    return next((m for m in (prefer or preferred(app)) if m in answers), answers[0])
