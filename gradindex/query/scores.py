"""Exact scores without an index: queries against every stored example, streaming the store.

This is the reference path an index must agree with (and the "exact" baseline of recall
measurements). For query rows ``q_l`` and stored rows ``t_l`` of the selected layers ``l``:

* ``graddot``: ``Σ_l ⟨q_l, t_l⟩``;
* ``cosine``: ``Σ_l ⟨q_l, t_l⟩ / (‖q‖ ‖t‖)``, norms over the selected layers concatenated;
* ``kfac`` / ``ekfac``: ``Σ_l ⟨(H_l + δ_l I)⁻¹ q_l, t_l⟩``, ``δ_l = damping × mean(Λ_l)``;
* ``<method>-selfnorm``: the score divided by ``sqrt`` of the training example's self-influence
  under that method (same damping and layers), i.e. ``⟨H^{-1/2} q, H^{-1/2} t / ‖H^{-1/2} t‖⟩``.
  An example with zero self-influence (an all-zero row) scores 0.

On an index whose rows are in a whitened basis the method names the influence asked for, and
:func:`gradindex.methods.row_base` says which of these operations answers it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from gradindex.index import OpenIndex
from gradindex.methods import DEFAULT_DAMPING
from gradindex.model import resolve_device
from gradindex.precondition.ekfac import block_rows
from gradindex.query.defaults import answer_for
from gradindex.store.opened import opened


def score_matrix(index: str | os.PathLike | OpenIndex, query_grads: Mapping[str, torch.Tensor | np.ndarray],
                 method: str | None = None, damping: float = DEFAULT_DAMPING, layers: Sequence[str] | None = None,
                 block: int = 4096, device: str = "auto", dtype: torch.dtype | None = None) -> np.ndarray:
    """``[Q, N]`` float64 scores of ``Q`` queries against every stored example (column = example id).

    ``index``: an index directory, or an :class:`~gradindex.index.OpenIndex` (nothing is re-read).
    ``query_grads``: layer → ``[Q, D]`` projected query gradients (as captured with the index's
    projection). ``method``: default the index's default query method (``ekfac-selfnorm`` where it answers
    ``ekfac``: :func:`~gradindex.query.defaults.default_query_method`; where the self-influence cannot be had, plain
    ``ekfac`` with a warning logged). ``layers``: default all the index's layers. Arithmetic runs on ``device``
    (``auto``: the GPU when present) in ``dtype`` (default float64 on CPU, float32 on GPU).
    """
    with opened(index, "score it", OpenIndex) as ix:
        answer = answer_for(ix, method, damping, ix.selected_layers(layers), log_notes=False)  # (the engine's steps)
        return _scores(ix, query_grads, answer.base, answer.scale, damping, layers, block, device, dtype)


def _scores(ix: OpenIndex, query_grads, base: str, scale: np.ndarray | None, damping: float, layers, block: int,
            device: str, dtype: torch.dtype | None) -> np.ndarray:
    """Every example's score under the operation ``base`` on the stored rows, times its ``-selfnorm`` ``scale``
    (``1/sqrt`` of its self-influence; 0 for none) where given."""
    layers = ix.selected_layers(layers)
    lacking = [n for n in layers if n not in query_grads]
    if lacking:
        raise ValueError(f"query_grads has no rows for layers {lacking}; pass every selected layer, "
                         "or choose layers=")
    dev = resolve_device(device)
    dtype = dtype or (torch.float64 if dev.type == "cpu" else torch.float32)
    P = ix.preconditioner(base)
    q: dict[str, torch.Tensor] = {}
    n_q = None
    for n in layers:
        x = torch.as_tensor(query_grads[n]).to(dev, dtype)  # [Q, D]
        k_g, k_a = ix.shapes[n]
        if x.ndim != 2 or x.shape[1] != k_g * k_a or (n_q is not None and x.shape[0] != n_q):
            raise ValueError(f"query rows of layer {n!r} must be [Q, {k_g * k_a}] with one Q for all layers; "
                             f"got {tuple(x.shape)}")
        n_q = x.shape[0]
        q[n] = x if P.is_identity else P.apply(n, x, -1.0, damping)
    if base == "cosine":
        q_norm = torch.sqrt(sum(v.square().sum(1) for v in q.values()))  # [Q]
    out = np.zeros((n_q, ix.n))
    store = ix.store
    rows = block_rows(store.dims, layers, block)
    for ids, grads in store.iter_blocks(layers, rows):
        pos = store.positions(ids)
        s = torch.zeros(n_q, len(ids), device=dev, dtype=dtype)  # [Q, n]
        t_sq = torch.zeros(len(ids), device=dev, dtype=dtype)  # [n]
        for n in layers:
            t = torch.from_numpy(grads[n]).to(dev, dtype)  # [n, D]
            s += q[n] @ t.T
            if base == "cosine":
                t_sq += t.square().sum(1)
        if base == "cosine":
            denom = q_norm[:, None] * t_sq.sqrt()[None, :]
            s = torch.where(denom > 0, s / denom.clamp_min(torch.finfo(dtype).tiny), torch.zeros_like(s))
        out[:, pos] = s.double().cpu().numpy()
    if scale is not None:
        out *= scale[None, :]
    return out
