"""Methods by name and the loaded preconditioner object: ``H^p x`` per layer, on ``x``'s device."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from gradindex.methods import ADAM, DEFAULT_DAMPING, adam_rows, method_spec, methods_of, parse_method
from gradindex.precondition.apply import absolute_damping
from gradindex.precondition.curvature import Curvature, curvature_of
from gradindex.precondition.files import check_fingerprints, precond_path, read_layers
from gradindex.spec.manifest import Manifest
from gradindex.store.opened import OpenStore, description, opened

CURVATURE_CACHE_BYTES = 256 << 20
"""Default budget of a streamed (full-space) preconditioner's cached curvature: at most this many bytes of the
layers' ``Q_S``, ``Q_A``, ``Λ`` (in the compute dtype, on the compute device) are held at once, the layer in
use included, or the largest layer's where more (:class:`LayerCache`); ``QueryEngine.curvature_cache_bytes``
sets it per engine. Re-reading the rest costs little on a CPU: SmolLM2-135M's 1.64 GB of full-space curvature
reads in 0.5 s from the page cache, against 8-19 s for a candidate batch's forward + backward there; a GPU
with room to spare (``gradindex plan``'s exact-stage line) keeps more with a larger budget."""


class LayerCache:
    """Per-layer tensors (a layer's curvature on one device and dtype) made on first use and kept while they fit.

    ``budget`` None keeps every one. Otherwise a layer is kept only while the kept bytes plus it leave room for
    ``reserve`` (the largest layer) under ``budget``; a layer that does not fit is made for each use and dropped,
    so the bytes held at once, the layer in use included, stay within ``max(budget, largest layer)``. The layers
    kept are the first ones used, not the last: a pass over the layers in model order (every forward +
    backward) re-makes the same ones and finds the rest kept, where a least-recently-used cache would keep
    none. ``peak``: the most bytes held at once, counting the layer last made as held until the next is made.
    """

    def __init__(self, budget: int | None = None):
        self.budget = budget
        self.items: dict[tuple, tuple[torch.Tensor, ...]] = {}
        self.held = self.peak = self.made = 0

    def get(self, key: tuple, make: Callable[[], tuple[torch.Tensor, ...]],
            reserve: int = 0) -> tuple[torch.Tensor, ...]:
        """The tensors of ``key``: kept ones, else ``make()`` (kept when they fit)."""
        got = self.items.get(key)
        if got is not None:
            return got
        got = make()
        self.made += 1
        size = sum(t.numel() * t.element_size() for t in got)
        self.peak = max(self.peak, self.held + size)
        if self.budget is None or self.held + size + reserve <= self.budget:
            self.items[key] = got
            self.held += size
        return got

    def clear(self) -> None:
        self.items.clear()
        self.held = 0


def selected_layers(manifest: dict, layers: Sequence[str] | None) -> list[str]:
    """The index's layers (model order) when ``layers`` is empty, else ``layers`` checked against them."""
    shapes = Manifest(manifest).shapes
    chosen = list(layers) if layers else list(shapes)
    unknown = [n for n in chosen if n not in shapes]
    if unknown:
        raise ValueError(f"layers {unknown} are not in this index; its layers are {list(shapes)}")
    return chosen


def available_methods(index: str | os.PathLike | OpenStore, selfnorm: bool = False, rows: bool = False) -> list[str]:
    """Methods this index answers: ``graddot``, ``cosine``, and ``kfac``/``ekfac`` once fitted; only
    ``adam`` when its rows are Adam-preconditioned.

    With ``selfnorm``, the self-normalized variants (``graddot-selfnorm``, ...) are listed too.
    ``index``: an open index, or a path (its manifest alone is read: an interrupted build lists its methods too).
    ``rows``: the operations on the stored rows (:func:`gradindex.methods.row_base`), not the methods an index in a
    whitened basis answers.
    """
    ix = description(index)
    return methods_of(ix.manifest, ix.dir, selfnorm, rows)


class Preconditioner:
    """A method's curvature for every hooked layer; :meth:`apply` computes ``(H + δI)^power x`` with its
    :class:`~gradindex.precondition.curvature.Curvature` (``kind``; default: the method's).

    For ``graddot`` and ``cosine`` it is the identity (``apply`` returns ``x`` itself).
    Device copies of the eigenbases are made on first use per layer, device and dtype and kept in a
    :class:`LayerCache` of ``cache_bytes`` (None: every one kept). ``curvature`` is a dict in memory, or a
    mapping that reads a layer from its file on each access (a full-space fit,
    :class:`~gradindex.precondition.fullspace.CurvatureFile`): then only the cache holds curvature.
    """

    def __init__(
        self,
        method: str,
        shapes: dict[str, tuple[int, int]],
        curvature: Mapping[str, dict[str, np.ndarray]] | None = None,
        cache_bytes: int | None = None,
        kind: type[Curvature] | None = None,
    ) -> None:
        self.method = method
        self.kind = kind or (curvature_of(method) if curvature is not None else None)
        self.shapes = dict(shapes)
        self.layers = list(shapes)
        self.curvature = curvature
        self.cache = LayerCache(cache_bytes)
        self._largest = max((r * r + c * c + r * c for r, c in self.shapes.values()), default=0)

    @property
    def is_identity(self) -> bool:
        return self.curvature is None

    def delta(self, layer: str, damping: float = DEFAULT_DAMPING) -> float:
        """Absolute damping ``δ = damping × mean(Λ)`` of a layer."""
        if self.curvature is None:
            return 0.0
        mean = getattr(self.curvature, "eigen_mean", None)  # (a streamed file: Λ's mean without its layer)
        if mean is not None:
            return absolute_damping(damping, np.float64(mean(self._check(layer))))
        return absolute_damping(damping, self.curvature[self._check(layer)]["Lambda"])

    def _check(self, layer: str) -> str:
        if layer not in self.shapes:
            raise KeyError(f"layer {layer!r} is not in this index; its layers are {self.layers}")
        return layer

    def _tensors(self, layer: str, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """The curvature's arrays of ``layer`` (:attr:`Curvature.keys`: ``(Q_S, Q_A, Λ)`` for K-FAC/EK-FAC) on
        ``device`` in ``dtype``, from the cache or made now."""

        def make() -> tuple[torch.Tensor, ...]:
            c = self.curvature[layer]
            return tuple(torch.as_tensor(c[k], device=device).to(dtype) for k in self.kind.keys)

        itemsize = torch.empty(0, dtype=dtype).element_size()
        return self.cache.get((layer, str(device), dtype), make, self._largest * itemsize)

    def apply(self, layer: str, x: torch.Tensor, power: float = -1.0, damping: float = DEFAULT_DAMPING) -> torch.Tensor:
        """``(H + δI)^power x`` for rows ``x`` ``[n, D]`` of one layer → ``[n, D]``.

        ``power=-1`` is ``H⁻¹`` (influence), ``-0.5`` the whitening ``H^{-1/2}``. Computed on
        ``x``'s device in float64 when ``x`` is float64, else in float32; returned in ``x``'s dtype.
        """
        self._check(layer)
        if self.curvature is None:
            return x
        k_g, k_a = self.shapes[layer]
        if x.ndim != 2 or x.shape[1] != k_g * k_a:
            raise ValueError(
                f"layer {layer!r} rows have {k_g * k_a} numbers ([{k_g}, {k_a}]); got x of shape "
                f"{tuple(x.shape)}"
            )
        dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        tensors = self._tensors(layer, x.device, dtype)
        return self.kind.power(x.to(dtype), tensors, self.delta(layer, damping), power).to(x.dtype)


def check_rows_fit_method(index_dir: str | os.PathLike, manifest: dict, base: str) -> None:
    """Refuse to mix: ``adam`` needs Adam-preconditioned rows, every other method plain ones."""
    if adam_rows(manifest) and base != ADAM:
        raise ValueError(f"the rows of {str(index_dir)!r} are Adam-preconditioned (built with --optimizer-state); "
                         f"it answers --method adam only, not {base!r}: build another index without it")
    if base == ADAM and not adam_rows(manifest):
        raise ValueError(f"{str(index_dir)!r} holds plain gradients; --method adam needs an index built with "
                         "`gradindex build ... --optimizer-state PATH`")


def load_preconditioner(index: str | os.PathLike | OpenStore, method: str) -> Preconditioner:
    """The preconditioner of ``method`` (``-selfnorm`` variants load their base method) of an open index (or
    a path, opened here)."""
    base, _ = parse_method(method)
    with opened(index, "load its preconditioner") as ix:
        index_dir, manifest, shapes = ix.dir, ix.manifest, ix.shapes
        check_rows_fit_method(index_dir, manifest, base)
        if method_spec(base).fitted is None:
            return Preconditioner(base, shapes)
        path = precond_path(index_dir, base)
        if base not in ix.described.preconditioners or not path.exists():
            raise FileNotFoundError(
                f"index {str(index_dir)!r} has no {base} preconditioner (methods here: "
                f"{available_methods(ix)}); add it with `gradindex precondition {index_dir} "
                f"--method {base}` (or build with `gradindex build ... --precondition {base}`)"
            )
        check_fingerprints(path, manifest, base)
        curv = read_layers(path, curvature_of(base).keys)
        if set(curv) != set(shapes):
            raise ValueError(
                f"{str(path)!r} covers layers {sorted(curv)}, the index has {sorted(shapes)}; refit it with "
                f"`gradindex precondition {index_dir} --method {base}`"
            )
        return Preconditioner(base, shapes, curv)
