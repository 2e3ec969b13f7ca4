"""The stored space of a capture: each layer's projection after its change of coordinates, and the per-token maps
into it (the side maps and scales every consumer of stored-space factors shares: rows, K-FAC sums, token factors)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from gradindex.capture.layers import LayerInfo, some_names
from gradindex.capture.projection import ProjectionSpec, projection_matrix
from gradindex.capture.transform import SIDES, LayerTransform

Transforms = Mapping[str, LayerTransform | Mapping[str, torch.Tensor]]


def with_ones(a: torch.Tensor, m: torch.Tensor | None, bias: bool) -> torch.Tensor:
    """``a`` ``[B, T, N_i]`` times the token weights ``m``, with a column of ``m`` (or 1) for the bias."""
    if not bias:
        return a if m is None else a * m
    B, T, n_in = a.shape
    out = a.new_empty(B, T, n_in + 1)  # [B, T, N_i+1]
    if m is None:
        out[..., :n_in] = a
        out[..., n_in] = 1.0
    else:
        torch.mul(a, m, out=out[..., :n_in])
        out[..., n_in:] = m
    return out


def check_transforms(transforms: Transforms, infos: Mapping[str, LayerInfo]) -> dict[str, LayerTransform]:
    """Validate per-layer transforms (a :class:`LayerTransform`, or ``{"a": M_a, "g": M_g}`` dense maps)."""
    out: dict[str, LayerTransform] = {}
    for name, t in transforms.items():
        if name not in infos:
            raise ValueError(f"transform given for layer {name!r}, which is not hooked (hooked: {some_names(infos)})")
        if not isinstance(t, LayerTransform):
            t = LayerTransform.from_maps(dict(t))
        info = infos[name]
        for side in SIDES:
            n = info.n_in_total if side == "a" else info.n_out
            M, d = t.map(side), t.scale(side)
            if M is not None and (M.ndim != 2 or M.shape[1] != n):
                raise ValueError(f"transform of layer {name!r} side {side!r} must be [m, {n}], got {tuple(M.shape)}")
            if d is not None and tuple(d.shape) != (n,):
                raise ValueError(f"scales of layer {name!r} side {side!r} must be [{n}], got {tuple(d.shape)}")
        if t.elementwise is not None and tuple(t.elementwise.shape) != (info.n_out, info.n_in_total):
            raise ValueError(f"entrywise weights of layer {name!r} must be [{info.n_out}, {info.n_in_total}], "
                             f"got {tuple(t.elementwise.shape)}")
        if t.keep is not None:
            size = t.out_size("g", info.n_out) * t.out_size("a", info.n_in_total)
            if t.keep.ndim != 1 or not len(t.keep) or int(t.keep.min()) < 0 or int(t.keep.max()) >= size:
                raise ValueError(f"kept coordinates of layer {name!r} must be a non-empty [d] index into its "
                                 f"{size} mapped coordinates")
        out[name] = t
    return out


class RowSpace:
    """Where each layer's per-example gradient is stored: ``P_g M_g G M_aᵀ P_aᵀ`` (``P``: the projection, ``M``:
    the layer's :class:`LayerTransform`), with its per-token maps. Bound to the hooked layers' shapes
    (:meth:`bind`) before use; the transforms are checked then."""

    def __init__(self, projection: ProjectionSpec = ProjectionSpec(), transforms: Transforms | None = None) -> None:
        self.projection = projection
        self._given = transforms or {}
        self.infos: Mapping[str, LayerInfo] = {}
        self.transforms: dict[str, LayerTransform] = {}
        """layer → change of coordinates applied before the projection (:mod:`gradindex.capture.transform`)."""
        self._proj: dict[tuple[str, str, str], torch.Tensor | None] = {}
        self._proj_a: dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor | None]] = {}

    def bind(self, infos: Mapping[str, LayerInfo]) -> RowSpace:
        """Take the layers' shapes (again: a no-op for the same ones) and check the transforms against them."""
        if infos is not self.infos:
            self.transforms = check_transforms(self._given, infos)
            self.infos = infos
            self._proj.clear()
            self._proj_a.clear()
        return self

    def factored(self, what: str, entrywise: bool = True) -> None:
        """Refuse ``what`` (factors of the stored sides) where a transform has no factored form (``entrywise``:
        entrywise weights too)."""
        if entrywise and any(t.elementwise is not None for t in self.transforms.values()):
            raise ValueError(f"{what} of entrywise-weighted gradients are not supported (the weights have no "
                             "per-token form); collect them without --optimizer-state")
        if any(t.keep is not None for t in self.transforms.values()):
            raise ValueError("rows of chosen eigen-coordinates (the eigen basis) have no factored form: they are "
                             f"whitened at capture and need no {what}")

    # -- shapes -------------------------------------------------------------------------------
    def side_size(self, name: str, side: str) -> int:
        """Stored size of one side: ``k`` when projected, else the transform's rows, else the width."""
        info = self.infos[name]
        k = self.projection.layer_sizes(name)[0 if side == "a" else 1]
        if k:
            return k
        n = info.n_in_total if side == "a" else info.n_out
        t = self.transforms.get(name)
        return n if t is None else t.out_size(side, n)

    def dims(self, name: str) -> tuple[int, int]:
        """``(rows, cols)`` of the stored per-example matrix of a layer (``k_g, k_a`` or ``N_o, N_i+1``;
        ``1, d`` for a transform that keeps ``d`` chosen coordinates)."""
        t = self.transforms.get(name)
        if t is not None and t.keep is not None:
            return 1, int(t.keep.numel())
        return self.side_size(name, "g"), self.side_size(name, "a")

    def dim(self, name: str) -> int:
        r, c = self.dims(name)
        return r * c

    # -- maps ---------------------------------------------------------------------------------
    def side_map(self, name: str, side: str, device: torch.device | str) -> torch.Tensor | None:
        """``[k, n]`` map of one side's per-token vectors to the stored side.

        ``P M`` (projection after the layer's side map ``M``: dense, or the diagonal of its scales), ``P``,
        the dense ``M``, or ``None`` for an unprojected side with no dense map (its scales, if any, are
        applied by :meth:`side_scale`).
        """
        key = (name, side, str(device))
        if key not in self._proj:
            info = self.infos[name]
            t = self.transforms.get(name)
            n = info.n_in_total if side == "a" else info.n_out
            k = self.projection.layer_sizes(name)[0 if side == "a" else 1]
            if k:
                m = n if t is None else t.out_size(side, n)
                P = projection_matrix(self.projection, name, side, m)  # [k, m]
                M = P if t is None else t.fold(side, P)  # [k, n]
            else:
                M = None if t is None or t.map(side) is None else t.map(side).float()  # [m, n]
            self._proj[key] = None if M is None else M.to(device)
        return self._proj[key]

    def side_scale(self, name: str, side: str) -> torch.Tensor | None:
        """``[n]`` scales of an unprojected side without a dense map (else folded into :meth:`side_map`)."""
        t = self.transforms.get(name)
        if t is None or t.map(side) is not None or self.projection.layer_sizes(name)[0 if side == "a" else 1]:
            return None
        return t.scale(side)

    def map_inputs(self, name: str, a: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
        """``M_a [a, 1]`` per token ``[B, T, k_a]`` in one matmul (bias column folded in), masked."""
        key = (name, str(a.device))
        if key not in self._proj_a:
            M_a = self.side_map(name, "a", a.device)  # [k_a, N_i(+1)] or None
            if M_a is None:
                a1 = with_ones(a, m, self.infos[name].bias)  # [B, T, N_i(+1)]
                d_a = self.side_scale(name, "a")
                return a1 if d_a is None else a1 * d_a.to(a1.device, a1.dtype)
            n_in = self.infos[name].n_in
            bias = M_a[:, n_in].clone() if self.infos[name].bias else None  # [k_a]
            self._proj_a[key] = (M_a[:, :n_in].T.contiguous(), bias)  # [N_i, k_a], [k_a]
        P_t, p_b = self._proj_a[key]
        B, T, n_in = a.shape
        a2 = a.reshape(B * T, n_in)
        ab = (a2 @ P_t if p_b is None else torch.addmm(p_b, a2, P_t)).view(B, T, -1)
        return ab if m is None else ab.mul_(m)

    def map_outputs(self, name: str, g: torch.Tensor) -> torch.Tensor:
        """``M_g g`` per token ``[B, T, k_g]``, or ``g`` scaled by ``d_g`` on an unprojected side."""
        M_g = self.side_map(name, "g", g.device)
        if M_g is not None:
            return g @ M_g.T
        d_g = self.side_scale(name, "g")
        return g if d_g is None else g * d_g.to(g.device, g.dtype)
