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
(:func:`fallback_note`) rather than fail; a method asked for by name is never replaced.
"""

from __future__ import annotations

import os

from gradindex.methods import REGISTRY, SELFNORM, default_method

SELFNORM_BY_DEFAULT = frozenset({"ekfac"})
"""Base methods a query given no method answers with in their ``-selfnorm`` form."""

UNAVAILABLE = (ValueError, OSError, KeyError)
"""What a self-influence that cannot be had raises (no rows to compute it from, a file that does not read)."""


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
