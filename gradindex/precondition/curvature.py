"""The curvature protocol: how a fitted method's curvature is fitted, stored, applied and self-influenced.

A method whose :attr:`~gradindex.methods.Method.fitted` names a file says which :class:`Curvature` does its
work (:attr:`~gradindex.methods.Method.curvature`, :func:`curvature_of`). The fit
(:func:`gradindex.precondition.fit.store_fit`) hands it the open store (:class:`FitJob`) and writes what its
:meth:`Curvature.fit` returns, one ``precond/<name>.h5`` per method it fitted, each layer's
:attr:`Curvature.write_keys` arrays; the loaded :class:`~gradindex.precondition.Preconditioner` reads each
layer's :attr:`Curvature.keys` back and applies :meth:`Curvature.power`; self-influence at another damping than
the fit's is :meth:`Curvature.self_influence`. Every curvature keeps a ``Lambda`` array whose mean scales the
relative damping (``δ = d · mean(Λ)``: :func:`gradindex.methods.absolute_damping`). K-FAC and EK-FAC
(:class:`gradindex.precondition.fit.KFAC`, :class:`~gradindex.precondition.fit.EKFAC`) implement it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from gradindex.methods import method_spec, resolve
from gradindex.precondition.ekfac import block_rows
from gradindex.store import Store


@dataclass
class FitJob:
    """What a fit runs on: the index, its manifest and open store, the :class:`~gradindex.precondition.FitConfig`
    ``cfg``, and the build's model, tokenizer and data when the caller holds them (a model pass loads them else)."""

    index_dir: Path
    cfg: Any
    manifest: dict
    store: Store
    layers: list[str]
    shapes: dict[str, tuple[int, int]]
    device: torch.device
    model: Any = None
    tokenizer: Any = None
    data: Any = None
    progress: bool = False


class Curvature(ABC):
    """One fitted curvature over the stored rows, per layer (module doc). Subclasses are stateless: the
    per-layer arrays live in the :class:`~gradindex.precondition.Preconditioner` that applies them."""

    keys: ClassVar[tuple[str, ...]] = ("Lambda",)
    """The per-layer arrays :meth:`power` reads (``layers/<layer>/<key>`` of ``precond/<name>.h5``), ``Lambda`` too."""
    write_keys: ClassVar[tuple[str, ...]] = ("Lambda",)
    """The per-layer arrays a fit writes: attributes of its per-layer factors (with ``tokens``, ``examples``)."""

    @classmethod
    @abstractmethod
    def fit(cls, job: FitJob, **options) -> tuple[dict[str, tuple[dict | None, Any]], dict]:
        """``(written, record)``: method name → (layer → factors, ``[N, L]`` self-influence at ``job.cfg.damping``
        or None), each written to ``precond/<name>.h5`` (``graddot``: ``‖Ĝ‖²``, self-influence only), and the fit's
        record (the manifest's ``fit``)."""

    @staticmethod
    @abstractmethod
    def power(x: torch.Tensor, tensors: tuple[torch.Tensor, ...], delta: float, power: float) -> torch.Tensor:
        """``(H + δI)^power x`` for one layer's rows ``x`` ``[n, D]``, from its :attr:`keys` arrays as tensors
        on ``x``'s device and dtype."""

    @classmethod
    def self_influence(cls, P, store: Store, layers: list[str], damping: float, device: torch.device,
                       block: int) -> np.ndarray:
        """``[N, L]`` ``⟨(H + δI)⁻¹ Ĝ_n, Ĝ_n⟩`` of every stored row under ``P`` (the loaded preconditioner), in
        float64, one pass over the store."""
        out = np.zeros((len(store), len(layers)))
        for ids, grads in store.iter_blocks(layers, block_rows(store.dims, layers, block)):
            pos = store.positions(ids)
            for j, n in enumerate(layers):
                x = torch.from_numpy(grads[n]).to(device, torch.float64)
                out[pos, j] = (P.apply(n, x, -1.0, damping) * x).sum(1).cpu().numpy()
        return out


def curvature_of(method: str) -> type[Curvature]:
    """The :class:`Curvature` of a fitted base method (read from the method registry when asked)."""
    spec = method_spec(method)
    if not spec.fitted or spec.curvature is None:
        raise ValueError(f"method {method!r} has no fitted curvature")
    return resolve(spec.curvature)
