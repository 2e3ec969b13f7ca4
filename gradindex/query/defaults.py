"""The method a query answers with when none is given: ``ekfac-selfnorm`` where the index answers ``ekfac``.

:func:`gradindex.methods.default_method` picks the index's base method (``ekfac`` where it is fitted, else
``kfac``, ``adam``, ``graddot``); a *query* (``QueryEngine``, ``score_matrix``, ``gradindex query``, ``gradindex
serve``) then answers with that method's self-normalized form where :data:`SELFNORM_BY_DEFAULT` names it: the
score divided by ``sqrt`` of the training example's self-influence. The commands built on the base method itself
keep it: ``outliers`` and the audit report rank by the self-influence, ``explain`` splits a score linear in both
gradients, ``dedup`` compares gradients.

Why (issue 31): on a real LoRA fine-tune (SmolLM2-135M-Instruct, docs/real-llm.md) ``ekfac-selfnorm`` raised the
halves LDS from 0.323 to 0.406 and put 7 of 12 planted facts' sources first against 5 to 6 (MRR among 1,000
examples 0.74 against 0.49); on the toy corpora of ``benchmarks/fidelity.py`` the two are level
(docs/quality.md, "The default query method").

Where the self-influence cannot be had, the engine answers with the base method and says so in the result's notes
(:func:`fallback_note`) rather than fail, unless the cause is damage (:data:`DAMAGE`); a method asked for by name
is never replaced.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gradindex.checksum import DamagedIndexError
from gradindex.errors import CorruptFileError
from gradindex.methods import (
    DEFAULT_DAMPING,
    REBUILD_RAW,
    REGISTRY,
    SELFNORM,
    default_method,
    index_row_base,
    parse_method,
)

log = logging.getLogger("gradindex")

SELFNORM_BY_DEFAULT = frozenset({"ekfac"})
"""Base methods a query given no method answers with in their ``-selfnorm`` form."""

UNAVAILABLE = (ValueError, OSError, KeyError)
"""What a self-influence that cannot be had raises (no rows to compute it from, a file that does not read)."""

DAMAGE = (DamagedIndexError, CorruptFileError)
"""Of :data:`UNAVAILABLE`, what the default method never falls back from: a file that does not match its recorded
hash or does not read is the index's damage, refused with its repair (as ``outliers`` and ``split`` refuse it), and
``serve``'s health turns to damaged."""


def query_method(base: str) -> str:
    """``<base>-selfnorm`` for a base method of :data:`SELFNORM_BY_DEFAULT` (one with a self-influence), else
    ``base``: what a query answers with when ``base`` is the index's default."""
    spec = REGISTRY.get(base)
    return base + SELFNORM if base in SELFNORM_BY_DEFAULT and spec is not None and spec.selfnorm else base


def default_query_method(manifest: dict, index_dir: str | os.PathLike) -> str:
    """The method a query uses on this index when none is given: :func:`query_method` of the index's
    :func:`~gradindex.methods.default_method` (``ekfac-selfnorm`` where it answers ``ekfac``)."""
    return query_method(default_method(manifest, index_dir))


def fallback_note(method: str, base: str, exc: BaseException) -> str:
    """The note of a query whose default ``method`` fell back to ``base`` because the self-influence failed."""
    return (f"the default method {method} divides by the training examples' self-influence, which this index "
            f"cannot give ({exc}); these are plain {base} scores (ask for --method {base} to skip this note)")


def check_damping(damping: float) -> None:
    """Refuse a damping that is not a finite number > 0 (``inf`` would answer all-zero scores)."""
    if not (isinstance(damping, int | float) and math.isfinite(damping) and damping > 0):
        raise ValueError(f"damping must be a finite number > 0 (a fraction of each layer's mean eigenvalue, "
                         f"e.g. {DEFAULT_DAMPING:g}), got {damping!r}")


def baked_note(basis, base: str, damping: float) -> str | None:
    """The note of a ``damping`` that is not the one behind ``base``'s scores on rows of ``basis`` (rows whitened at
    build bake theirs in: :meth:`RowBasis.damping_used`); ``None`` where the query's damping is the one used."""
    used = basis.damping_used(base, damping)
    if used is None or used == damping:
        return None
    raw = REBUILD_RAW.get(basis.kind, "--transcode none")
    return (f"the rows of this index bake in damping {used:g} (whitened at build; a query's damping does not "
            f"change them): damping {damping:g} has no effect on --method {base} here (build with {raw} to "
            "choose the damping per query)")


def selfnorm_scale(si: np.ndarray) -> np.ndarray:
    """The ``-selfnorm`` factor of each example's score: ``1/sqrt(si)``, 0 for none (an all-zero row)."""
    return np.where(si > 0, 1.0 / np.sqrt(np.where(si > 0, si, 1.0)), 0.0)


def self_influence_or_note(ix, method: str, parsed: tuple[str, bool], defaulted: bool, base: str, damping: float,
                           layers: Sequence[str]) -> tuple[np.ndarray | None, str | None]:
    """``(si, None)``: the ``[N]`` self-influence a ``-selfnorm`` ``method`` divides by (``None`` for another);
    ``(None, note)`` where the ``defaulted`` method cannot have it (:func:`fallback_note`; one asked for raises)."""
    name, selfnorm = parsed  # (parse_method(method), parsed once a call)
    if not selfnorm:
        return None, None
    try:
        return ix.self_influence(base, damping, list(layers)), None
    except UNAVAILABLE as exc:
        if not defaulted or isinstance(exc, DAMAGE):  # a damaged index is refused, not answered around
            raise
        return None, fallback_note(method, name, exc)


@dataclass
class Answer:
    """How a query is answered: ``method`` (after the default's fallback), the base named (``asked``), the operation
    on stored rows (``base``), the damping ``used``, the ``-selfnorm`` ``scale`` and every result's ``notes``."""

    method: str
    asked: str
    base: str
    used: float | None
    scale: np.ndarray | None
    notes: list[str]


def answer_for(ix, method: str | None, damping: float, layers: Sequence[str], log_notes: bool = True) -> Answer:
    """The :class:`Answer` of ``method`` (``None``: the default query method) on the open index ``ix``. ``log_notes``
    (a query's: its notes reach the caller on the results): the last note logged at info level; else the default's
    fallback is logged as a warning (an array of scores has no notes)."""
    defaulted, method = method is None, method or default_query_method(ix.manifest, ix.dir)
    asked, selfnorm = parse_method(method)
    base = index_row_base(ix.manifest, ix.dir, asked, method)  # the operation on stored rows
    ix.pre.check(base, selfnorm)
    notes = [note for note in [baked_note(ix.basis, asked, damping)] if note]
    si, fell = self_influence_or_note(ix, method, (asked, selfnorm), defaulted, base, damping, layers)
    if fell:
        notes.append(fell)
        method = asked
        if not log_notes:  # (an array of scores: the log is the only place it is said)
            log.warning(fell)
    if notes and log_notes:
        log.info(notes[-1])
    scale = None if si is None else selfnorm_scale(si)
    return Answer(method, asked, base, ix.basis.damping_used(asked, damping), scale, notes)
