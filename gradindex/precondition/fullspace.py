"""Full-space (unprojected) K-FAC and EK-FAC, from two model passes, never forming a per-example gradient.

Per hooked layer, with ``a_t`` ``[N_i(+1)]`` and ``g_t`` ``[N_o]`` the per-token factors
(:mod:`gradindex.capture.tokens`) and ``G_n = Σ_t g_t a_tᵀ``:

1. factor pass: ``A = mean_tokens a aᵀ``, ``S = mean_tokens g gᵀ`` (float32 products per batch over
   the blocks on and above the diagonal only, float64 sums on the model's device); eigendecompose in
   float64: ``A = Q_A Λ_A Q_Aᵀ``, ``S = Q_S Λ_S Q_Sᵀ``;
2. correction pass (EK-FAC): ``Λ*_ij = mean_n (Q_Sᵀ G_n Q_A)²_ij`` with
   ``Q_Sᵀ G_n Q_A = Σ_t (Q_Sᵀ g_t)(Q_Aᵀ a_t)ᵀ``: the factorized "projection" by the eigenbases, done
   per token in the model pass in float32, squared per example and summed in float64; the mean over
   the fit examples, or over a seeded sample of ``correction_examples`` of them (:func:`correction_rows`).

Cost per example and layer: ``T (N_i² + N_o²) / 2`` for the factor pass's products and
``T (N_i² + N_o²) + T N_i N_o`` for the correction's, against ``N_o N_i (N_o + N_i)`` per example for
rotating dense gradients. The factor pass keeps each batch's gradient w.r.t. the final hidden states
(``[B, T, d]``, up to :data:`HEAD_CACHE_BYTES`), so the correction pass skips the LM head and the loss
(a third of a weight-free model pass at a vocabulary of 8192) and gets the same ``g_t`` bit for bit.

A build with ``BuildConfig(full_factors=True)`` (``gradindex build --full-factors``) sums ``A`` and
``S`` in its capture pass (store group ``covariance_full``); the fit then skips its factor pass. A
budget-bound build asked for the exact stage's fit (``BuildConfig(rerank_fit=True)``, ``gradindex build
--rerank-fit``; the default build makes none) does the same over exactly its full-space fit set (the
group's attribute ``rows`` names it) and keeps the capture's head gradients for the correction pass
(:class:`HeadGrads`); it saves the sums as the fit's checkpoint before the transcode rewrites the shards
(:func:`keep_build_sums`).

Output, beside the stored-space files: ``precond/kfac-full.h5`` and (EK-FAC) ``precond/ekfac-full.h5``,
the same layout as ``precond/<method>.h5`` with ``[N_o, N_i(+1)]`` matrices (float32, no ``A``, ``S``:
:data:`FULL_KEYS`) and no self-influence,
registered in the manifest under ``full_space``. Progress is checkpointed to
``precond/full-space.state.npz`` every ``checkpoint_seconds``; a killed fit re-run with the same
settings resumes from it.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

import gradindex
from gradindex.capture import FullTokens, GradientCapture
from gradindex.capture.batch import batch_gradients
from gradindex.capture.gram import add_gram, gram_block, upper_to_symmetric
from gradindex.capture.head import plain_head
from gradindex.checksum import damage_error
from gradindex.data import Tokenized
from gradindex.fingerprint import digest_bytes
from gradindex.methods import names, parse_method
from gradindex.precondition.apply import eigendecompose, kfac_eigenvalues
from gradindex.precondition.factors import (
    data_fingerprint,
    load_build_data,
    load_build_model,
    sample_rows,
)
from gradindex.precondition.files import (
    PRECOND_DIR,
    LayerFactors,
    check_fingerprints,
    layer_names,
    precond_path,
    read_attrs,
    read_layer,
    read_layers,  # noqa: F401 (re-exported: tests and benchmarks read full-space files through this module)
    write_precond,
)
from gradindex.precondition.preconditioner import CURVATURE_CACHE_BYTES, Preconditioner
from gradindex.progress import progress_bar
from gradindex.spec.build import batch_size_of
from gradindex.spec.manifest import Manifest, rows_of, write_manifest
from gradindex.store import Store
from gradindex.store.covariance import covariance_rows, read_covariance, rows_digest
from gradindex.store.opened import Description, OpenStore, description, opened
from gradindex.store.repair import check_store

log = logging.getLogger("gradindex")
FULL = "-full"
FULL_KEYS = ("lambda_A", "Q_A", "lambda_S", "Q_S", "Lambda")
"""What a full-space file holds per layer: the eigenbases and eigenvalues (``A``, ``S`` are ``Q diag(λ) Qᵀ``;
at ``[N_o, N_i(+1)]`` they would add about 40% to the files, which a query never reads), as float32: the
re-rank computes in float32 (:func:`~gradindex.query.full.full_gradient_scores`), so its scores are the same
as from float64 files; a float64 reference reads them rounded (relative 6e-8)."""
STATE = "full-space.state.npz"
KFAC_KEYS = ("lambda_A", "lambda_S")
BASES = "bases"
"""File attribute of a full-space K-FAC file written beside EK-FAC's: the name of that file (same folder),
which holds the eigenbases both share; the K-FAC file keeps only ``λ_A``, ``λ_S`` (``Λ = λ_S λ_Aᵀ``).
The bases are the largest part (``N_o² + N_i²`` numbers per layer: 9 GB per file at the Qwen2.5-0.5B
shape), so this halves the full-space files."""


def full_shapes(manifest: dict) -> dict[str, tuple[int, int]]:
    """layer → ``(N_o, N_i(+1))`` of its full-space gradient matrix, model order."""
    return Manifest(manifest).full_shapes


def stored_share(manifest: dict) -> float:
    """Numbers a row stores over the numbers of the whole (unprojected) gradient of its layers;
    below 1 the rows are a projection: their scores are a first stage, which the exact stage
    (``rerank_full=C``) re-ranks in full space on request (docs/query.md, "Two stages")."""
    stored = sum(s.dim for s in Manifest(manifest).layers.values())
    full = sum(r * c for r, c in full_shapes(manifest).values())
    return stored / full if full else 1.0


def budget_bound(manifest: dict) -> bool:
    """Whether the rows are a projection sized by the byte budget (``--projection auto``, the default)
    that holds less than the whole gradient: where the default query's first-stage result carries a note
    on the exact stage (``--rerank-full C``). A projection the user chose (``--projection 16``) is taken as
    asked."""
    return rows_of(manifest).projection == "auto" and stored_share(manifest) < 1


def full_path(index_dir: str | os.PathLike, method: str) -> Path:
    return precond_path(index_dir, method + FULL)


HEAD_CACHE_BYTES = 1 << 30
"""At most this many bytes of the factor pass's gradients w.r.t. the final hidden states are kept
(on the CPU) for the correction pass, which then skips the LM head and the loss on those batches."""


class _FactorSums:
    """Visitor of the factor pass: ``Σ a aᵀ`` and ``Σ g gᵀ`` per layer, float32 products per batch summed
    in float64 on the model's device (upper triangles only: :func:`~gradindex.capture.gram.add_gram`)."""

    def __init__(self, shapes: dict[str, tuple[int, int]], device: torch.device):
        z = dict(dtype=torch.float64, device=device)
        self.A = {n: torch.zeros((c, c), **z) for n, (_, c) in shapes.items()}
        self.S = {n: torch.zeros((r, r), **z) for n, (r, _) in shapes.items()}
        self.block = gram_block(device)

    def __call__(self, name: str, a: torch.Tensor, g: torch.Tensor) -> None:
        add_gram(self.A[name], a.reshape(-1, a.shape[-1]), self.block)
        add_gram(self.S[name], g.reshape(-1, g.shape[-1]), self.block)

    def load(self, arrays: dict[str, np.ndarray]) -> None:
        for n in self.A:
            if f"A/{n}" in arrays:
                self.A[n].copy_(torch.from_numpy(arrays[f"A/{n}"]))
                self.S[n].copy_(torch.from_numpy(arrays[f"S/{n}"]))

    def arrays(self, symmetric: bool = False) -> dict[str, np.ndarray]:
        """``{"A/<layer>": ..., "S/<layer>": ...}`` as float64 numpy: the raw sums, or ``symmetric`` ones."""
        f = upper_to_symmetric if symmetric else np.asarray
        return {**{f"A/{n}": f(v.cpu().numpy()) for n, v in self.A.items()},
                **{f"S/{n}": f(v.cpu().numpy()) for n, v in self.S.items()}}


