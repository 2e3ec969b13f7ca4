"""What a build stores per layer: projection sizes from a byte budget, and the whitened basis's factor pass.

Both are settled before capture and recorded in the manifest's ``build`` section (``projection``
with per-layer ``sizes``, and ``basis``), so a resume or a query with other settings is refused.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from gradindex.capture import GradientCapture, KfacSums, ProjectedRows, ProjectionSpec, RowSpace
from gradindex.capture.allocation import allocate, influence_counts, influence_share
from gradindex.capture.batch import batch_gradients
from gradindex.capture.layers import LayerInfo
from gradindex.data import Tokenized
from gradindex.methods import absolute_damping
from gradindex.progress import progress_bar
from gradindex.store.basis import RowBasis, capture_transforms, kfac_basis, read_basis, write_basis
from gradindex.store.codes import bytes_per_number, has_scale


def sized_projection(cfg, infos: dict[str, LayerInfo], basis: RowBasis) -> ProjectionSpec:
    """``cfg.projection``, or for an ``auto`` row spec per-layer sizes from its budget under its allocation.

    The budget buys numbers at the spec's storage width: int4 rows get 8× the numbers of float32 ones.
    """
    r = cfg.rows
    if r.basis == "eigen":  # the basis's maps and chosen coordinates are the whole reduction
        return ProjectionSpec(kind="none", k_a=0, k_g=0, seed=cfg.seed)
    if r.projection != "auto":
        return cfg.projection
    widths = {n: (i.n_in_total, i.n_out) for n, i in infos.items()}
    sizes = allocate(widths, r.bytes_per_example(widths), r.allocation, bytes_per_number(r.storage),
                     basis.spectra)
    return ProjectionSpec(kind=cfg.projection_kind, k_a=0, k_g=0, seed=cfg.seed,
                          sizes=tuple((n, ka, kg) for n, (ka, kg) in sizes.items()))


def basis_identity(cfg, basis: RowBasis, model_fp: str, data_fp: str) -> dict:
    """The manifest's ``build.basis``: kind, and for ``kfac`` the settings and a digest of the maps."""
    r = cfg.rows
    if r.basis == "raw":
        return {"kind": "raw"}
    h = hashlib.blake2b(digest_size=16)
    for n in sorted(basis.W_a):
        h.update(n.encode())
        h.update(np.ascontiguousarray(basis.W_a[n], np.float32).tobytes())
        h.update(np.ascontiguousarray(basis.W_g[n], np.float32).tobytes())
        if n in basis.keep:
            h.update(np.ascontiguousarray(basis.keep[n], np.int64).tobytes())
            h.update(np.ascontiguousarray(basis.scale[n], np.float32).tobytes())
    if r.basis == "eigen":  # rows are whitened full-space EK-FAC coordinates: queries answer ekfac on them
        return {"kind": "ekfac", "space": "full-eigen", "damping": r.damping, "budget": r.budget,
                "examples": cfg.basis_examples, "seed": cfg.basis_seed, "digest": h.hexdigest(),
                "kept_share": round(kept_share(basis, r.damping), 4)}
    return {"kind": r.basis, "damping": r.basis_damping, "examples": cfg.basis_examples,
            "seed": cfg.basis_seed, "digest": h.hexdigest()}


