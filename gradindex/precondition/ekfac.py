"""Passes over the store (never the model): EK-FAC corrected eigenvalues and self-influence.

One pass rotates every stored row into the Kronecker eigenbasis ``R_n = Q_Sᵀ Ĝ_n Q_A`` and
accumulates, per layer, whichever of these is asked for:

* ``Λ*_ij = mean_n (R_n)²_ij`` over finite rows (the EK-FAC eigenvalue correction);
* ``⟨(H + δI)⁻¹ Ĝ_n, Ĝ_n⟩ = Σ_ij (R_n)²_ij / (Λ_ij + δ)`` for given eigenvalues ``Λ``;
* ``‖Ĝ_n‖²`` (GradDot self-influence).

So a K-FAC fit gets ``Λ*`` for free, and an EK-FAC fit needs a second pass only for its own
self-influence (it needs the finished ``Λ*``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from gradindex.distributed import SOLO, Team
from gradindex.precondition.apply import damped, rotate
from gradindex.precondition.rotated import RotatedRows
from gradindex.progress import progress_bar
from gradindex.store import Store
from gradindex.store.basis import rotate_rows

BLOCK_BYTES = 1 << 26
"""Rows per block are capped so one block of all layers stays under this many bytes (float32)."""


@dataclass
class Basis:
    """One layer's Kronecker eigenbasis and (optionally) the eigenvalues to precondition with."""

    Q_S: np.ndarray
    """``[k_g, k_g]`` eigenvectors of ``S`` (columns), float64."""
    Q_A: np.ndarray
    """``[k_a, k_a]`` eigenvectors of ``A`` (columns), float64."""
    Lam: np.ndarray | None = None
    """``[k_g, k_a]`` eigenvalues (``λ_S λ_Aᵀ`` or ``Λ*``)."""
    delta: float = 0.0
    """Absolute damping added to ``Lam``."""


@dataclass
class PassResult:
    self_influence: np.ndarray | None
    """``[N, L]`` per-layer ``⟨(H + δI)⁻¹ Ĝ, Ĝ⟩`` (float64), when eigenvalues were given."""
    sq_norms: np.ndarray
    """``[N, L]`` per-layer ``‖Ĝ‖²`` (float64)."""
    corrected: dict[str, np.ndarray] | None
    """layer → ``Λ*`` ``[k_g, k_a]`` (float64), when asked for."""
    n_finite: int