class _CorrectionSums:
    """Visitor of the correction pass: ``Σ_n (Q_Sᵀ G_n Q_A)²`` per layer, rotated per token in float32
    (``Q_Sᵀ G_b Q_A = (g_b Q_S)ᵀ (a_b Q_A)``), squares summed in float64 on the model's device."""

    def __init__(self, bases: dict[str, tuple[np.ndarray, np.ndarray]], device: torch.device):
        self.Q = {n: (torch.as_tensor(qs, dtype=torch.float32, device=device),
                      torch.as_tensor(qa, dtype=torch.float32, device=device)) for n, (qs, qa) in bases.items()}
        self.sums = {n: torch.zeros((qs.shape[0], qa.shape[0]), dtype=torch.float64, device=device)
                     for n, (qs, qa) in bases.items()}

    def __call__(self, name: str, a: torch.Tensor, g: torch.Tensor) -> None:
        Q_S, Q_A = self.Q[name]
        R = torch.bmm((g @ Q_S).transpose(1, 2), a @ Q_A)  # [B, N_o, N_i(+1)] = Q_Sᵀ G_b Q_A
        self.sums[name].add_(R.square_().sum(0))

    def load(self, arrays: dict[str, np.ndarray]) -> None:
        for n, v in self.sums.items():
            if f"C/{n}" in arrays:
                v.copy_(torch.from_numpy(arrays[f"C/{n}"]))

    def arrays(self) -> dict[str, np.ndarray]:
        return {f"C/{n}": v.cpu().numpy() for n, v in self.sums.items()}


