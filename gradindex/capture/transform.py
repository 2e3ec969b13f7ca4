"""A per-layer change of coordinates of the per-example gradient, applied before the projection.

One layer's transform maps ``G`` ``[N_o, N_i(+1)]`` to ``M_g (W ⊙ G) M_aᵀ``:

* an entrywise weight ``W`` ``[N_o, N_i(+1)]`` has no per-token form: it needs the materialized
  route (``G`` formed per example, weighted, then mapped and projected), and is applied first;
* each side's map ``M_side`` is either a diagonal (scale vectors ``d_g`` ``[N_o]``, ``d_a``
  ``[N_i(+1)]``, bias column last) or a dense linear map ``[m, n]`` (``map_g``, ``map_a``; e.g.
  K-FAC whitening, :mod:`gradindex.store.basis`). Both act on each token's ``g_t`` and ``a_t``,
  ``Σ_t (M_g g_t)(M_a a_t)ᵀ``, so they are folded into the projection matrices (``P M``) and both
  routes and their cost stay as they are;
* a coordinate selection ``keep`` (flat indices into the mapped ``[m_g, m_a]`` matrix) and their
  scales ``post``, applied after both maps: the stored row is ``vec(M_g G M_aᵀ)[keep] ⊙ post``, one
  ``[1, len(keep)]`` matrix (the ``eigen`` basis of :mod:`gradindex.store.basis`: chosen coordinates
  of the full-space Kronecker eigenbasis, whitened).

Optimizer-aware influence (:mod:`gradindex.capture.adam`) uses ``W = 1/(√v + ε)`` (exact) or its
rank-1 per-side scales (factored).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SIDES = ("a", "g")


@dataclass(frozen=True)
class LayerTransform:
    """One layer's transform (module doc); any part may be ``None``; a side has scales or a map, not both."""

    g: torch.Tensor | None = None
    """``[N_o]`` scales of the output-gradient side."""
    a: torch.Tensor | None = None
    """``[N_i(+1)]`` scales of the input side, the bias column last."""
    elementwise: torch.Tensor | None = None
    """``[N_o, N_i(+1)]`` entrywise weights of ``G``; forces the materialized route."""
    map_g: torch.Tensor | None = None
    """``[m_g, N_o]`` dense map of the output-gradient side (stored side size ``m_g`` when unprojected)."""
    map_a: torch.Tensor | None = None
    """``[m_a, N_i(+1)]`` dense map of the input side (bias column last)."""
    keep: torch.Tensor | None = None
    """``[d]`` int64 flat indices into the mapped ``[m_g, m_a]`` matrix: the coordinates stored."""
    post: torch.Tensor | None = None
    """``[d]`` scales of the kept coordinates (with ``keep``)."""

    def __post_init__(self) -> None:
        for side in SIDES:
            if self.scale(side) is not None and self.map(side) is not None:
                raise ValueError(f"transform side {side!r} has both scales and a dense map; give one")
        if self.post is not None and (self.keep is None or self.post.shape != self.keep.shape):
            raise ValueError("transform post-scales need a coordinate selection (keep) of the same length")
        if self.keep is not None and self.elementwise is not None:
            raise ValueError("a transform cannot both select coordinates and weight entrywise")

    def select(self, G: torch.Tensor) -> torch.Tensor:
        """``[B, m_g·m_a]`` mapped rows → ``[B, d]`` kept coordinates times ``post`` (as is without ``keep``)."""
        if self.keep is None:
            return G
        x = G[:, self.keep.to(G.device)]
        return x if self.post is None else x * self.post.to(G.device, G.dtype)

    @classmethod
    def from_maps(cls, maps: dict[str, torch.Tensor]) -> LayerTransform:
        """From ``{"a": M_a, "g": M_g}`` (either side may be absent)."""
        unknown = sorted(set(maps) - set(SIDES))
        if unknown:
            raise ValueError(f"transform sides {unknown} are not 'a' or 'g'")
        return cls(map_a=maps.get("a"), map_g=maps.get("g"))

    def scale(self, side: str) -> torch.Tensor | None:
        return self.a if side == "a" else self.g

    def map(self, side: str) -> torch.Tensor | None:
        return self.map_a if side == "a" else self.map_g

    def out_size(self, side: str, n: int) -> int:
        """Rows of the side after the transform (before any projection)."""
        M = self.map(side)
        return n if M is None else int(M.shape[0])

    def fold(self, side: str, P: torch.Tensor) -> torch.Tensor:
        """The projection matrix ``P`` ``[k, m]`` of ``side`` times the side's map: ``[k, n]``."""
        M, d = self.map(side), self.scale(side)
        if M is not None:
            return (P.double() @ M.to(P.device, torch.float64)).to(P.dtype)
        return P if d is None else P * d.to(P.device, P.dtype)[None, :]

    def weight(self, G: torch.Tensor) -> torch.Tensor:
        """``[B, N_o, N_i(+1)]`` per-example gradients times the entrywise weights (if any)."""
        return G if self.elementwise is None else G * self.elementwise.to(G.device, G.dtype)

    def dense(self, G: torch.Tensor, sides: bool) -> torch.Tensor:
        """``[B, ·, ·]`` per-example gradients weighted entrywise, then (if ``sides``) mapped on both sides."""
        G = self.weight(G)
        if not sides:
            return G
        if self.map_g is not None:
            G = self.map_g.to(G.device, G.dtype) @ G
        elif self.g is not None:
            G = G * self.g.to(G.device, G.dtype)[:, None]
        if self.map_a is not None:
            G = G @ self.map_a.to(G.device, G.dtype).T
        elif self.a is not None:
            G = G * self.a.to(G.device, G.dtype)[None, :]
        return G

    def to(self, device: torch.device | str) -> LayerTransform:
        """The same transform with every tensor on ``device``."""
        return LayerTransform(*(None if x is None else x.to(device)
                                for x in (self.g, self.a, self.elementwise, self.map_g, self.map_a, self.keep,
                                          self.post)))
