"""``basis.h5``: the linear maps that put stored rows in a whitened basis (writer and reader).

Two kinds, recorded in the manifest as ``build.basis``:

* ``kfac`` (``gradindex build --projection-basis kfac``): before the random projection each side
  is whitened by its damped full-space factor, ``W_a = (A + δ_A)^{-1/2}``, ``W_g = (S + δ_S)^{-1/2}``
  (``δ = damping × mean eigenvalue``), with ``A``, ``S`` from one model pass before capture. Rows
  are ``P_g W_g G W_a P_aᵀ``, so their inner products approximate K-FAC influence.
* ``ekfac`` (``gradindex compact IDX --basis ekfac``): after an EK-FAC fit, rows are rotated into
  the Kronecker eigenbasis and scaled, ``(Q_Sᵀ Ĝ Q_A) ⊙ (Λ* + δ)^{-1/2}``, so plain inner products
  are EK-FAC influence and the row's numbers are evenly scaled (what low-bit codes need).
  Built with ``--projection-basis eigen`` (the default where the budget cannot hold the whole
  gradient: :func:`gradindex.store.sizing.eigen_basis`), the Kronecker eigenbasis is the full-space
  one and a row holds only chosen coordinates of it, whitened at capture:
  ``vec(Q_S,kᵀ G Q_A,k)[keep] ⊙ (Λ*_keep + δ)^{-1/2}``, a ``[1, d]`` matrix per layer (``W_g``,
  ``W_a`` the leading eigenvectors, ``keep``, ``scale``; no ``Q_S``/``Q_A`` after capture).

The query applies the same maps: :func:`capture_transforms` before projection (capture hook),
:func:`to_rows` after it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np
import torch

from gradindex.capture.transform import LayerTransform
from gradindex.checksum import Damage, check_files, damage_error, record
from gradindex.methods import absolute_damping, names, row_base, row_basis
from gradindex.spec import layout
from gradindex.spec.manifest import SHARD_KEY, baked_damping, basis_of, build_command

BASIS_FILE = layout.BASIS_FILE
BASES = ("raw", "kfac", "ekfac")


@dataclass
class RowBasis:
    """The per-layer maps of an index's basis (empty dicts for a raw index)."""

    kind: str = "raw"
    """``raw``, ``kfac`` (whitened before projection) or ``ekfac`` (eigenbasis after projection)."""
    damping: float = 0.0
    """Relative damping of the whitening."""
    W_a: dict[str, np.ndarray] = field(default_factory=dict)
    """layer → ``[N_i+1, N_i+1]`` input-side whitening (before projection)."""
    W_g: dict[str, np.ndarray] = field(default_factory=dict)
    """layer → ``[N_o, N_o]`` output-side whitening (before projection)."""
    Q_S: dict[str, np.ndarray] = field(default_factory=dict)
    """layer → ``[k_g, k_g]`` eigenvectors applied after projection (``ekfac``)."""
    Q_A: dict[str, np.ndarray] = field(default_factory=dict)
    """layer → ``[k_a, k_a]`` eigenvectors applied after projection (``ekfac``)."""
    scale: dict[str, np.ndarray] = field(default_factory=dict)
    """layer → ``[k_g, k_a]`` ``(Λ* + δ)^{-1/2}`` (``ekfac``)."""
    spectra: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    """layer → eigenvalues of the full-space ``(A, S)`` (``kfac``), kept for allocation by spectrum."""
    keep: dict[str, np.ndarray] = field(default_factory=dict)
    """layer → ``[d]`` flat indices into ``[k_g, k_a]`` of the eigen-coordinates stored (``eigen`` rows;
    ``W_g`` ``[k_g, N_o]``, ``W_a`` ``[k_a, N_i+1]`` are then the leading eigenvectors and ``scale``
    ``[1, d]`` the whitening applied at capture)."""
    _f32: dict[str, tuple] = field(default_factory=dict, repr=False, compare=False)
    """layer → ``(the arrays converted, float32 Q_S, Q_A, scale tensors)``: :meth:`rotation`'s cache."""

    def rotation(self, layer: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(Q_S, Q_A, scale)`` of an ``ekfac`` layer as float32 tensors, converted once per layer (a query
        rotates every layer's rows: converting the float64 maps each time cost ~40 ms a query at SmolLM2 width)."""
        arrays = (self.Q_S[layer], self.Q_A[layer], self.scale[layer])
        got = self._f32.get(layer)
        if got is None or any(x is not y for x, y in zip(got[0], arrays, strict=True)):  # (a map replaced)
            got = self._f32[layer] = (arrays, *(torch.from_numpy(np.asarray(x, np.float32)) for x in arrays))
        return got[1:]

    def damping_used(self, base: str, damping: float) -> float | None:
        """The relative damping behind scores of a base method asked for on these rows (what results report).

        The query's ``damping`` where a fitted preconditioner is applied to the rows (:func:`row_base`
        ``kfac``/``ekfac``); the one the rows bake in where the method is their plain inner product
        (``ekfac`` on a compacted or transcoded index, ``kfac`` on a ``kfac`` basis: the query's
        ``damping`` plays no part there); ``None`` where no curvature enters (graddot, cosine, adam).
        """
        on_rows = row_base(base, self.kind)
        if on_rows in names("fitted"):
            return damping
        return self.damping if on_rows != base else None


def basis_path(index_dir: str | os.PathLike) -> Path:
    return Path(index_dir) / BASIS_FILE


def inverse_sqrt(M: np.ndarray, damping: float) -> tuple[np.ndarray, np.ndarray]:
    """``((M + δI)^{-1/2}, eigenvalues of M)`` with ``δ = damping × mean eigenvalue``, float64."""
    lam, Q = np.linalg.eigh(0.5 * (M + M.T))
    lam = np.clip(lam, 0.0, None)
    return (Q / np.sqrt(lam + absolute_damping(damping, lam))) @ Q.T, lam


def kfac_basis(factors: dict[str, tuple[np.ndarray, np.ndarray]], damping: float) -> RowBasis:
    """The ``kfac`` basis from full-space ``layer → (A, S)`` means."""
    b = RowBasis(kind="kfac", damping=damping)
    for n, (A, S) in factors.items():
        b.W_a[n], lam_a = inverse_sqrt(np.asarray(A, np.float64), damping)
        b.W_g[n], lam_s = inverse_sqrt(np.asarray(S, np.float64), damping)
        b.spectra[n] = (lam_a, lam_s)
    return b


def write_basis(index_dir: str | os.PathLike, basis: RowBasis, identity: dict) -> None:
    """Write atomically (``.partial`` then rename); ``identity`` is stored to be checked on reuse."""
    path = basis_path(index_dir)
    tmp = path.with_name(path.name + ".partial")
    with h5py.File(tmp, "w") as f:
        f.attrs["kind"], f.attrs["damping"] = basis.kind, basis.damping
        for k, v in identity.items():
            f.attrs["id_" + k] = str(v)
        for name in dict.fromkeys([*basis.W_a, *basis.Q_S]):
            g = f.create_group(name)
            for key, d in (("W_a", basis.W_a), ("W_g", basis.W_g), ("Q_S", basis.Q_S), ("Q_A", basis.Q_A),
                           ("scale", basis.scale), ("keep", basis.keep)):
                if name in d:
                    dtype = np.int64 if key == "keep" else np.float32 if key.startswith("W") else np.float64
                    g[key] = np.asarray(d[name], dtype)
            if name in basis.spectra:
                g["lam_a"], g["lam_s"] = basis.spectra[name]
    record(index_dir, [tmp], [BASIS_FILE])  # checksums.json, as for shards and preconditioner files
    os.replace(tmp, path)


def read_basis(index_dir: str | os.PathLike, identity: dict | None = None) -> RowBasis | None:
    """The index's basis, or ``None`` when there is no file (or, with ``identity``, a stale one)."""
    path = basis_path(index_dir)
    if not path.exists():
        return None
    with h5py.File(path, "r") as f:
        if identity is not None and any(f.attrs.get("id_" + k) != str(v) for k, v in identity.items()):
            return None
        b = RowBasis(kind=str(f.attrs["kind"]), damping=float(f.attrs["damping"]))
        for name, g in f.items():
            for key, d in (("W_a", b.W_a), ("W_g", b.W_g), ("Q_S", b.Q_S), ("Q_A", b.Q_A), ("scale", b.scale),
                           ("keep", b.keep)):
                if key in g:
                    d[name] = g[key][:]
            if "lam_a" in g:
                b.spectra[name] = (g["lam_a"][:], g["lam_s"][:])
    return b


def unrestorable(manifest: dict) -> str:
    """Why ``basis.h5`` cannot be rewritten from the index's own EK-FAC fit file (``precond/ekfac.h5``); ``""``
    where it can: rows transcoded from raw rows (no pre-projection maps: a projection is regenerated from its
    seed), the fit kept. :func:`gradindex.precondition.restore.restore_basis` rewrites it."""
    b = basis_of(manifest)
    if b.get("kind", "raw") != "ekfac" or b.get("space") == "full-eigen":
        return "its maps come from a model pass before the capture, which no file of the index keeps"
    source = (b.get("from") or {}).get("kind", "raw")
    if source != "raw":
        return f"it holds the {source} pre-projection maps of a model pass before the capture, which no file keeps"
    if "ekfac" not in manifest.get("preconditioners", {}):
        return "the index keeps no EK-FAC fit (precond/ekfac.h5) to rewrite it from"
    return ""


def made_by_factor_pass(manifest: dict) -> bool:
    """Whether ``basis.h5`` holds the maps of a ``kfac`` or ``eigen`` row basis (``--projection-basis``): made by
    the build's own factor pass before its capture, which the build run again makes again (a resume checks the
    maps against the digest the manifest records: :func:`gradindex.store.sizing.full_space_basis`)."""
    b = basis_of(manifest)
    return b.get("kind") == "kfac" or b.get("space") == "full-eigen"


def basis_repair(index_dir: str | os.PathLike, manifest: dict) -> str:
    """The command that rewrites a damaged ``basis.h5``: the compact that made it; the build with ``--repair``
    where the index's EK-FAC fit holds it (:func:`unrestorable`) or its factor pass makes it again
    (:func:`made_by_factor_pass`); else the build with ``--overwrite``; for a part of a sharded index, the whole
    sharded index's build."""
    if manifest.get(SHARD_KEY):  # (a part: the whole sharded index's build; a compact into it would replace it)
        return build_command(index_dir, manifest, extra="--overwrite")
    source = (manifest.get("compact") or {}).get("source")
    if source:
        return f"gradindex compact {source} --out {index_dir} --damping {baked_damping(manifest)} --overwrite"
    rebuild = unrestorable(manifest) and not made_by_factor_pass(manifest)
    return build_command(index_dir, manifest, extra="--overwrite" if rebuild else "--repair")


def check_basis(index_dir: str | os.PathLike, manifest: dict, full: bool = True) -> list[Damage]:
    """Damage of ``basis.h5`` against its recorded hash (none when the index has no basis file)."""
    if row_basis(manifest) == "raw" and not basis_path(index_dir).exists():
        return []
    return check_files(index_dir, [BASIS_FILE], full, basis_repair(index_dir, manifest))


def index_basis(index_dir: str | os.PathLike, manifest: dict) -> RowBasis:
    """The basis the manifest says the rows are in; an error if its file is missing."""
    kind = row_basis(manifest)
    if kind == "raw":
        return RowBasis()
    damage = check_basis(index_dir, manifest, full=False)  # the cheap sampled check, as for shards
    if damage:
        raise damage_error(index_dir, damage, then="query it")
    b = read_basis(index_dir)
    if b is None:
        raise FileNotFoundError(f"{str(basis_path(index_dir))!r} is missing, but the index's rows are in the "
                                f"{kind!r} basis; rebuild the index")
    return b


def capture_transforms(basis: RowBasis | None, whiten: bool = True) -> dict[str, dict | LayerTransform]:
    """Per-layer transforms for :class:`~gradindex.capture.GradientCapture` ``transforms=``: the side
    maps, and for ``eigen`` rows the kept coordinates with their whitening (``whiten=False``: unscaled)."""
    if basis is None:
        return {}
    out: dict[str, dict | LayerTransform] = {}
    for n in basis.W_a:
        maps = {"a": torch.from_numpy(np.asarray(basis.W_a[n], np.float32)),
                "g": torch.from_numpy(np.asarray(basis.W_g[n], np.float32))}
        if n in basis.keep:
            post = torch.from_numpy(np.asarray(basis.scale[n], np.float32).ravel()) if whiten else None
            out[n] = LayerTransform(map_a=maps["a"], map_g=maps["g"],
                                    keep=torch.from_numpy(np.asarray(basis.keep[n], np.int64)), post=post)
        else:
            out[n] = maps
    return out


def to_rows(basis: RowBasis | None, layer: str, x: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """Captured projected rows ``[n, k_g·k_a]`` → stored rows (the ``ekfac`` rotation and scale; else as is)."""
    if basis is None or layer not in basis.Q_S:
        return x
    k_g, k_a = shape
    X = torch.from_numpy(np.ascontiguousarray(x, np.float32)).reshape(-1, k_g, k_a)
    Q_S, Q_A, scale = basis.rotation(layer)
    # float32 (3x faster than float64 here; the relative error, ~1e-6, is far below any stored code's)
    Y = (X.reshape(-1, k_a) @ Q_A).reshape(-1, k_g, k_a)
    R = torch.matmul(Q_S.T, Y) * scale  # [n, k_g, k_a]
    return R.reshape(len(X), -1).numpy()


def rotate(X: torch.Tensor, Q_S: torch.Tensor, Q_A: torch.Tensor) -> torch.Tensor:
    """``Q_Sᵀ X Q_A`` for a batch ``X`` ``[n, k_g, k_a]`` (into the eigenbasis).

    The left product is one matrix product over the whole batch (``[k_g, k_g] @ [k_g, n·k_a]``) rather
    than ``n`` small ones: 1.2-2.5x faster on one thread at the default rows' shapes."""
    n, k_g, k_a = X.shape
    Z = (Q_S.T @ X.transpose(0, 1).reshape(k_g, n * k_a)).reshape(k_g, n, k_a).transpose(0, 1)  # [n, k_g, k_a]
    return Z @ Q_A


def rotate_rows(x: np.ndarray, Q_S: np.ndarray, Q_A: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """Captured rows ``x`` ``[n, k_g·k_a]`` rotated into the eigenbasis, ``[n, k_g·k_a]`` float32 on the CPU:
    the rotation every writer of ``ekfac`` rows uses (:func:`stored_rows`), whatever device fitted them."""
    k_g, k_a = shape
    X = torch.from_numpy(np.ascontiguousarray(x, np.float32)).view(-1, k_g, k_a)
    f32 = {"dtype": torch.float32}
    return rotate(X, torch.as_tensor(Q_S, **f32), torch.as_tensor(Q_A, **f32)).reshape(len(X), -1).numpy()


def to_half(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``x`` ``[n, D]`` → ``(x / m`` as float16, row maxima ``m`` float32): the fused transcode's copy
    of rotated rows (:mod:`gradindex.precondition.rotated`); :func:`from_half` reads it back."""
    x = np.asarray(x, np.float32)
    m = np.abs(x).max(1) if x.shape[1] else np.ones(len(x), np.float32)
    m = np.where(m > 0, m, np.float32(1)).astype(np.float32)
    return (x / m[:, None]).astype(np.float16), m


def from_half(h: np.ndarray, m: np.ndarray) -> np.ndarray:
    """:func:`to_half`'s rows back as float32."""
    return h.astype(np.float32) * m[:, None]


def stored_rows(basis: RowBasis | None, layer: str, x: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """Captured rows ``[n, k_g·k_a]`` → the ``ekfac`` rows a build stores, before coding (else as is).

    One computation for every writer (the fused transcode with or without its rotated copy, ``compact``,
    a sampled build's capture pass, ``--repair``), so a row's numbers depend on neither the free disk nor
    the batch that wrote it: float32 :func:`rotate_rows`, rounded as the copy rounds (:func:`to_half`,
    at most 2⁻¹² of the row's largest number), times ``(Λ* + δ)^{-1/2}`` in float32."""
    if basis is None or layer not in basis.Q_S:
        return x
    R = from_half(*to_half(rotate_rows(x, basis.Q_S[layer], basis.Q_A[layer], shape)))
    return R * np.asarray(basis.scale[layer], np.float32).reshape(-1)


def rows_dual(basis: RowBasis | None, layer: str, v: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """A vector ``v`` dotted with stored rows → the vector giving the same number on captured rows:
    ``⟨v, to_rows(x)⟩ = ⟨rows_dual(v), x⟩`` (``Q_S (V ⊙ scale) Q_Aᵀ``; as is outside the ``ekfac`` rotation)."""
    if basis is None or layer not in basis.Q_S:
        return np.asarray(v)
    k_g, k_a = shape
    V = np.asarray(v, np.float64).reshape(k_g, k_a) * basis.scale[layer]
    return (basis.Q_S[layer] @ V @ basis.Q_A[layer].T).reshape(-1)