class HeadGrads:
    """Per batch (by its examples' data indices), the gradient w.r.t. the final hidden states of an earlier
    pass over the same batch (the fit's factor pass, or the build's capture), on the CPU, up to ``budget``
    bytes; the correction pass replays it instead of running the LM head and the loss."""

    def __init__(self, budget: int = 0):
        self.budget, self.bytes, self.grads = budget or HEAD_CACHE_BYTES, 0, {}

    def put(self, key, grad: torch.Tensor) -> None:
        size = grad.numel() * grad.element_size()
        if self.bytes + size <= self.budget:
            self.grads[tuple(int(i) for i in key)] = grad.detach().cpu()
            self.bytes += size

    def pop(self, key) -> torch.Tensor | None:
        return self.grads.pop(tuple(int(i) for i in key), None)


def build_pass_factors(index_dir: str | os.PathLike, layers: list[str], rows: str = "") -> tuple[dict, int] | None:
    """``({"A/<layer>": Σ a aᵀ, "S/<layer>": Σ g gᵀ}, tokens)`` summed over the shards' ``covariance_full``
    groups (a build with ``full_factors``, or a ``rerank_fit`` build's sums over its fit set), or
    ``None`` unless every shard has finite ones over the examples of digest ``rows`` (empty: all)."""
    with Store(index_dir) as store:
        paths = list(store.paths)
    arrays: dict[str, np.ndarray] = {}
    tokens = 0
    for path in paths:
        got = read_covariance(path, "covariance_full", layers) if covariance_rows(path) == rows else None
        if got is None:
            return None
        for n, sides in got.items():
            for side, x in zip(("A", "S"), sides[:2], strict=True):
                if not np.isfinite(x).all():
                    return None
                key = f"{side}/{n}"
                arrays[key] = arrays[key] + x if key in arrays else x
        tokens += got[layers[0]][2]
    return arrays, tokens


def _batches(rows: np.ndarray, start: int, size: int):
    for s in range(start, len(rows), size):
        yield s, rows[s:s + size]


