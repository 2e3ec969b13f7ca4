"""What a row holds, as one factory-style string (as FAISS's ``index_factory`` names an index).

A spec is comma-separated tokens in this order (``str(RowSpec)`` writes this canonical form)::

    PROJECTION  none | P<k> | P<ka>x<kg> | auto[:<budget>][:<allocation>]
    [BASIS]     KFAC@<d>  whiten each side by its damped full-space K-FAC factor before projecting
                EIGEN@<d> the full-space EK-FAC eigen-coordinates the budget buys, whitened at damping d
    [ADAM]      ADAM | ADAM:factored   rows G ⊘ (√v + ε) from the training run's optimizer state
    [EKFAC@<d>] after the EK-FAC fit, the rows rewritten in its whitened eigenbasis at relative damping d
    CODE        fp32 | fp16 | int8 | int4 (left out: int4 for EK-FAC eigen-coordinates, else int8)

``<budget>`` is bytes per example (``65536``), a fraction of the full float32 gradient (``1/8``) or
``auto`` (1/8, at most 256 KiB); ``<allocation>`` is ``cost``, ``ratio``, ``equal`` or ``spectrum`` (left out:
:data:`DEFAULT_ALLOCATION`)
(:mod:`gradindex.capture.allocation`, which refuses a name it does not know).
Examples: ``auto,EKFAC@0.001,int4`` (what ``gradindex build`` stores with no options), ``P16x16,fp32``
(raw projected float32 rows), ``none,int8`` (exact gradients, int8 codes), ``auto:1/64,EIGEN@0.001,int4``.
The projection's random stream (kind, seed) is not part of a spec, as a seed is not part of a FAISS
factory string; it is recorded with the projection.

Every refusal of options that cannot go together is here (:meth:`RowSpec.check` for the rows,
:meth:`RowSpec.check_fit` for the fit and index stage that go with them); the store build, its resume
and the query compare the spec the manifest records. Stage 0: nothing here imports a pipeline stage.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction

DEFAULT_DAMPING = 1e-3
"""Relative damping of ``kfac``/``ekfac`` (a fraction of each layer's mean eigenvalue) unless one is given:
the default of every API and CLI option. Chosen from ``benchmarks/results/damping.json``: full-space
EK-FAC's LDS rises as the damping falls on all three corpora (0.1 → 0.001: +24%, +13%, +14%), the
default int4 codes keep 98-101% of it at every damping, and 0.001 holds 81-88% of the gain down to 1e-4."""
LEGACY_DAMPING = 0.1
"""The default before 0.2 (Kronfluence's ``0.1 × mean eigenvalue`` heuristic): what a record that names no
damping was written with."""


CODE_BITS = {"fp32": 32, "fp16": 16, "int8": 8, "int4": 4}
"""Bits per stored number of each row code (``gradindex.store.codes`` encodes them; a test keeps both equal)."""
SCALED = {"int8", "int4"}
"""Codes with one float32 scale per row and layer (``gradindex.store.codes.register_codec`` adds to both)."""
BASES = ("raw", "kfac", "eigen")
ADAM_MODES = ("exact", "factored")
DEFAULT_BUDGET_CAP = 256 << 10
"""``auto`` budget: 1/8 of the full float32 gradient, at most this many bytes per example."""
FLOAT32_BYTES = 4
DEFAULT_ALLOCATION = "cost"
"""How a budget is spread over layers unless the spec says: ``ratio``'s numbers per layer, split between its
sides for the cheapest capture (:mod:`gradindex.capture.allocation`)."""

_EIGEN_AS_IS = ("--projection-basis eigen stores whitened full-space EK-FAC coordinates, which answer --method "
                "ekfac as they are: use it with --precondition none --transcode none (and without --full-factors)")
_ADAM_PLAIN = ("--optimizer-state builds an index of Adam-preconditioned rows (method adam); K-FAC/EK-FAC are "
               "fitted on plain gradients: build those without it")
_PROJECTION = re.compile(r"^(?:none|P(\d+)(?:x(\d+))?|auto(?::([^:]+))?(?::([a-z]+))?)$")
_DAMPED = re.compile(r"^(KFAC|EIGEN|EKFAC)(?:@(.+))?$")


def parse_budget(budget: int | str, full_bytes: int | None) -> int:
    """Bytes per example: an integer (``65536``), a fraction of ``full_bytes`` (``"1/8"``, ``"0.125"``),
    or ``auto``: ``min(full_bytes / 8, 256 KiB)`` (int4 codes of the whole gradient where it is that small).
    ``full_bytes`` ``None``: the spelling is checked only (no model at hand: 0 is returned)."""
    full = 0 if full_bytes is None else full_bytes
    text = str(budget).strip()
    if text.lower() == "auto":
        return min(full // 8, DEFAULT_BUDGET_CAP)
    try:
        if "/" in text or "." in text:
            frac = Fraction(text)
            if not 0 < frac <= 1:
                raise ValueError
            return int(full * frac)
        value = int(text)
        if value <= 0:
            raise ValueError
        return value
    except (ValueError, ZeroDivisionError):
        size = "" if full_bytes is None else f" ({full_bytes} bytes here)"
        raise ValueError(f"budget {budget!r} is not understood; give bytes per example (e.g. 65536) or a fraction "
                         f"of the full float32 gradient{size}, e.g. 1/8") from None


def check_projection_options(projection: str, budget) -> bool:
    """Whether ``--projection`` is ``auto`` (sized by ``--budget``); refuses a budget with a fixed projection."""
    auto = str(projection).strip().lower() == "auto"
    if budget and not auto:
        raise ValueError(f"--budget sizes the projection per layer: use it with --projection auto, not {projection!r}")
    return auto


def _damping(text: str | None, default: float, token: str) -> float:
    if text is None:
        return default
    try:
        d = float(text)
    except ValueError:
        d = math.nan
    if not math.isfinite(d) or d <= 0:
        raise ValueError(f"row spec token {token!r}: the damping must be a positive number, e.g. {token.split('@')[0]}"
                         "@0.001")
    return d


@dataclass(frozen=True)
class RowSpec:
    """The typed form of a row spec (see the module): how a stored row is made from an example's gradient."""

    projection: str = "auto"
    """``auto`` (per-layer sizes bought by ``budget``), ``fixed`` (``k_a`` x ``k_g``) or ``none`` (exact)."""
    k_a: int = 0
    k_g: int = 0
    budget: str = "auto"
    """Bytes per example of an ``auto`` projection (a ``parse_budget`` form)."""
    allocation: str = DEFAULT_ALLOCATION
    """How the budget is spread (left out of the string when it is the build's default)."""
    basis: str = "raw"
    """``raw``, ``kfac`` (whitened before projecting, at ``basis_damping``) or ``eigen`` (at ``damping``)."""
    basis_damping: float = 1.0
    adam: str = ""
    """``""`` (plain gradients), ``exact`` or ``factored`` (Adam-preconditioned rows)."""
    transcode: bool = False
    """Rows rewritten in the EK-FAC whitened eigenbasis at ``damping`` after its fit."""
    damping: float = DEFAULT_DAMPING
    storage: str = "auto"

    def __post_init__(self) -> None:
        if self.storage == "auto":
            object.__setattr__(self, "storage", "int4" if self.transcode or self.basis == "eigen" else "int8")
        self.check()

    # -- the string form -------------------------------------------------------------------------
    @classmethod
    def parse(cls, text: str, damping: float = DEFAULT_DAMPING) -> RowSpec:
        """The spec ``text`` names; ``damping`` is the default of a ``KFAC``/``EIGEN``/``EKFAC`` token without
        ``@d``. One error naming the token and the grammar for anything else."""
        tokens = [t.strip() for t in str(text).split(",") if t.strip()]
        if not tokens:
            raise ValueError(f"row spec {text!r} is empty; e.g. auto,EKFAC@0.001,int4 or P16x16,fp32")
        m = _PROJECTION.match(tokens[0])
        if not m:
            raise ValueError(f"row spec {text!r}: {tokens[0]!r} is not a projection; start with none, P16, P16x8 "
                             "or auto[:BUDGET][:ALLOCATION] (docs/formats.md, 'Row specs')")
        fields: dict = {}
        if tokens[0] == "none":
            fields["projection"] = "none"
        elif m.group(1):
            fields.update(projection="fixed", k_a=int(m.group(1)), k_g=int(m.group(2) or m.group(1)))
        else:
            fields.update(projection="auto", budget=m.group(3) or "auto",
                          allocation=m.group(4) or DEFAULT_ALLOCATION)
        for token in tokens[1:]:
            cls._token(token, fields, damping, text)
        return cls(**fields)

    @staticmethod
    def _token(token: str, fields: dict, damping: float, text: str) -> None:
        """Set the fields one token after the projection names (in the canonical order)."""
        order = ("basis", "adam", "transcode", "storage")
        m = _DAMPED.match(token)
        if m and m.group(1) in ("KFAC", "EIGEN"):
            key, value = "basis", m.group(1).lower()
            d = _damping(m.group(2), 1.0 if value == "kfac" else damping, token)
            fields.update({"basis_damping": d} if value == "kfac" else {"damping": d})
        elif m:
            key, value = "transcode", True
            fields["damping"] = _damping(m.group(2), damping, token)
        elif token in ("ADAM", "ADAM:exact", "ADAM:factored"):
            key, value = "adam", token.partition(":")[2] or "exact"
        elif token in CODE_BITS:
            key, value = "storage", token
        else:
            raise ValueError(f"row spec {text!r}: {token!r} is not understood; after the projection come "
                             f"KFAC@d or EIGEN@d, ADAM[:factored], EKFAC@d and a code ({', '.join(CODE_BITS)})")
        later = [k for k in order[order.index(key):] if k in fields]
        if later:
            raise ValueError(f"row spec {text!r}: {token!r} comes too late or twice; the order is projection, "
                             "basis, ADAM, EKFAC, code (e.g. auto,EKFAC@0.001,int4)")
        fields[key] = value

    def __str__(self) -> str:
        if self.projection == "none":
            parts = ["none"]
        elif self.projection == "fixed":
            parts = [f"P{self.k_a}" if self.k_a == self.k_g else f"P{self.k_a}x{self.k_g}"]
        else:
            tail = "" if self.allocation == DEFAULT_ALLOCATION else f":{self.allocation}"
            parts = [f"auto:{self.budget}{tail}" if self.budget != "auto" or tail else "auto"]
        if self.basis == "kfac":
            parts.append(f"KFAC@{self.basis_damping:g}")
        elif self.basis == "eigen":
            parts.append(f"EIGEN@{self.damping:g}")
        if self.adam:
            parts.append("ADAM" if self.adam == "exact" else f"ADAM:{self.adam}")
        if self.transcode:
            parts.append(f"EKFAC@{self.damping:g}")
        return ",".join([*parts, self.storage])

    # -- what the spec means ---------------------------------------------------------------------
    def check(self) -> None:
        """Refuse rows that cannot be made (each message names the option or token to change)."""
        if self.projection not in ("auto", "fixed", "none"):
            raise ValueError(f"projection {self.projection!r} is not one of auto, fixed, none")
        if self.projection == "fixed" and (self.k_a < 1 or self.k_g < 1):
            raise ValueError(f"projection sizes must be positive, got {self.k_a}x{self.k_g}")
        if self.storage not in CODE_BITS:
            raise ValueError(f"storage {self.storage!r} is not one of {list(CODE_BITS)}")
        if self.basis not in BASES:
            raise ValueError(f"build basis {self.basis!r} is not one of {list(BASES)} "
                             "(the ekfac basis is a transcode after a fit: `gradindex compact`)")
        if self.projection == "auto":
            parse_budget(self.budget, None)  # (refuses a budget that is no number, fraction or auto)
        if self.adam and self.adam not in ADAM_MODES:
            raise ValueError(f"adam mode {self.adam!r} is not one of {list(ADAM_MODES)}")
        if self.basis == "eigen" and self.projection != "auto":
            raise ValueError("--projection-basis eigen chooses what to store from --budget: use --projection auto")
        if self.basis == "eigen" and self.transcode:
            raise ValueError(_EIGEN_AS_IS)
        if self.allocation == "spectrum" and self.basis != "kfac":
            raise ValueError("allocation by spectrum needs the full-space factors: add --projection-basis kfac")
        if self.transcode and self.basis != "raw":
            raise ValueError("--transcode ekfac rotates raw rows; with --projection-basis kfac use --transcode none")
        if self.adam and self.basis != "raw":
            raise ValueError("--optimizer-state builds an index of Adam-preconditioned rows (method adam); "
                             "the kfac basis whitens plain gradients: use --projection-basis raw with it")
        if self.adam and self.transcode:
            raise ValueError(_ADAM_PLAIN)

    def check_fit(self, precondition: str, collect_covariance: bool = False, full_factors: bool = False) -> None:
        """Refuse a fit that does not go with these rows (``precondition``: ``none``, ``kfac`` or ``ekfac``)."""
        if self.basis == "eigen" and (precondition != "none" or collect_covariance or full_factors):
            raise ValueError(_EIGEN_AS_IS)
        if self.adam and (precondition != "none" or collect_covariance):
            raise ValueError(_ADAM_PLAIN)
        if self.transcode and precondition != "ekfac":
            raise ValueError("rows are transcoded into the EK-FAC eigenbasis after an EK-FAC fit: add "
                             "--precondition ekfac, or --transcode none")

    def check_whiten(self, whiten: str, precondition: str) -> None:
        """Refuse a FAISS ``--whiten`` that does not apply to these rows."""
        if whiten != "none" and (self.transcode or self.basis == "eigen"):
            raise ValueError(f"--whiten {whiten} does not apply: the rows are in the EK-FAC whitened "
                             "eigenbasis (already whitened); drop --whiten, or add --transcode none")
        if whiten not in ("none", precondition, "kfac" if precondition == "ekfac" else "none"):
            raise ValueError(f"--whiten {whiten} needs that preconditioner: add --precondition {whiten}")

    @property
    def capture_storage(self) -> str:
        """Codes of the captured rows: ``storage``, or float16 when they are transcoded afterwards."""
        return "fp16" if self.transcode else self.storage

    def describe(self) -> str:
        """One line in words: what a stored row holds."""
        what = {"none": "the exact gradient",
                "fixed": f"a {self.k_a}x{self.k_g} factored projection of the gradient",
                "auto": f"per-layer projections bought by a budget of {self.budget} per example "
                        f"({self.allocation} allocation)"}[self.projection]
        if self.basis == "kfac":
            what += f", each side whitened by its full-space K-FAC factor (damping {self.basis_damping:g})"
        elif self.basis == "eigen":
            what = (f"the full-space EK-FAC eigen-coordinates a budget of {self.budget} per example buys, "
                    f"whitened at damping {self.damping:g}")
        if self.adam:
            what += f", divided by Adam's sqrt(v) + eps ({self.adam})"
        if self.transcode:
            what += f", rewritten in the EK-FAC whitened eigenbasis at damping {self.damping:g}"
        scale = " with a float32 scale per row and layer" if self.storage in SCALED else ""
        return f"{what}; stored as {self.storage}{scale}"

    def numbers(self, shapes: Mapping[str, tuple[int, int]]) -> int | None:
        """Numbers per example over layers of ``(n_in, n_out)`` shapes; None for ``auto`` (the allocation's)."""
        if self.projection == "none":
            return sum(n_in * n_out for n_in, n_out in shapes.values())
        if self.projection == "fixed":
            return len(shapes) * self.k_a * self.k_g
        return None

    def bytes_per_example(self, shapes: Mapping[str, tuple[int, int]]) -> int:
        """Bytes one example's rows take over layers of ``(n_in, n_out)`` shapes, codes plus scales; for an
        ``auto`` projection, the budget (the allocation spends up to it, never more)."""
        if self.projection == "auto":
            full = FLOAT32_BYTES * sum(n_in * n_out for n_in, n_out in shapes.values())
            return parse_budget(self.budget, full)
        bits = CODE_BITS[self.storage]
        per_layer = {"none": lambda s: s[0] * s[1], "fixed": lambda s: self.k_a * self.k_g}[self.projection]
        scale = 4 if self.storage in SCALED else 0
        return sum(math.ceil(per_layer(s) * bits / 8) + scale for s in shapes.values())



DEFAULT_SPEC = "auto,EKFAC@0.001,int4"
"""What ``gradindex build`` stores with no options (``str(BuildConfig().rows)``; a test keeps them equal)."""
