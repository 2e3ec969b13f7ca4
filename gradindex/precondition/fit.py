"""Fit K-FAC / EK-FAC on an index: factors → eigenbases → store pass(es) → ``precond/*.h5``.

Cost: the factors come from the build pass when it collected them (``--precondition`` at build
time), else from one model pass; then one pass over the store for K-FAC (self-influence, and the
GradDot norms), and a second one for EK-FAC (its self-influence needs the finished ``Λ*``).
An EK-FAC fit also writes K-FAC, which the first store pass yields at no extra cost.
With ``fisher='true'`` the factors and the EK-FAC correction come from labels sampled from the
model: one model pass for ``A`` and ``S`` and, for EK-FAC, a second for ``Λ*``
(:mod:`gradindex.precondition.fisher`); the store passes then only write self-influence.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

import gradindex
from gradindex.capture import ProjectionSpec
from gradindex.capture.sampling import FISHERS
from gradindex.data import Tokenized
from gradindex.distributed import SOLO, Team
from gradindex.lock import index_lock
from gradindex.methods import DEFAULT_DAMPING, adam_rows, names
from gradindex.model import resolve_device
from gradindex.precondition.apply import absolute_damping, eigen_power, eigendecompose, kfac_eigenvalues
from gradindex.precondition.curvature import Curvature, FitJob, curvature_of
from gradindex.precondition.ekfac import Basis, store_pass
from gradindex.precondition.factors import (
    FactorSums,
    data_fingerprint,
    load_build_data,
    load_build_model,
    model_covariance,
    projection_from_manifest,
    sample_rows,
    store_covariance,
)
from gradindex.precondition.files import PRECOND_DIR, LayerFactors, precond_path, write_precond
from gradindex.precondition.fisher import model_correction
from gradindex.precondition.fullspace import fit_full_space
from gradindex.spec.build import batch_size_of
from gradindex.spec.manifest import Manifest, baked_damping, build_command, row_basis, write_manifest
from gradindex.store import Store
from gradindex.store.basis import capture_transforms, index_basis
from gradindex.store.opened import OpenStore

log = logging.getLogger("gradindex")
PRECISIONS = {"float64": torch.float64, "float32": torch.float32, "auto": None}
AUTO_FLOAT32_NUMBERS = 1 << 12
"""``precision="auto"``: a layer whose stored matrix has more numbers than this (64 x 64) is rotated in
float32 (the store passes' cost, ``k_g k_a (k_g + k_a)`` per row, is there: float32 is 1.5-3× faster;
``Λ*`` and the self-influence then differ from the float64 ones by round-off, ~1e-7 relative, tested
against the dense float64 reference), the narrower ones in float64."""
FITTED_ON = ("model_fingerprint", "data_fingerprint", "projection")
SPACES = ("stored", "full")
FULL_SPACE_FISHER = ("--fisher true is the stored-space fit's: the full-space fit (precondition --space full, build "
                     "--rerank-fit) takes the empirical Fisher of its own passes' gradients; drop --fisher true, or "
                     "fit the stored space (--space stored)")
"""The refusal of a true-Fisher full-space fit (its passes sum the observed labels' gradients only)."""


@dataclass(frozen=True)
class FitConfig:
    """Settings of a preconditioner fit; stored in the manifest under ``preconditioners``."""

    method: str = "kfac"
    """A fitted method (``kfac``, ``ekfac``: an EK-FAC fit writes K-FAC too, from one store pass)."""
    damping: float = DEFAULT_DAMPING
    """Relative damping of the self-influence written with the fit (queries pick their own)."""
    fit_data: str = ""
    """Fit the factors on this data file instead of the indexed data (costs a model pass)."""
    fit_examples: int = 0
    """Fit the factors on a random sample of this many examples; 0 = all (a sample costs a model pass)."""
    seed: int = 0
    """Seed of that sample, and of the sampled labels of the true Fisher."""
    fisher: str = "empirical"
    """``empirical``: factors (and the EK-FAC correction) from the observed labels; ``true``: from
    labels sampled from the model (Kronfluence's default; one or two model passes)."""
    device: str = "auto"
    """Where the model pass and the store passes run (``auto``: the GPU when there is one)."""
    precision: str = "auto"
    """Arithmetic of the store passes' rotations (sums are float64 either way): ``float64``, ``float32``
    (2-2.4× faster on wide layers; round-off ~1e-7 relative) or ``auto``: float32 for the layers whose
    rows have more than :data:`AUTO_FLOAT32_NUMBERS` numbers, float64 for the others."""
    block: int = 1024
    """Rows per block of the store passes (capped so a block stays under 256 MiB)."""
    space: str = "stored"
    """``stored``: curvature of the store's rows (projected or not); ``full``: full-space (unprojected)
    factors and EK-FAC correction from two model passes (:mod:`gradindex.precondition.fullspace`),
    for full-space re-ranking, beside the stored-space fit."""
    correction_examples: int = 0
    """Full space only: EK-FAC's correction ``Λ*`` from a seeded sample (``seed``) of this many of the fit
    examples, the factors from all of them; 0 = all. The correction pass costs about a forward + backward
    per example; 128 of 1,024 kept top-10 0.97-0.98 of the exact scores (benchmarks/correction_sample.py)."""

    def __post_init__(self) -> None:
        if self.method not in names("fitted"):
            raise ValueError(f"--method {self.method!r} is not one of {list(names('fitted'))}")
        if not self.damping > 0:
            raise ValueError(
                f"--damping must be > 0 (a fraction of the mean eigenvalue, e.g. {DEFAULT_DAMPING}), got {self.damping}"
            )
        if self.space not in SPACES:
            raise ValueError(f"--space {self.space!r} is not one of {list(SPACES)}")
        if self.fisher not in FISHERS:
            raise ValueError(f"--fisher {self.fisher!r} is not one of {list(FISHERS)}")
        if self.space == "full" and self.fisher != "empirical":
            raise ValueError(FULL_SPACE_FISHER)
        if self.precision not in PRECISIONS:
            raise ValueError(f"--precision {self.precision!r} is not one of {list(PRECISIONS)}")
        if self.correction_examples < 0 or self.correction_examples and self.space != "full":
            raise ValueError(f"--correction-examples {self.correction_examples}: a number of examples >= 0, "
                             "for the full-space fit only (--space full)")


def layer_dtypes(precision: str, shapes: dict[str, tuple[int, int]]) -> dict[str, torch.dtype]:
    """layer → the dtype of its store-pass rotations under ``precision`` (see :data:`AUTO_FLOAT32_NUMBERS`)."""
    if precision != "auto":
        return {n: PRECISIONS[precision] for n in shapes}
    return {n: torch.float32 if r * c > AUTO_FLOAT32_NUMBERS else torch.float64 for n, (r, c) in shapes.items()}


def fit_preconditioner(
    index_dir: str | os.PathLike,
    cfg: FitConfig = FitConfig(),
    model: torch.nn.Module | None = None,
    tokenizer=None,
    data: Tokenized | None = None,
    progress: bool = False,
    manifest: dict | None = None,
    heads=None,
) -> dict:
    """Fit ``cfg.method`` on the index in ``index_dir``; return the manifest's ``preconditioners``.

    ``model``/``tokenizer``/``data`` (the build's own, already loaded) spare reloading them when a
    model pass is needed; otherwise they are loaded from the manifest and fingerprint-checked.
    ``cfg.space == 'full'`` fits full-space curvature instead and returns the manifest's ``full_space``.
    ``manifest``: the index's, when the caller holds it (the pipeline): it is used instead of
    reading the file, and updated in place with the new entries before it is written.
    ``heads``: the capture's :class:`~gradindex.precondition.fullspace.HeadGrads` (full space only).
    """
    space = " --space full" if cfg.space == "full" else ""
    with index_lock(index_dir, f"gradindex precondition --method {cfg.method}{space}"):
        if cfg.space == "full":
            return fit_full_space(index_dir, cfg, model, tokenizer, data, progress, heads=heads, manifest=manifest)
        return _fit(index_dir, cfg, model, tokenizer, data, progress, manifest)


def _fit(index_dir, cfg: FitConfig, model, tokenizer, data, progress: bool, manifest: dict | None) -> dict:
    t0 = time.perf_counter()
    with fit_store(index_dir, manifest) as ix:
        fitted = store_fit(ix, cfg, model, tokenizer, data, progress)
    return register_fits(ix.dir, cfg, ix.manifest, fitted, time.perf_counter() - t0)


def fit_store(index_dir, manifest: dict | None, full_check: bool = True) -> OpenStore:
    """The index opened for a fit: with the caller's complete manifest (updated in place by
    :func:`register_fits`) or the file's, the store's whole-file hashes checked (``full_check``; else the
    sampled check, as a resumed build does); refuse rows that cannot be fitted (already whitened, or
    Adam-preconditioned)."""
    held = manifest is not None and manifest.get("status") == "complete"
    ix = OpenStore(index_dir, manifest if held else None, "fit", full=full_check)
    manifest = ix.manifest
    if row_basis(manifest) == "ekfac":  # a refit would not change the rows (whitened by the fit they came from)
        at = baked_damping(manifest)
        raise ValueError(f"the rows of {str(index_dir)!r} are already in the EK-FAC whitened eigenbasis (damping "
                         f"{at}) and answer --method ekfac "
                         "as they are; to fit again (other data, --fisher true, damping), build the index with "
                         "--transcode none, fit it, then `gradindex compact` it")
    if adam_rows(manifest):
        raise ValueError(f"the rows of {str(index_dir)!r} are Adam-preconditioned (built with --optimizer-state) "
                         "and answer --method adam as they are; K-FAC/EK-FAC are fitted on an index of plain "
                         "gradients: build one without --optimizer-state")
    return ix


@dataclass
class StoreFit:
    """What a fit computed: ``written`` method → (factors, ``[N, L]`` self-influence or None), the fit's record."""

    written: dict
    fit: dict
    layers: list[str]


def store_fit(ix: OpenStore, cfg: FitConfig, model, tokenizer, data, progress: bool, **options) -> StoreFit:
    """Fit ``cfg.method``'s :class:`Curvature` on the rows of the index opened by :func:`fit_store` (``options``:
    to its fit, e.g. :meth:`KFAC.fit`); write every method's file whose self-influence is known."""
    store, shapes, manifest = ix.store, ix.shapes, ix.manifest
    if set(store.layers) != set(shapes) or len(store) != ix.described.examples:
        raise ValueError(f"the store in {str(ix.dir)!r} does not match its manifest; recompute it with "
                         f"`{build_command(ix.dir, manifest)}`")
    job = FitJob(ix.dir, cfg, manifest, store, list(shapes), shapes, resolve_device(cfg.device), model, tokenizer,
                 data, progress)
    written, fit = curvature_of(cfg.method).fit(job, **options)
    for m, (fac, si) in written.items():
        if si is not None and options.get("team", SOLO).lead:  # (a team's rows meet on its lead)
            keys = curvature_of(m).write_keys if fac is not None else ()
            write_precond(precond_path(ix.dir, m), m, manifest, job.layers, fac, si, cfg.damping, fit, keys)
    return StoreFit(written, fit, job.layers)


class KFAC(Curvature):
    """K-FAC: ``S ⊗ A`` from the token-mean factors, diagonal in ``Q_S ⊗ Q_A`` with ``Λ = λ_S λ_Aᵀ``."""

    keys = ("Q_S", "Q_A", "Lambda")
    write_keys = ("A", "S", "lambda_A", "Q_A", "lambda_S", "Q_S", "Lambda")
    corrects = False  # (EK-FAC: the first store pass sums Λ*)

    @classmethod
    def fit(cls, job: FitJob, ekfac_self_influence: bool = True, spill=None,
            sample_correction: bool = False, team: Team = SOLO) -> tuple[dict, dict]:
        """Factors → eigenbases → one store pass (K-FAC self-influence, ``Λ*``, ``‖Ĝ‖²``), then :meth:`refit`.
        ``ekfac_self_influence`` False: neither EK-FAC's second pass nor ``‖Ĝ‖²`` (the fused transcode computes its
        self-influence from the rows it rotates: :mod:`gradindex.precondition.fused`); ``spill`` (a
        :class:`~gradindex.precondition.rotated.RotatedRows`) keeps the first pass's rotated rows for it;
        ``sample_correction``: ``Λ*`` from the rows of ``cfg.fit_examples``'s sample only (a sampled build's fit);
        ``team``: the ranks sharing the store pass (the lead fits the factors, from the build pass's sums only)."""
        cfg, store, layers, shapes = job.cfg, job.store, job.layers, job.shapes

        def factors_of() -> tuple:
            sums, fit, mp = _factor_sums(job.manifest, store, layers, cfg, job.model, job.tokenizer, job.data,
                                         job.device, job.progress)
            return _eigen_factors(sums, layers, shapes), fit, mp if team.size == 1 else None

        factors, fit, mp = team.on_lead(factors_of)
        kw = dict(device=job.device, dtype=layer_dtypes(cfg.precision, shapes), block=cfg.block,
                  progress=job.progress)
        fit_rows = store.positions(np.asarray(mp.rows, np.int64)) if sample_correction and mp is not None else None
        first = store_pass(store, layers, shapes, _bases(factors, cfg.damping),
                           correct=cls.corrects and cfg.fisher == "empirical", desc="store pass (kfac)", spill=spill,
                           norms=ekfac_self_influence, fit_rows=fit_rows, team=team, **kw)
        written = {"kfac": (factors, first.self_influence), "graddot": (None, first.sq_norms)}
        written.update(cls.refit(job, factors, first, mp, kw if ekfac_self_influence else None))
        fit["finite_examples"] = first.n_finite
        if not ekfac_self_influence:
            written.pop("graddot")  # (the fused transcode replaces the raw rows these norms are of)
        return written, fit

    @classmethod
    def refit(cls, job: FitJob, factors: dict, first, mp, kw: dict | None) -> dict:
        """More methods fitted from the first pass (K-FAC: none)."""
        return {}

    @staticmethod
    def power(x, tensors, delta, power):
        return eigen_power(x, *tensors, delta, power)

    @classmethod
    def self_influence(cls, P, store, layers, damping, device, block):
        c = P.curvature
        bases = {n: Basis(c[n]["Q_S"], c[n]["Q_A"], c[n]["Lambda"], P.delta(n, damping)) for n in layers}
        return store_pass(store, layers, P.shapes, bases, device=device, dtype=torch.float64,
                          block=block).self_influence


class EKFAC(KFAC):
    """EK-FAC: K-FAC's eigenbasis with the eigenvalues ``Λ*`` refitted on the rows (its fit writes K-FAC too)."""

    corrects = True

    @classmethod
    def refit(cls, job: FitJob, factors: dict, first, mp, kw: dict | None) -> dict:
        """``Λ*`` (the first pass's, or from sampled labels: ``fisher='true'``), and with ``kw`` a second store
        pass for its self-influence (it needs the finished ``Λ*``)."""
        cfg = job.cfg
        corrected = first.corrected if cfg.fisher == "empirical" else model_correction(
            mp.model, mp.tokenizer, mp.data, mp.rows, job.layers, mp.projection, _bases(factors, cfg.damping),
            cfg.seed, mp.batch_size, mp.route, layer_dtypes(cfg.precision, job.shapes), job.progress, mp.transforms)
        ek = {n: LayerFactors(**{**asdict(f), "Lambda": corrected[n]}) for n, f in factors.items()}
        si = None if kw is None else store_pass(job.store, job.layers, job.shapes, _bases(ek, cfg.damping),
                                               desc="store pass (ekfac)", **kw).self_influence
        return {"ekfac": (ek, si)}


def _bases(factors: dict[str, LayerFactors], damping: float) -> dict[str, Basis]:
    """layer → the store pass's :class:`Basis` of fitted factors at relative ``damping``."""
    return {n: Basis(f.Q_S, f.Q_A, f.Lambda, absolute_damping(damping, f.Lambda)) for n, f in factors.items()}


def _eigen_factors(sums: FactorSums, layers: list[str], shapes: dict) -> dict[str, LayerFactors]:
    """Per layer: the token-mean factors checked against the rows' shape, and their eigendecompositions."""
    factors = {}
    for n, (A, S, tokens) in sums.means(layers).items():
        k_g, k_a = shapes[n]
        if A.shape != (k_a, k_a) or S.shape != (k_g, k_g):
            raise ValueError(
                f"factors of {n!r} have shapes {A.shape}, {S.shape}; the store's rows are [{k_g}, {k_a}]"
            )
        if not (np.isfinite(A).all() and np.isfinite(S).all()):
            raise ValueError(
                f"the covariance factors of layer {n!r} are not finite; some examples have "
                "non-finite activations or gradients (see manifest 'nonfinite_ids')"
            )
        lam_A, Q_A = eigendecompose(A)
        lam_S, Q_S = eigendecompose(S)
        factors[n] = LayerFactors(A, S, lam_A, Q_A, lam_S, Q_S, kfac_eigenvalues(lam_S, lam_A), tokens, sums.examples)
    return factors


def register_fits(index_dir, cfg: FitConfig, manifest: dict, fitted: StoreFit, seconds: float) -> dict:
    """Record the fitted methods in ``index_dir``'s manifest (the caller's, under the index's lock: updated in
    place and written); return its ``preconditioners``."""
    entries = manifest.setdefault("preconditioners", {})
    for m in fitted.written:
        if m == "graddot":
            continue
        entries[m] = {
            "file": f"{PRECOND_DIR}/{m}.h5",
            "damping": cfg.damping,
            "fit": fitted.fit,
            "config": asdict(cfg),
            "fitted_on": {k: Manifest(manifest).build[k] for k in FITTED_ON},
            "seconds": round(seconds, 3),
            "library_version": gradindex.__version__,
        }
    write_manifest(index_dir, manifest)
    log.info(
        "fitted %s on %s in %.1f s (%s)",
        "+".join(m for m in fitted.written if m != "graddot"),
        index_dir,
        seconds,
        fitted.fit["source"],
    )
    return entries


@dataclass
class _ModelPass:
    """What a factor pass over the model ran on, for a second pass over the same rows."""

    model: torch.nn.Module
    tokenizer: object
    data: Tokenized
    rows: list[int]
    projection: ProjectionSpec
    batch_size: int
    route: str
    transforms: dict | None = None


def _factor_sums(
    manifest: dict,
    store: Store,
    layers: list[str],
    cfg: FitConfig,
    model,
    tokenizer,
    data: Tokenized | None,
    device: torch.device,
    progress: bool,
) -> tuple[FactorSums, dict, _ModelPass | None]:
    """Token sums of ``A`` and ``S``: from the build's covariance groups, else one model pass (returned)."""
    proj: ProjectionSpec = projection_from_manifest(manifest)
    transforms = capture_transforms(index_basis(store.dir.parent, manifest))
    bs, route = batch_size_of(manifest), Manifest(manifest).config.get("route", "auto")
    skip = set(manifest.get("nonfinite_ids", []))
    mp = None

    def need_model():
        nonlocal model, tokenizer
        if model is None or tokenizer is None:
            model, tokenizer = load_build_model(manifest, str(device))
        return model, tokenizer

    def model_pass(m, tok, fdata: Tokenized, rows) -> FactorSums:
        return model_covariance(m, tok, fdata, rows, layers, proj, bs, route, progress, transforms, cfg.fisher,
                                cfg.seed)

    if cfg.fit_data or cfg.fit_examples > 0 or cfg.fisher == "true":
        m, tok = need_model()
        if cfg.fit_data:
            fdata = load_build_data(manifest, tok, str(Path(cfg.fit_data)), check=False)
            rows = sample_rows(len(fdata), cfg.fit_examples, cfg.seed)
        else:
            fdata = data if data is not None else load_build_data(manifest, tok)
            rows = [r for r in sample_rows(len(fdata), cfg.fit_examples, cfg.seed) if r not in skip]
        sums = model_pass(m, tok, fdata, rows)
        fit = {
            "source": "model pass",
            "data": cfg.fit_data or manifest.get("data_id", ""),
            "data_fingerprint": data_fingerprint(fdata),
            "examples": len(rows),
            "sample_seed": cfg.seed,
        }
        mp = _ModelPass(m, tok, fdata, [int(r) for r in rows], proj, bs, route, transforms)
    else:
        sums, fit = _build_pass_sums(manifest, store, layers, data, skip, need_model, model_pass)
    fit["fisher"] = cfg.fisher
    if cfg.fisher == "true":
        fit["fisher_seed"] = cfg.seed
    fit["tokens"] = {n: int(sums.tokens.get(n, 0)) for n in layers}
    # K-FAC of per-example gradients ≈ (tokens per example) × S ⊗ A; kept for reading magnitudes.
    fit["tokens_per_example"] = round(max(fit["tokens"].values()) / max(1, sums.examples), 3)
    return sums, fit, mp


def _build_pass_sums(manifest: dict, store: Store, layers: list[str], data: Tokenized | None, skip: set,
                     need_model, model_pass) -> tuple[FactorSums, dict]:
    """The build's covariance groups, completed by one model pass (``model_pass``) over the examples none covers."""
    sums, missing = store_covariance(store, layers)
    source = "build pass"
    if missing:
        m, tok = need_model()
        fdata = data if data is not None else load_build_data(manifest, tok)
        rows = [r for s, n in missing for r in range(s, s + n) if r not in skip]
        log.info("%d examples have no factors from the build pass; one model pass over them", len(rows))
        extra = model_pass(m, tok, fdata, rows)
        for n in layers:
            if n in extra.A:
                sums.add(n, extra.A[n], extra.S[n], extra.tokens[n])
        sums.examples += extra.examples
        source = "model pass" if len(missing) == len(store.paths) else "build pass + model pass"
    return sums, {"source": source, "data": manifest.get("data_id", ""),
                  "data_fingerprint": Manifest(manifest).data_fingerprint, "examples": sums.examples}