def _model_pass(model, pad_id: int, data: Tokenized, rows: np.ndarray, layers: list[str], visit, start: int,
                batch_size: int, desc: str, progress: bool, checkpoint, heads: HeadGrads | None = None,
                record: bool = False) -> int:
    """Forward + weight-free backward over ``rows[start:]``; ``checkpoint(done)`` now and then; tokens seen.

    With ``heads`` (and a plain LM head, :func:`~gradindex.capture.head.plain_head`): ``record`` keeps
    each batch's gradient w.r.t. the final hidden states there; otherwise a batch found there skips the
    head and the loss (the same per-token factors, bit for bit).
    """
    tokens = 0
    with GradientCapture(model, layers, FullTokens(visit)) as cap, \
            progress_bar(total=len(rows), initial=start, unit="ex", desc=desc, disable=not progress) as bar:
        if heads is not None and plain_head(model, set(cap.modules.values())) is None:
            heads = None
        for s, idx in _batches(rows, start, batch_size):
            ids = [data.input_ids[i] for i in idx]
            known = None if heads is None or record else heads.pop(idx)
            bg = batch_gradients(model, cap, ids, [data.labels[i] for i in idx], pad_id, head_grad=known,
                                 keep_head_grad=heads is not None and record)
            if bg.head_grad is not None:
                heads.put(idx, bg.head_grad)
            tokens += sum(len(x) for x in ids)
            bar.update(len(idx))
            checkpoint(s + len(idx), tokens)
    return tokens


BUILD_PASS = "build pass"


class _State:
    """The resumable state of a fit: stage, rows done, sums (``source``: :data:`BUILD_PASS` where the factor
    sums came from the capture pass); saved atomically to ``precond/`` now and then."""

    def __init__(self, path: Path, key: str, every: float):
        self.path, self.key, self.every = path, key, every
        self.stage, self.done, self.tokens, self.source = "factors", 0, 0, ""
        self.arrays: dict[str, np.ndarray] = {}
        self._last = time.monotonic()

    def load(self) -> bool:
        if not self.path.exists():
            return False
        try:
            with np.load(self.path, allow_pickle=False) as z:
                if str(z["key"]) != self.key:
                    return False
                self.stage, self.done, self.tokens = str(z["stage"]), int(z["done"]), int(z["tokens"])
                self.source = str(z["source"]) if "source" in z.files else ""
                self.arrays = {k[2:]: z[k] for k in z.files if k.startswith("a:")}
        except (OSError, ValueError, KeyError):  # torn file: start over
            return False
        return True

    def save(self) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp.npz")
        np.savez(tmp, key=self.key, stage=self.stage, done=self.done, tokens=self.tokens, source=self.source,
                 **{f"a:{k}": v for k, v in self.arrays.items()})
        os.replace(tmp, self.path)
        self._last = time.monotonic()

    def maybe_save(self, force: bool = False, arrays=None) -> None:
        """Save when forced or due; ``arrays()`` (when given) gives the sums to save, only then."""
        if force or time.monotonic() - self._last >= self.every:
            if arrays is not None:
                self.arrays = arrays()
            self.save()


def _fit_set(manifest: dict, cfg, tokenizer, data: Tokenized | None) -> tuple[Tokenized, np.ndarray, str]:
    """The fit's data, its rows and where they come from (``cfg.fit_data``, else the indexed finite examples)."""
    if cfg.fit_data:
        data = load_build_data(manifest, tokenizer, str(Path(cfg.fit_data)), check=False)
        rows, source = sample_rows(len(data), cfg.fit_examples, cfg.seed), cfg.fit_data
    else:
        skip = set(manifest.get("nonfinite_ids", []))
        data = data if data is not None else load_build_data(manifest, tokenizer)
        rows = np.array([r for r in sample_rows(len(data), cfg.fit_examples, cfg.seed) if int(r) not in skip],
                        dtype=np.int64)
        source = manifest.get("data_id", "")
    if len(rows) == 0:
        raise ValueError("the fit set is empty; pass --fit-data with examples, or a larger --fit-examples")
    return data, rows, source