def block_rows(dims: dict[str, int], layers: Sequence[str], block: int) -> int:
    """Rows per block so that all selected layers of one block fit in ``BLOCK_BYTES``."""
    width = sum(dims[n] for n in layers)
    return max(1, min(block, BLOCK_BYTES // max(1, 4 * width)))


def store_pass(
    store: Store,
    layers: Sequence[str],
    shapes: dict[str, tuple[int, int]],
    bases: dict[str, Basis] | None = None,
    correct: bool = False,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | dict[str, torch.dtype] = torch.float64,
    block: int = 1024,
    progress: bool = False,
    desc: str = "store pass",
    spill: RotatedRows | None = None,
    norms: bool = True,
    fit_rows: np.ndarray | None = None,
    team: Team = SOLO,
) -> PassResult:
    """One streaming pass over the store; see the module docstring. ``shapes``: layer → ``(k_g, k_a)``;
    ``dtype``: of the rotations, one for all layers or per layer (sums are float64 either way);
    ``spill``: where the rotated rows are written for the fused transcode (:mod:`gradindex.precondition.rotated`);
    ``norms``: also ``‖Ĝ‖²`` (else ``sq_norms`` is left zero); ``fit_rows``: the store positions whose rows
    make ``Λ*`` (a fit on a sample of the stored rows; None: every finite row). ``team``: the ranks that share
    the pass, each over its own store files (:class:`~gradindex.distributed.Team`): every rank gets ``Λ*``,
    summed file by file in file order (the same bits on any number of ranks), the lead every row's results
    (the others their own files' rows)."""
    layers = list(layers)
    N, L = len(store), len(layers)
    finite = store.column("finite").astype(bool)
    fitted = _fit_mask(finite, fit_rows)
    if correct and bases is None:
        raise ValueError("the eigenvalue correction needs the eigenbases")
    dev, dtypes = torch.device(device), (dtype if isinstance(dtype, dict) else {n: dtype for n in layers})
    dims = {n: shapes[n][0] * shapes[n][1] for n in layers}
    mats = _device_bases(bases, layers, dtypes, dev) if bases is not None else {}
    run = _FilePass(store, layers, shapes, bases, mats, dtypes, dev, fitted, correct, norms, spill,
                    block_rows(dims, layers, block))
    sums = {n: np.zeros(shapes[n], np.float64) for n in layers} if correct else None
    si, sq = np.zeros((N, L)) if run.with_lam else None, np.zeros((N, L))
    if spill is not None:
        spill.attach(store.sizes, dims, layers, clear=team.size == 1)  # (a team's lead cleared it first)
    with progress_bar(total=N, unit="ex", desc=desc, disable=not progress) as bar:
        def combine(k: int, res: tuple) -> None:
            file_sums, si_k, sq_k = res
            for n in file_sums:
                sums[n] += file_sums[n]
            lo, hi = store.first_ids[k], store.first_ids[k] + store.sizes[k]
            if team.lead or team.owns(k):
                sq[lo:hi] = sq_k
                if si is not None:
                    si[lo:hi] = si_k
            bar.update(int(store.sizes[k]))

        team.rounds(len(store.paths), run.file, combine)
    corrected = {n: sums[n] / max(1, int(fitted.sum())) for n in layers} if correct else None
    return PassResult(si, sq, corrected, int(finite.sum()))


@dataclass
class _FilePass:
    """One store file's share of :func:`store_pass`: its ``Λ*`` sums and its rows' results."""

    store: Store
    layers: list[str]
    shapes: dict[str, tuple[int, int]]
    bases: dict[str, Basis] | None
    mats: dict
    dtypes: dict[str, torch.dtype]
    dev: torch.device
    fitted: np.ndarray
    correct: bool
    norms: bool
    spill: RotatedRows | None
    rows: int

    @property
    def with_lam(self) -> bool:
        return self.bases is not None and all(self.bases[n].Lam is not None for n in self.layers)

    def file(self, k: int) -> tuple[dict[str, np.ndarray], np.ndarray | None, np.ndarray]:
        """``(layer → Λ* sum of file k's fitted rows (float64; only when correcting), [n_k, L] self-influence
        (or None), [n_k, L] ‖Ĝ‖²)``."""
        store, first, size, L = self.store, self.store.first_ids[k], self.store.sizes[k], len(self.layers)
        sums = {n: torch.zeros(self.shapes[n], dtype=torch.float64, device=self.dev) for n in self.layers} \
            if self.correct else {}
        si, sq = np.zeros((size, L)) if self.with_lam else None, np.zeros((size, L))
        for ids, grads in store.iter_blocks(self.layers, self.rows, first, first + size):
            pos = store.positions(ids)
            keep = None if self.fitted[pos].all() else torch.as_tensor(self.fitted[pos], device=self.dev)
            for j, n in enumerate(self.layers):
                k_g, k_a = self.shapes[n]
                x = torch.from_numpy(grads[n]).to(self.dev, self.dtypes[n])  # [n, k_g·k_a]
                if self.norms:
                    sq[pos - first, j] = x.double().square().sum(1).cpu().numpy()
                if self.bases is None:
                    continue
                Q_S, Q_A, weight = self.mats[n]
                R = rotate(x.view(-1, k_g, k_a), Q_S, Q_A)  # [n, k_g, k_a]
                if self.spill is not None:  # (the stored rows' own float32 CPU rotation: :func:`stored_rows`)
                    same = R.dtype == torch.float32 and R.device.type == "cpu"
                    self.spill.put(pos, n, R.reshape(len(pos), -1).numpy() if same else
                                   rotate_rows(grads[n], self.bases[n].Q_S, self.bases[n].Q_A, self.shapes[n]))
                R2 = R.square_() if self.correct or weight is not None else None  # (R is not needed after this)
                if self.correct:
                    sums[n] += (R2 if keep is None else R2[keep]).sum(0).double()
                if weight is not None:  # ⟨(H + δI)⁻¹x, x⟩ = Σ R² (Λ + δ)⁻¹, the weights formed once
                    si[pos - first, j] = (R2 * weight).sum(dim=(1, 2)).double().cpu().numpy()
        return {n: s.cpu().numpy() for n, s in sums.items()}, si, sq


def _fit_mask(finite: np.ndarray, fit_rows: np.ndarray | None) -> np.ndarray:
    """``[N]`` bool: the store positions whose rows make ``Λ*``: ``fit_rows`` (None: all) that are finite."""
    if fit_rows is None:
        return finite.copy()
    fitted = np.zeros_like(finite)
    fitted[np.asarray(fit_rows, np.int64)] = True
    return fitted & finite


def _device_bases(bases: dict[str, Basis], layers: Sequence[str], dtypes: dict[str, torch.dtype],
                  dev: torch.device) -> dict:
    """layer → ``(Q_S, Q_A, (Λ + δ)⁻¹ or None)`` on ``dev``, in the layer's rotation dtype."""
    out = {}
    for n in layers:
        b, dt = bases[n], dtypes[n]
        lam = None if b.Lam is None else damped(torch.as_tensor(b.Lam, dtype=dt, device=dev), b.delta, -1.0)
        out[n] = (torch.as_tensor(b.Q_S, dtype=dt, device=dev), torch.as_tensor(b.Q_A, dtype=dt, device=dev), lam)
    return out
