"""Per-token factors of the hooked layers, handed to a visitor instead of summed into gradients.

A layer's per-example weight gradient is ``G = Σ_t g_t a_tᵀ`` (docs/design.md, "The math in brief"). Full-space
curvature and full-space scores never need ``G`` itself, only sums over tokens of products of
``a_t`` and ``g_t`` with fixed matrices (``Σ a aᵀ``, ``Q_Sᵀ G Q_A = Σ (Q_Sᵀ g)(Q_Aᵀ a)ᵀ``,
``Σ_t g_tᵀ M a_t``). :class:`TokenCapture` runs the same hooks and weight-free backward as
:class:`~gradindex.capture.hooks.GradientCapture` and calls ``visit(name, a, g)`` per layer and batch
with ``a`` ``[B, T, N_i(+1)]`` (bias column appended, padding tokens zeroed) and ``g`` ``[B, T, N_o]``
(padding tokens zeroed), both float32, so that ``G_b = g[b]ᵀ a[b]``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from gradindex.capture.hooks import GradientCapture, _with_ones
from gradindex.capture.projection import ProjectionSpec

Visitor = Callable[[str, torch.Tensor, torch.Tensor], None]


class TokenCapture(GradientCapture):
    """Weight-free hooks whose per-layer per-token ``(a, g)`` go to ``visit``; no gradient is formed.

    Drive it like a :class:`GradientCapture` (``batch_gradients`` works: its ``grads`` are empty).
    """

    def __init__(self, model: nn.Module, layers: Sequence[str] | None, visit: Visitor) -> None:
        super().__init__(model, layers, ProjectionSpec(kind="none", k_a=0, k_g=0), "materialized",
                         weight_free=True)
        self.visit = visit

    def set_mask(self, mask: torch.Tensor | None, shape: tuple[int, int] | None = None) -> None:
        """As :meth:`GradientCapture.set_mask`; a batch without padding is not masked (the same factors)."""
        super().set_mask(mask, shape)
        if mask is not None and bool(mask.all()):
            self._mask = None  # the batch's shape is kept

    def _accumulate(self, name: str, a: torch.Tensor, g: torch.Tensor) -> None:
        info = self.infos[name]
        a, g = self.per_token(name, a, g)  # [B, T, N_i], [B, T, N_o]
        m = self._token_weights(name, a.shape[0], a.shape[1], a)  # [B, T, 1] or None
        self.route_counts["tokens"] += 1
        self.visit(name, _with_ones(a, m, info.bias), g if m is None else g * m)

    def full_shape(self, name: str) -> tuple[int, int]:
        """``(N_o, N_i(+1))``: the layer's full-space gradient matrix."""
        info = self.infos[name]
        return info.n_out, info.n_in_total