def _eigen_factors(state: _State, layers: list[str], examples: int) -> dict[str, LayerFactors]:
    """The K-FAC factors of the summed ``A``/``S`` (per token), eigendecomposed; non-finite ones refused."""
    tokens, factors = state.tokens, {}
    for n in layers:
        A, S = state.arrays[f"A/{n}"] / tokens, state.arrays[f"S/{n}"] / tokens
        if not (np.isfinite(A).all() and np.isfinite(S).all()):
            raise ValueError(f"the full-space factors of layer {n!r} are not finite; some fit examples have "
                             "non-finite activations or gradients (fit on others with --fit-data)")
        lam_A, Q_A = eigendecompose(A)
        lam_S, Q_S = eigendecompose(S)
        none = np.zeros((0, 0))  # (A and S are not kept: the files hold FULL_KEYS only)
        factors[n] = LayerFactors(none, none, lam_A, Q_A, lam_S, Q_S, kfac_eigenvalues(lam_S, lam_A), tokens, examples)
    return factors


class _Pass:
    """The model passes of one full-space fit (factor sums, then EK-FAC's correction), checkpointed in ``state``."""

    def __init__(self, model, pad_id: int, data: Tokenized, rows: np.ndarray, layers: list[str], bs: int,
                 state: _State, progress: bool, heads: HeadGrads | None = None,
                 corrected: np.ndarray | None = None):
        self.model, self.pad_id, self.data, self.rows, self.layers, self.bs = model, pad_id, data, rows, layers, bs
        self.corrected = rows if corrected is None else corrected  # (the correction pass's rows)
        self.state, self.progress = state, progress
        self.heads = heads if heads is not None else HeadGrads()
        self.device = next(model.parameters()).device

    def factors(self, shapes: dict, method: str) -> None:
        """Sum the full-space ``A`` and ``S`` over the fit rows (resumed from the checkpoint)."""
        state, n_rows = self.state, len(self.rows)
        fs = _FactorSums(shapes, self.device)
        fs.load(state.arrays)

        def ckpt(done: int, tokens: int, base=state.tokens) -> None:
            state.done, state.tokens = done, base + tokens
            state.maybe_save(done == n_rows, fs.arrays)

        replay = method == "ekfac" and len(self.corrected) == n_rows  # (a sample's batches are not the same)
        _model_pass(self.model, self.pad_id, self.data, self.rows, self.layers, fs, state.done, self.bs,
                    "full-space factors", self.progress, ckpt, self.heads if replay else None, record=replay)
        state.arrays = fs.arrays(symmetric=True)
        state.stage, state.done = ("correction" if method == "ekfac" else "done"), 0
        state.maybe_save(force=True)

    def correction(self, factors: dict[str, LayerFactors]) -> dict[str, LayerFactors]:
        """EK-FAC: each layer's eigenvalues corrected in the K-FAC eigenbasis (resumed from the checkpoint)."""
        state, rows = self.state, self.corrected
        n_rows = len(rows)
        cs = _CorrectionSums({n: (f.Q_S, f.Q_A) for n, f in factors.items()}, self.device)
        cs.load(state.arrays)
        if state.stage == "correction":
            keep = {k: v for k, v in state.arrays.items() if not k.startswith("C/")}

            def ckpt(done: int, _tokens: int) -> None:
                state.done = done
                state.maybe_save(done == n_rows, lambda: {**keep, **cs.arrays()})

            _model_pass(self.model, self.pad_id, self.data, rows, self.layers, cs, state.done, self.bs,
                        "eigenvalue correction", self.progress, ckpt, self.heads)
        sums = cs.arrays()
        return {n: LayerFactors(**{**asdict(f), "Lambda": sums[f"C/{n}"] / n_rows}) for n, f in factors.items()}


