"""Re-rank the top candidates with full (unprojected) gradients rebuilt on demand.

The projection preserves inner products only in expectation; for the few results a user looks
at, their exact per-example gradients and the query's are recomputed with the same capture code
(``ProjectionSpec(kind='none')``) and dotted layer by layer, a few candidates at a time so that
memory stays at one batch of full gradients. The preconditioners live in the projected space,
so this applies to ``graddot`` and ``cosine``.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from gradindex.capture import GradientCapture, ProjectionSpec
from gradindex.capture.batch import batch_gradients

FULL_METHODS = ("graddot", "cosine")


def full_gradient_scores(
    model: nn.Module,
    layers: list[str],
    query: tuple[list[int], list[int]],
    train: tuple[list[list[int]], list[list[int]]],
    pad_id: int,
    method: str = "graddot",
    batch_size: int = 8,
) -> np.ndarray:
    """``[n]`` float64 full-gradient scores of one query against ``n`` training examples.

    ``graddot``: ``Σ_l ⟨G_q,l, G_t,l⟩``; ``cosine``: divided by the full norms over ``layers``.
    """
    if method not in FULL_METHODS:
        raise ValueError(
            f"full-gradient re-ranking supports {FULL_METHODS}, not {method!r} (the preconditioner is "
            "fitted in the projected space); drop rerank_full / --rerank-full or use graddot"
        )
    spec = ProjectionSpec(kind="none", k_a=0, k_g=0)
    t_ids, t_labels = train
    out = np.zeros(len(t_ids))
    with GradientCapture(model, layers, spec, route="materialized") as cap:
        q = batch_gradients(model, cap, [query[0]], [query[1]], pad_id).grads  # {layer: [1, D]}
        q = {n: v[0].double() for n, v in q.items()}
        q_norm = torch.sqrt(sum(v.square().sum() for v in q.values()))
        for s in range(0, len(t_ids), batch_size):
            g = batch_gradients(model, cap, t_ids[s:s + batch_size], t_labels[s:s + batch_size], pad_id).grads
            dots = sum(g[n].double() @ q[n] for n in layers)  # [b]
            if method == "cosine":
                t_norm = torch.sqrt(sum(g[n].double().square().sum(1) for n in layers))
                denom = q_norm * t_norm
                dots = torch.where(denom > 0, dots / denom.clamp_min(1e-300), torch.zeros_like(dots))
            out[s:s + len(dots)] = dots.cpu().numpy()
    return out
