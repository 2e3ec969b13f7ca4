"""Re-rank candidates in full (unprojected) space, for every method, without forming their gradients.

The projection preserves inner products only in expectation; for the candidates a lookup returns,
the query's full per-layer gradient ``G_q = Σ_t g_t a_tᵀ`` is rebuilt (one example: a dense
``[N_o, N_i(+1)]`` matrix per layer), preconditioned once, ``M = (H + δI)⁻¹ G_q`` with the
full-space curvature (:func:`gradindex.precondition.load_full_preconditioner`), and each candidate is
scored from its per-token factors (:class:`~gradindex.capture.tokens.TokenCapture`, one forward +
backward per batch of candidates) as ``⟨M, G_t⟩ = Σ_t g_tᵀ M a_t``, never forming ``G_t``:

* ``graddot``: ``M = G_q``; ``cosine``: divided by ``‖G_q‖ ‖G_t‖``, with
  ``‖G_t‖² = Σ_{t,s} (g_t·g_s)(a_t·a_s)`` from the factors;
* ``kfac`` / ``ekfac``: ``M = (H + δI)⁻¹ G_q``, ``δ = damping × mean(Λ)`` per layer;
* ``<method>-selfnorm``: divided by ``sqrt`` of the candidate's full-space self-influence
  (``‖G_t‖²`` for GradDot; ``Σ_ij R_ij² / (Λ_ij + δ)`` with ``R = Σ_t (Q_Sᵀ g_t)(Q_Aᵀ a_t)ᵀ`` otherwise).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from gradindex.capture.batch import batch_gradients
from gradindex.capture.tokens import TokenCapture
from gradindex.methods import DEFAULT_DAMPING, method_spec, parse_method
from gradindex.precondition.apply import damped
from gradindex.precondition.fullspace import budget_bound, stored_share
from gradindex.precondition.preconditioner import Preconditioner

DEFAULT_RERANK = 100
"""Candidates the default query re-ranks in full space where the index's rows are a budget-bound
projection (``QueryEngine.query_batch(rerank_full=None)``): ``benchmarks/results/width.json``, the
first stage's recall of exhaustive full-space EK-FAC's top 10 against C (docs/query.md, "Two stages")."""
FULL_SPACE_METHODS = ("graddot", "cosine", "kfac", "ekfac")
"""Methods :func:`full_gradient_scores` answers (each also ``-selfnorm``)."""
__all__ = ["DEFAULT_RERANK", "FULL_SPACE_METHODS", "budget_bound", "full_gradient_scores", "full_query_gradient",
           "stored_share"]



def full_query_gradient(model: nn.Module, layers: list[str], query: tuple[list[int], list[int]], pad_id: int,
                        dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """layer → the query's full gradient ``G_q`` ``[N_o, N_i(+1)]`` (summed token loss), in ``dtype``."""
    out: dict[str, torch.Tensor] = {}

    def visit(name: str, a: torch.Tensor, g: torch.Tensor) -> None:
        out[name] = g[0].to(dtype).T @ a[0].to(dtype)

    with TokenCapture(model, layers, visit) as cap:
        batch_gradients(model, cap, [query[0]], [query[1]], pad_id)
    return out


def full_gradient_scores(
    model: nn.Module,
    layers: list[str],
    query: tuple[list[int], list[int]],
    train: tuple[list[list[int]], list[list[int]]],
    pad_id: int,
    method: str = "graddot",
    batch_size: int = 8,
    pre: Preconditioner | None = None,
    damping: float = DEFAULT_DAMPING,
    dtype: torch.dtype = torch.float32,
    query_matrices: dict[str, torch.Tensor] | None = None,
) -> np.ndarray:
    """``[n]`` float64 full-space scores of one query against ``n`` training examples (module docstring).

    ``pre``: the full-space preconditioner of a ``kfac``/``ekfac`` method (ignored for
    ``graddot``/``cosine``). Arithmetic in ``dtype`` (float32 by default; float64 for references).
    ``query_matrices``: layer → ``M`` to score with instead of ``(H + δI)⁻¹ G_q`` (a refined query,
    :meth:`gradindex.query.refine.Refiner.full_space`).
    """
    base, selfnorm = parse_method(method)
    fitted = method_spec(base).fitted is not None
    if fitted and (pre is None or pre.is_identity or pre.method != base):
        raise ValueError(f"full-space {base} scores need the full-space {base} preconditioner "
                         "(gradindex.precondition.load_full_preconditioner)")
    Gq = full_query_gradient(model, layers, query, pad_id, dtype)
    M = {}
    for n in layers:
        G = Gq[n]
        if query_matrices is not None:
            M[n] = query_matrices[n].to(G.device, dtype)
        else:
            M[n] = pre.apply(n, G.reshape(1, -1), -1.0, damping).reshape(G.shape) if fitted else G
    need_gram = base == "cosine" or (selfnorm and not fitted)
    eig = {}
    if selfnorm and fitted:
        for n in layers:
            Q_S, Q_A, Lam = pre._tensors(n, M[n].device, dtype)
            eig[n] = (Q_S, Q_A, damped(Lam, pre.delta(n, damping), -1.0))
    t_ids, t_labels = train
    dots = np.zeros(len(t_ids))
    norms = np.zeros(len(t_ids))
    cur: dict[str, torch.Tensor] = {}

    def visit(name: str, a: torch.Tensor, g: torch.Tensor) -> None:
        a, g = a.to(dtype), g.to(dtype)
        d = ((a @ M[name].T) * g).sum(dim=(1, 2))  # [B]: Σ_t g_tᵀ M a_t
        if need_gram:
            sq = ((g @ g.transpose(1, 2)) * (a @ a.transpose(1, 2))).sum(dim=(1, 2))  # ‖G_t‖²
        elif eig:
            Q_S, Q_A, w = eig[name]
            R = torch.bmm((g @ Q_S).transpose(1, 2), a @ Q_A)  # [B, N_o, N_i(+1)]
            sq = (R.square() * w).sum(dim=(1, 2))
        else:
            sq = torch.zeros_like(d)
        cur["dot"] = cur["dot"] + d if "dot" in cur else d
        cur["sq"] = cur["sq"] + sq if "sq" in cur else sq

    with TokenCapture(model, layers, visit) as cap:
        for s in range(0, len(t_ids), batch_size):
            cur.clear()
            batch_gradients(model, cap, t_ids[s:s + batch_size], t_labels[s:s + batch_size], pad_id)
            e = s + len(cur["dot"])
            dots[s:e] = cur["dot"].double().cpu().numpy()
            norms[s:e] = cur["sq"].double().cpu().numpy()
    if base == "cosine":
        q_norm = float(torch.sqrt(sum(G.double().square().sum() for G in Gq.values())))
        denom = q_norm * np.sqrt(np.maximum(norms, 0.0))
        return np.where(denom > 0, dots / np.where(denom > 0, denom, 1.0), 0.0)
    if selfnorm:
        return np.where(norms > 0, dots / np.sqrt(np.where(norms > 0, norms, 1.0)), 0.0)
    return dots