def fit_full_space(index_dir: str | os.PathLike, cfg, model=None, tokenizer=None, data: Tokenized | None = None,
                   progress: bool = False, checkpoint_seconds: float = 60.0, heads: HeadGrads | None = None,
                   manifest: dict | None = None) -> dict:
    """Fit full-space K-FAC (and EK-FAC when ``cfg.method == 'ekfac'``); return the manifest's ``full_space``.

    ``cfg`` is a :class:`~gradindex.precondition.fit.FitConfig`; its ``fit_data`` / ``fit_examples``
    choose the fit set as for the stored-space fit (default: every finite indexed example). Where the
    build's capture pass summed ``A`` and ``S`` over exactly that set (:func:`build_pass_factors`),
    the factor pass is skipped; ``heads``: the capture's gradients w.r.t. the final hidden states
    (:class:`HeadGrads`), which spare the correction pass the LM head on those batches. ``manifest``: the index's
    complete one, when the caller holds it (the pipeline): used instead of the file and updated in place.
    """
    t0 = time.perf_counter()
    manifest = _held(index_dir, manifest)
    shapes = full_shapes(manifest)
    layers = list(shapes)
    if model is None or tokenizer is None:
        model, tokenizer = load_build_model(manifest, cfg.device)
    data, rows, source, fp, state = _start(index_dir, manifest, cfg, tokenizer, data, checkpoint_seconds)
    corrected = correction_rows(rows, cfg)
    bs = batch_size_of(manifest)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    was = {n: p.requires_grad for n, p in model.named_parameters()}
    model.requires_grad_(False)
    phases: dict[str, list[float]] = {}
    clock = [time.perf_counter(), time.process_time()]

    def lap(name: str) -> None:
        now = [time.perf_counter(), time.process_time()]
        phases[name] = [round(now[0] - clock[0], 3), round(now[1] - clock[1], 3)]
        clock[:] = now

    try:
        passes = _Pass(model, pad_id, data, rows, layers, bs, state, progress, heads, corrected)
        if state.stage == "factors":
            passes.factors(shapes, cfg.method)
            lap("factor_pass")
        written = {"kfac": _eigen_factors(state, layers, len(rows))}
        lap("eigendecomposition")
        if cfg.method == "ekfac":
            written["ekfac"] = passes.correction(written["kfac"])
            lap("correction_pass")
    finally:
        for n, p in model.named_parameters():
            p.requires_grad_(was[n])
    tokens = state.tokens
    fit = {"source": "build pass + model pass" if state.source == BUILD_PASS else "model pass", "space": "full",
           "data": source, "data_fingerprint": fp,
           "examples": int(len(rows)), "tokens": {n: int(tokens) for n in layers},
           "tokens_per_example": round(tokens / len(rows), 3),
           "phase_seconds": phases}  # [wall, process CPU] of each phase run now
    if cfg.fit_examples:
        fit["sample_seed"] = cfg.seed
    if cfg.method == "ekfac" and len(corrected) < len(rows):
        fit["correction_examples"], fit["correction_seed"] = int(len(corrected)), cfg.seed
    return _record(index_dir, cfg, manifest, layers, written, fit, state, t0)


def correction_rows(rows: np.ndarray, cfg) -> np.ndarray:
    """The fit rows EK-FAC's correction pass takes: a seeded sample of ``cfg.correction_examples`` of ``rows``
    (``cfg.seed``), or all of them (0, or not fewer than ``rows``)."""
    k = cfg.correction_examples
    return rows[sample_rows(len(rows), k, cfg.seed)] if 0 < k < len(rows) else rows


def _start(index_dir, manifest: dict, cfg, tokenizer, data: Tokenized | None, checkpoint_seconds: float,
           full_check: bool = True) -> tuple[Tokenized, np.ndarray, str, str, _State]:
    """The fit set (data, rows, where from, fingerprint) and the fit's state: resumed from its checkpoint,
    else from the capture pass's sums over that set (only the correction pass left; the shards checked
    first, ``full_check``: whole-file hashes, else the sampled check), else from scratch."""
    layers = list(full_shapes(manifest))
    data, rows, source = _fit_set(manifest, cfg, tokenizer, data)
    bs = batch_size_of(manifest)
    fp = data_fingerprint(data)
    corrected, model = correction_rows(rows, cfg), Manifest(manifest).model_fingerprint
    key = digest_bytes([json.dumps([model, fp, layers, rows.tolist(), bs, cfg.method]
                                   + ([corrected.tolist()] if len(corrected) < len(rows) else [])).encode()])
    (Path(index_dir) / PRECOND_DIR).mkdir(parents=True, exist_ok=True)
    state = _State(Path(index_dir) / PRECOND_DIR / STATE, key, checkpoint_seconds)
    if state.load():
        log.info("resuming the full-space fit at %s, %d/%d examples", state.stage, state.done, len(rows))
        return data, rows, source, fp, state
    from_build = _build_sums(index_dir, manifest, cfg, layers, rows)
    if from_build is not None:  # the build pass summed the factors: only the correction pass is left
        damage = check_store(index_dir, full=full_check, manifest=manifest)
        if damage:
            raise damage_error(index_dir, damage, then="fit")
        state.arrays, state.tokens = from_build
        state.stage, state.source = ("correction" if cfg.method == "ekfac" else "done"), BUILD_PASS
    return data, rows, source, fp, state