def factor_pass(model: nn.Module, data: Tokenized, rows, layers, pad_id: int, batch_size: int,
                progress: bool = False) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Full-space ``layer → (A, S)`` (float64 token means) from one forward/backward over ``rows``."""
    model.requires_grad_(False)
    rows = list(rows)
    sums = KfacSums(RowSpace(ProjectionSpec(kind="none", k_a=0, k_g=0)))  # full space: A, S of [a, 1] and g
    with GradientCapture(model, layers, sums) as cap, progress_bar(total=len(rows), unit="ex", desc="basis factors",
                                                                   disable=not progress) as bar:
        for s in range(0, len(rows), batch_size):
            idx = rows[s:s + batch_size]
            batch_gradients(model, cap, [data.input_ids[i] for i in idx], [data.labels[i] for i in idx], pad_id)
            bar.update(len(idx))
        return {n: (A.cpu().numpy(), S.cpu().numpy()) for n, (A, S, _) in sums.means().items()}


def full_space_basis(model: nn.Module, data: Tokenized, pad_id: int, out, cfg, model_fp: str, data_fp: str,
                     progress: bool) -> tuple[RowBasis, Callable[[], None] | None]:
    """The ``kfac`` basis: reused from ``out`` when it was made with these settings, else one factor pass.

    Returns the basis and, when it is new, the call that writes it (once ``out`` is known to be ours).
    """
    r = cfg.rows
    ident = {"model": model_fp, "data": data_fp, "damping": r.basis_damping, "examples": cfg.basis_examples,
             "seed": cfg.basis_seed, "layers": ",".join(cfg.layers)}
    if r.basis == "eigen":
        ident = {**ident, "kind": "eigen", "damping": r.damping, "budget": r.budget, "storage": r.storage}
    old = read_basis(out, ident) if out.exists() else None
    if old is not None:
        return old, None
    n = len(data)
    k = cfg.basis_examples
    rows = np.arange(n) if k <= 0 or k >= n else np.sort(np.random.default_rng(cfg.basis_seed).choice(n, k, False))
    factors = factor_pass(model, data, rows, cfg.layers, pad_id, cfg.batch_size, progress)
    if r.basis == "eigen":
        budget = r.bytes_per_example({nm: (A.shape[0], S.shape[0]) for nm, (A, S) in factors.items()})
        # (each layer's row also holds a float32 scale and, in int4, up to half a byte of padding)
        cap = int((budget - 5 * len(factors) * has_scale(r.storage)) / bytes_per_number(r.storage))
        basis = eigen_basis(factors, cap, r.damping)
        basis.scale = correction_pass(model, data, rows, basis, pad_id, cfg.batch_size, r.damping, progress)
    else:
        basis = kfac_basis(factors, r.basis_damping)
    return basis, lambda: write_basis(out, basis, ident)


def _descending_eigh(M: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    lam, Q = np.linalg.eigh(0.5 * (M + M.T))  # float64, ascending
    return np.clip(lam[::-1], 0.0, None), np.ascontiguousarray(Q[:, ::-1])


def eigen_basis(factors: dict[str, tuple[np.ndarray, np.ndarray]], cap_numbers: int, damping: float) -> RowBasis:
    """The ``eigen`` rows' maps and chosen coordinates from full-space ``layer → (A, S)``
    (:func:`~gradindex.capture.allocation.influence_counts`); ``scale`` is filled by :func:`correction_pass`.

    Each layer keeps the coordinates ``(i, j)``, ``j < m_i``, of its Kronecker eigenbasis (eigenvalues
    largest first), so its rows are ``vec(Q_S[:, :k_g]ᵀ G Q_A[:, :k_a])[keep]``, ``k_g`` the rows with
    ``m_i > 0`` and ``k_a = m_0``.
    """
    eig = {n: (_descending_eigh(A), _descending_eigh(S)) for n, (A, S) in factors.items()}
    counts = influence_counts({n: (a[0], s[0]) for n, (a, s) in eig.items()}, cap_numbers)
    b = RowBasis(kind="ekfac", damping=damping)
    for n, ((lam_a, Q_A), (lam_s, Q_S)) in eig.items():
        m = counts[n]
        k_g, k_a = int((m > 0).sum()), int(m[0])
        b.W_g[n], b.W_a[n] = Q_S[:, :k_g].T.astype(np.float32), Q_A[:, :k_a].T.astype(np.float32)
        b.keep[n] = np.concatenate([i * k_a + np.arange(m[i]) for i in range(k_g)]).astype(np.int64)
        b.spectra[n] = (lam_a, lam_s)
    return b


def kept_share(basis: RowBasis, damping: float) -> float:
    """Share of the influence the ``eigen`` rows keep, by K-FAC's estimate: ``Σ_keep f / Σ_all f`` with
    ``f = λ_S λ_A / (λ_S λ_A + δ)`` (:func:`~gradindex.capture.allocation.influence_share`) over all layers.
    ``benchmarks/width.py``: 0.64 kept 0.97 of full-space EK-FAC's Spearman, 0.056 only 0.12."""
    kept = total = 0.0
    for n, (lam_a, lam_s) in basis.spectra.items():
        f = influence_share(np.outer(lam_s, lam_a), damping)  # [N_o, N_i(+1)]
        i, j = np.divmod(basis.keep[n], basis.W_a[n].shape[0])
        kept += float(f[i, j].sum())
        total += float(f.sum())
    return kept / total if total > 0 else 1.0


def correction_pass(model: nn.Module, data: Tokenized, rows, basis: RowBasis, pad_id: int, batch_size: int,
                    damping: float, progress: bool = False) -> dict[str, np.ndarray]:
    """layer → ``[1, d]`` whitening ``(Λ*_keep + δ)^{-1/2}`` of the ``eigen`` rows, from one model pass.

    ``Λ*`` on a kept coordinate is EK-FAC's corrected eigenvalue there (the mean square of the
    coordinate over the finite examples of ``rows``). The damping is relative to the mean ``Λ*``
    over the *whole* eigenbasis, as full-space EK-FAC's: the coordinates not kept are never
    computed, so that mean is estimated as the kept mean over K-FAC's share there,
    ``δ = damping × mean_keep(Λ*) × mean(λ_S λ_Aᵀ) / mean_keep(λ_S λ_Aᵀ)``.
    """
    model.requires_grad_(False)
    rows = list(rows)
    sums: dict[str, np.ndarray] = {}
    seen = 0
    space = RowSpace(ProjectionSpec(kind="none", k_a=0, k_g=0), capture_transforms(basis, whiten=False))
    with GradientCapture(model, list(basis.keep), ProjectedRows(space, "factorized")) as cap, \
            progress_bar(total=len(rows), unit="ex", desc="basis correction", disable=not progress) as bar:
        for s in range(0, len(rows), batch_size):
            idx = rows[s:s + batch_size]
            grads = batch_gradients(model, cap, [data.input_ids[i] for i in idx], [data.labels[i] for i in idx],
                                    pad_id).grads
            finite = np.all([torch.isfinite(g).all(1).cpu().numpy() for g in grads.values()], axis=0)  # [B]
            seen += int(finite.sum())
            for n, g in grads.items():
                x = g.double().cpu().numpy()[finite]  # [B', d]
                sums[n] = sums.get(n, 0.0) + (x * x).sum(0)
            bar.update(len(idx))
    out = {}
    for n, sq in sums.items():
        lam = sq / max(1, seen)  # [d]
        lam_a, lam_s = basis.spectra[n]
        k_a = basis.W_a[n].shape[0]
        i, j = np.divmod(basis.keep[n], k_a)
        kron = lam_s[i] * lam_a[j]
        share = float(kron.mean() / (lam_s.mean() * lam_a.mean())) if kron.mean() > 0 else 1.0
        delta = absolute_damping(damping, lam) / (share if lam.mean() > 0 else 1.0)
        out[n] = (1.0 / np.sqrt(np.maximum(lam + delta, delta / 2)))[None, :]
    return out
