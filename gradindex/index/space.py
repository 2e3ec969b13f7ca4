"""What vectors an index holds, and how a query is mapped into that space.

An index over layer ``l`` stores ``x_l = W_l t_l / ν`` for every store row ``t``:

* ``W_l`` is the identity (``whiten='none'``, a *raw* index) or ``H_l^{-1/2}`` of a fitted
  preconditioner at the build's damping (``whiten='kfac'|'ekfac'``, a *whitened* index);
* ``ν`` is 1, or with ``normalize=True`` the example's norm over **all** layers of the raw store
  vectors, so per-layer inner products with a unit query sum to the cosine.

A query for method ``M`` (``graddot``/``cosine``: identity, ``kfac``/``ekfac``: ``H⁻¹`` at the
query's damping) becomes ``m_l = M_l q_l`` (divided by ``‖q‖`` for cosine), the vector the exact
re-rank dots with the raw stored ``t_l``, and ``u_l = W_l^{-1} m_l`` (``H^{+1/2}`` of the
whitening), the vector searched in the index: ``⟨u_l, W_l t_l⟩ = ⟨m_l, t_l⟩``. When the method
and damping are the whitening's own, ``u_l = H_l^{-1/2} q_l`` directly. So any method and damping
works on any index, without rebuilding it; an index whose space matches the method gives ANN
search the best recall.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import torch

from gradindex.methods import DEFAULT_DAMPING, SELFNORM, names
from gradindex.precondition import Preconditioner, available_methods, load_preconditioner
from gradindex.precondition.preconditioner import check_rows_fit_method
from gradindex.store.opened import OpenStore

WHITEN = ("none", "kfac", "ekfac")
@dataclass(frozen=True)
class IndexSpace:
    """The vector space of a set of per-layer indices; serialized into ``faiss/index.json``."""

    whiten: str = "none"
    """``none`` (raw vectors) or the preconditioner whose ``H^{-1/2}`` whitens them."""
    damping: float = DEFAULT_DAMPING
    """Relative damping of the whitening (ignored when ``whiten='none'``)."""
    normalize: bool = False
    """Divide each example's vectors by its all-layer norm (cosine search without bias)."""

    def __post_init__(self) -> None:
        if self.whiten not in WHITEN:
            raise ValueError(f"whiten {self.whiten!r} is not one of {WHITEN}")
        if self.damping < 0:
            raise ValueError(f"damping must be >= 0, got {self.damping}")

    def to_dict(self) -> dict:
        d = asdict(self)
        if self.whiten == "none":
            d["damping"] = None
        return d

    @classmethod
    def from_dict(cls, d: dict) -> IndexSpace:
        return cls(whiten=d.get("whiten", "none"), damping=d.get("damping") or DEFAULT_DAMPING,
                   normalize=bool(d.get("normalize", False)))


class Preconditioners:
    """Each fitted preconditioner of an index, loaded once, applying powers of it to ``[n, D]`` blocks.

    Methods here are base names (``graddot``, ``cosine``, ``kfac``, ``ekfac``): parse a method
    string once (:func:`gradindex.methods.parse_method`) and pass its base.
    """

    def __init__(self, ix: OpenStore):
        self.ix, self.index_dir, self.manifest = ix, ix.dir, ix.manifest
        self._loaded: dict[str, Preconditioner] = {}
        self._available: list[str] | None = None

    def available(self) -> list[str]:
        """Operations on the stored rows (``graddot``, ``cosine`` and the fitted ones; ``adam``)."""
        if self._available is None:
            self._available = available_methods(self.ix, rows=True)
        return self._available

    def check(self, base: str, selfnorm: bool = False) -> None:
        """Refuse a method that is not fitted, naming the command that fits it."""
        check_rows_fit_method(self.index_dir, self.manifest, base)
        if base not in self.available():
            shown = self.available() + ([m + SELFNORM for m in self.available() if m != "cosine"]
                                        if selfnorm else [])
            name = base + SELFNORM if selfnorm else base
            raise ValueError(
                f"method {name!r} is not fitted for {str(self.index_dir)!r} (available: "
                f"{', '.join(shown)}); fit it with "
                f"`gradindex precondition {self.index_dir} --method {base}`"
            )

    def get(self, base: str) -> Preconditioner:
        """The loaded preconditioner of a base method (identity for graddot/cosine)."""
        if base not in self._loaded:
            self.check(base)
            self._loaded[base] = load_preconditioner(self.ix, base)
        return self._loaded[base]

    def apply(self, method: str, layer: str, x: torch.Tensor, power: float, damping: float) -> torch.Tensor:
        """``H^power x`` for the base method's curvature (identity for graddot/cosine/adam)."""
        if method in names("identity") or method == "none":
            return x
        return self.get(method).apply(layer, x, power=power, damping=damping).to(x.dtype)


def index_vectors(space: IndexSpace, pre: Preconditioners, layer: str, t: np.ndarray,
                  inv_norm: np.ndarray | None) -> np.ndarray:
    """``[n, D]`` float32 vectors to add to a layer's index from raw store rows ``t``."""
    x = t.astype(np.float32, copy=False)
    if space.whiten != "none":
        x = pre.apply(space.whiten, layer, torch.from_numpy(np.ascontiguousarray(x)), -0.5,
                      space.damping).numpy()
    if space.normalize:
        x = x * inv_norm[:, None]
    return np.ascontiguousarray(x, dtype=np.float32)


def query_vectors(
    space: IndexSpace, pre: Preconditioners, method: str, damping: float, q: dict[str, torch.Tensor]
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], np.ndarray]:
    """Per layer ``(m, u)`` for query gradients ``q`` ``{layer: [Q, D]}``, and ``‖q‖`` ``[Q]``.

    ``m`` (float64) is dotted with raw stored rows in the exact re-rank; ``u`` (float32) is
    searched in the index (module doc). For cosine, ``m`` and ``u`` carry the ``1/‖q‖`` factor.
    """
    qnorm = torch.sqrt(sum((v.double() ** 2).sum(dim=1) for v in q.values()))  # [Q]
    m: dict[str, np.ndarray] = {}
    u: dict[str, np.ndarray] = {}
    for layer, v in q.items():
        v = v.double()
        if method == "cosine":
            v = v / qnorm.clamp_min(1e-300)[:, None]
        if space.whiten != "none" and method == space.whiten and damping == space.damping:
            mv = pre.apply(method, layer, v, -1.0, damping)
            uv = pre.apply(method, layer, v, -0.5, damping)
        else:
            mv = pre.apply(method, layer, v, -1.0, damping)
            uv = mv if space.whiten == "none" else pre.apply(space.whiten, layer, mv, 0.5, space.damping)
        m[layer] = mv.double().numpy()
        u[layer] = np.ascontiguousarray(uv.float().numpy())
    return m, u, qnorm.numpy()