def keep_build_sums(index_dir: str | os.PathLike, cfg, tokenizer, data: Tokenized | None = None,
                    manifest: dict | None = None) -> bool:
    """Save the capture pass's full-space sums over ``cfg``'s fit set as the fit's checkpoint (before the
    transcode replaces the shards that hold them; :func:`fit_full_space` then resumes from it). Whether saved.
    The build has just written and hashed the shards: they get the sampled check, not a whole read.
    ``manifest``: the build's, when the caller holds it."""
    _, _, _, _, state = _start(index_dir, _held(index_dir, manifest), cfg, tokenizer, data, 0.0, full_check=False)
    if state.source != BUILD_PASS or state.path.exists():
        return False
    state.save()
    return True


def _held(index_dir, manifest: dict | None) -> dict:
    """The caller's manifest where it holds a complete one, else the file's (refused unless complete)."""
    return manifest if manifest is not None and manifest.get("status") == "complete" else \
        Manifest.read_complete(index_dir, "fit").data


def _build_sums(index_dir, manifest: dict, cfg, layers: list[str], rows: np.ndarray) -> tuple[dict, int] | None:
    """The capture pass's full-space sums over exactly the fit set ``rows``, or None (:func:`build_pass_factors`)."""
    if cfg.fit_data:
        return None
    if not cfg.fit_examples:
        return build_pass_factors(index_dir, layers)
    sample = sample_rows(int(manifest["counts"]["examples"]), cfg.fit_examples, cfg.seed)
    if len(sample) != len(rows):  # (a sampled example is non-finite: the sums hold it)
        return None
    return build_pass_factors(index_dir, layers, "" if len(sample) == int(manifest["counts"]["examples"])
                              else rows_digest(sample))


def _record(index_dir, cfg, manifest: dict, layers: list[str], written: dict, fit: dict, state: _State,
            t0: float) -> dict:
    """Write each fitted method's file and its ``full_space`` manifest entry; drop the checkpoint."""
    for m, fac in written.items():
        shared = m == "kfac" and "ekfac" in written  # (the same eigenbases: kept once, in the EK-FAC file)
        write_precond(full_path(index_dir, m), m, manifest, layers, fac, None, cfg.damping, fit,
                      KFAC_KEYS if shared else FULL_KEYS, np.float32,
                      {BASES: full_path(index_dir, "ekfac").name} if shared else None)
    seconds = time.perf_counter() - t0  # (``manifest``: the one the fit began with, a copy; the index is locked)
    entries = manifest.setdefault("full_space", {})
    for m in written:
        entries[m] = {"file": f"{PRECOND_DIR}/{m}{FULL}.h5", "fit": fit, "config": asdict(cfg),
                      "seconds": round(seconds, 3), "library_version": gradindex.__version__}
    write_manifest(index_dir, manifest)
    state.path.unlink(missing_ok=True)
    log.info("fitted full-space %s on %s in %.1f s", "+".join(written), index_dir, seconds)
    return entries


def full_space_methods(index: str | os.PathLike | OpenStore) -> list[str]:
    """Methods whose full-space curvature this index (open, or a path: its manifest alone is read) has
    (``graddot``, ``cosine`` always)."""
    ix = description(index)
    return list(names("base")) + [m for m in names("fitted") if _full_file(ix, m) is not None]


def _full_file(ix: OpenStore | Description, base: str) -> Path | None:
    """``base``'s full-space curvature file: its full-space fit's, or (unprojected rows) its stored-space fit's."""
    m = ix.described
    if base in m.full_space and full_path(ix.dir, base).exists():
        return full_path(ix.dir, base)
    if m.projection.get("kind") == "none" and base in m.preconditioners and precond_path(ix.dir, base).exists():
        return precond_path(ix.dir, base)
    return None


