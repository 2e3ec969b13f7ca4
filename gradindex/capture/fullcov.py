"""Full-space K-FAC factors ``A = E[a aᵀ]`` (``a`` with its bias 1) and ``S = E[g gᵀ]`` from one model pass.

A :class:`GradientCapture` that forms no per-example gradient: each hooked layer's tokens only add
to the float64 sums ``cov_a``/``cov_g`` (``[N_i+1, N_i+1]``, ``[N_o, N_o]``), which is what a
whitened basis (:mod:`gradindex.store.basis`) or an allocation by spectrum needs before capture.
"""

from __future__ import annotations

import torch

from gradindex.capture.hooks import GradientCapture, _with_ones


class FullCovariance(GradientCapture):
    """Hooks that sum full-space ``a aᵀ`` and ``g gᵀ`` over real tokens; :meth:`pop` gives ``[B, 0]`` rows."""

    def __init__(self, model, layers=None) -> None:
        super().__init__(model, layers, route="materialized", weight_free=True, collect_covariance=True)

    def layer_gradient(self, name: str, a: torch.Tensor, g: torch.Tensor, route: str | None = None) -> torch.Tensor:
        info = self.infos[name]
        a, g = self.per_token(name, a, g)  # [B, T, N_i], [B, T, N_o]
        B = a.shape[0]
        m = self._token_weights(name, B, a.shape[1], a)
        self._add_covariance(name, _with_ones(a, m, info.bias), g, m)
        return a.new_zeros(B, 0)

    def means(self) -> dict[str, tuple[torch.Tensor, torch.Tensor, int]]:
        """layer → ``(A, S, tokens)``, float64 means over the tokens seen."""
        return {n: (self.cov_a[n] / max(1, t), self.cov_g[n] / max(1, t), t) for n, t in self.cov_tokens.items()}
