"""The true Fisher's EK-FAC eigenvalue correction: a model pass with targets sampled from the model.

The empirical Fisher's correction ``Λ*_ij = mean_n (Q_Sᵀ Ĝ_n Q_A)²_ij`` reads the stored rows
(:func:`gradindex.precondition.ekfac.store_pass`). The true Fisher's needs per-example gradients
of sampled targets, which are never stored (stored rows always use the observed labels), so they
are recomputed here, with the build's hooks and projection and the same samples as the factor
pass (:func:`gradindex.capture.sampling.label_uniforms` is keyed by seed and row).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from gradindex.capture import GradientCapture, ProjectedRows, ProjectionSpec, RowSpace
from gradindex.capture.batch import batch_gradients, finite_rows
from gradindex.capture.sampling import label_uniforms
from gradindex.data import Tokenized
from gradindex.precondition.apply import rotate
from gradindex.precondition.ekfac import Basis
from gradindex.progress import progress_bar
from gradindex.spec.build import DEFAULT_BATCH_SIZE


def model_correction(
    model: nn.Module,
    tokenizer,
    data: Tokenized,
    rows: Sequence[int],
    layers: Sequence[str],
    projection: ProjectionSpec,
    bases: dict[str, Basis],
    seed: int = 0,
    batch_size: int = DEFAULT_BATCH_SIZE,
    route: str = "auto",
    dtype: torch.dtype | dict[str, torch.dtype] = torch.float64,
    progress: bool = False,
    transforms: dict | None = None,
) -> dict[str, np.ndarray]:
    """layer → ``Λ*`` ``[k_g, k_a]`` (float64) of sampled-target gradients over ``rows`` (finite ones).

    ``dtype``: of the rotations, one for all layers or per layer. ``transforms`` are the capture's side
    maps of the index's row basis, as in the factor pass.
    """
    dtypes = dtype if isinstance(dtype, dict) else {n: dtype for n in layers}
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    was = {n: p.requires_grad for n, p in model.named_parameters()}
    model.requires_grad_(False)
    cap = GradientCapture(model, list(layers), ProjectedRows(RowSpace(projection, transforms), route))
    dev = next(model.parameters()).device
    mats = {n: (torch.as_tensor(bases[n].Q_S, dtype=dtypes[n], device=dev),
                torch.as_tensor(bases[n].Q_A, dtype=dtypes[n], device=dev)) for n in layers}
    sums = {n: torch.zeros(mats[n][0].shape[0], mats[n][1].shape[0], dtype=torch.float64, device=dev)
            for n in layers}
    rows, n_ok = list(rows), 0
    try:
        with cap, progress_bar(total=len(rows), unit="ex", desc="true-Fisher correction", disable=not progress) as bar:
            for s in range(0, len(rows), batch_size):
                idx = rows[s: s + batch_size]
                ids = [data.input_ids[i] for i in idx]
                u = label_uniforms(seed, idx, [len(x) for x in ids])
                grads = batch_gradients(model, cap, ids, [data.labels[i] for i in idx], pad_id, u).grads
                ok = torch.as_tensor(finite_rows({n: v.cpu().numpy() for n, v in grads.items()}), device=dev)
                n_ok += int(ok.sum())
                for n in layers:
                    Q_S, Q_A = mats[n]
                    R = rotate(grads[n][ok].to(dtypes[n]).view(-1, Q_S.shape[0], Q_A.shape[0]), Q_S, Q_A)
                    sums[n] += R.square().sum(0).double()
                bar.update(len(idx))
    finally:
        for n, p in model.named_parameters():
            p.requires_grad_(was[n])
    return {n: (sums[n] / max(1, n_ok)).cpu().numpy() for n in layers}