class CurvatureFile(Mapping):
    """layer → ``{"Q_S", "Q_A", "Lambda"}`` of a full-space file, read from it a layer at a time on each access:
    nothing is kept but each layer's mean eigenvalue (the damping's scale). A K-FAC file that shares EK-FAC's bases
    (attribute :data:`BASES`) reads them there and computes ``Λ = λ_S λ_Aᵀ``."""

    def __init__(self, path: Path, manifest: dict):
        self.path, self.bases = path, None
        shared = read_attrs(path).get(BASES)
        if shared:
            self.bases = path.with_name(str(shared))
            if not self.bases.exists():
                raise FileNotFoundError(
                    f"{str(path)!r} takes its eigenbases from {str(self.bases)!r}, which is missing; refit with "
                    f"`gradindex precondition {path.parent.parent} --method ekfac --space full`")
            check_fingerprints(self.bases, manifest, "ekfac")
        self.names = layer_names(path)
        self._means: dict[str, float] = {}

    def __getitem__(self, layer: str) -> dict[str, np.ndarray]:
        if layer not in self.names:
            raise KeyError(layer)
        if self.bases is None:
            return read_layer(self.path, layer)
        return {**read_layer(self.bases, layer, ("Q_S", "Q_A")), "Lambda": self._eigenvalues(layer)}

    def _eigenvalues(self, layer: str) -> np.ndarray:
        if self.bases is None:
            return read_layer(self.path, layer, ("Lambda",))["Lambda"]
        own = read_layer(self.path, layer, KFAC_KEYS)
        return kfac_eigenvalues(own["lambda_S"], own["lambda_A"])

    def eigen_mean(self, layer: str) -> float:
        """``mean(Λ)`` of ``layer`` (read once)."""
        if layer not in self._means:
            self._means[layer] = float(self._eigenvalues(layer).mean())
        return self._means[layer]

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def _fit_command(ix: OpenStore, base: str) -> tuple[str, str]:
    """The index, named, and the command that fits its full-space ``base`` curvature: on the index itself, or, for a
    sharded index's part (every part holds the same fit, made over the whole index), on the whole index, split
    again."""
    from gradindex.spec.manifest import SHARD_KEY, sharded_parent

    part = ix.manifest.get(SHARD_KEY) or ({"parts": ix.parts} if getattr(ix, "home", None) else None)
    if not part:
        return f"index {str(ix.dir)!r}", f"`gradindex precondition {ix.dir} --method {base} --space full`"
    whole = getattr(ix, "home", None) or sharded_parent(ix.dir) or "SHARDED"
    return f"the sharded index {str(whole)!r}", (
        f"one fit over the whole index, which every part shares: `gradindex merge {whole} --out ONE`, `gradindex "
        f"precondition ONE --method {base} --space full`, then `gradindex split ONE --shards {part['parts']} --out "
        "NEW` (or fit the index it was split from, and split that again)")


def load_full_preconditioner(index: str | os.PathLike | OpenStore, method: str,
                             cache_bytes: int | None = CURVATURE_CACHE_BYTES) -> Preconditioner:
    """The full-space preconditioner of ``method`` over ``[N_o, N_i(+1)]`` rows.

    From ``precond/<method>-full.h5``, or, for an unprojected index, its stored-space fit (the same
    space), streamed: each layer read from the file when used, at most ``cache_bytes`` of the layers' device
    copies kept at once (:class:`~gradindex.precondition.preconditioner.LayerCache`; None: every layer kept
    once used). ``graddot``/``cosine`` (and their ``-selfnorm``) give the identity.
    """
    base, _ = parse_method(method)
    with opened(index, "load its full-space preconditioner") as ix:
        manifest = ix.manifest
        shapes = ix.described.full_shapes
        if base in names("base"):
            return Preconditioner(base, shapes)
        path = _full_file(ix, base)
        if path is None:
            what, fix = _fit_command(ix, base)
            raise FileNotFoundError(f"{what} has no full-space {base} curvature; add it with {fix}")
        check_fingerprints(path, manifest, base)
        curv = CurvatureFile(path, manifest)
        if set(curv) != set(shapes):
            raise ValueError(f"{str(path)!r} covers layers {sorted(curv)}, the index has {sorted(shapes)}; refit it "
                             f"with {_fit_command(ix, base)[1]}")
        return Preconditioner(base, shapes, curv, cache_bytes)
