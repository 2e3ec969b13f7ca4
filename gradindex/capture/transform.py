"""A per-layer change of coordinates of the per-example gradient, applied before the projection.

One layer's transform maps ``G`` ``[N_o, N_i(+1)]`` to ``(d_g d_aᵀ) ⊙ W ⊙ G``:

* per-side diagonals ``d_g`` ``[N_o]`` and ``d_a`` ``[N_i(+1)]`` (bias column last) scale each
  token's ``g_t`` and ``a_t``, so ``Σ_t (d_g ⊙ g_t)(d_a ⊙ a_t)ᵀ``; they are folded into the
  projection matrices (``P_g diag(d_g)``, ``P_a diag(d_a)``), so both routes and their cost stay
  as they are;
* an entrywise weight ``W`` ``[N_o, N_i(+1)]`` has no per-token form: it needs the materialized
  route (``G`` formed per example, weighted, then projected).

Optimizer-aware influence (:mod:`gradindex.capture.adam`) uses ``W = 1/(√v + ε)`` (exact) or its
rank-1 per-side form (factored). A general per-side linear map (e.g. K-FAC whitening) would fold
into the projection matrices the same way the diagonals do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LayerTransform:
    """One layer's transform (module doc); any part may be ``None``."""

    g: torch.Tensor | None = None
    """``[N_o]`` scales of the output-gradient side."""
    a: torch.Tensor | None = None
    """``[N_i(+1)]`` scales of the input side, the bias column last."""
    elementwise: torch.Tensor | None = None
    """``[N_o, N_i(+1)]`` entrywise weights of ``G``; forces the materialized route."""

    def fold(self, side: str, P: torch.Tensor) -> torch.Tensor:
        """The projection matrix ``P`` ``[k, n]`` of ``side`` times ``diag(d_side)``."""
        d = self.a if side == "a" else self.g
        return P if d is None else P * d.to(P.device, P.dtype)[None, :]

    def dense(self, G: torch.Tensor, sides: bool) -> torch.Tensor:
        """``[B, N_o, N_i(+1)]`` per-example gradients weighted entrywise (and by the sides if ``sides``)."""
        if self.elementwise is not None:
            G = G * self.elementwise.to(G.device, G.dtype)
        if sides and self.g is not None:
            G = G * self.g.to(G.device, G.dtype)[:, None]
        if sides and self.a is not None:
            G = G * self.a.to(G.device, G.dtype)[None, :]
        return G

    def matrix(self, n_out: int, n_in_total: int) -> torch.Tensor:
        """The whole transform as one ``[N_o, N_i(+1)]`` entrywise weight (for tests and references)."""
        W = torch.ones(n_out, n_in_total, dtype=torch.float64)
        return self.dense(W[None], sides=True)[0]
