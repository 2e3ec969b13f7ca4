"""Targets sampled from the model's own predictive distribution (the true Fisher's labels).

Each example draws one uniform per next-token position from a generator seeded by
``(seed, example row)``, so its labels do not depend on the batch it shares, the pass that
draws them, the device or the chunking of the LM head: a target is the inverse CDF of the
position's softmax at that uniform. Only curvature factors use them; stored per-example
gradients always use the observed labels.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

FISHERS = ("empirical", "true")
"""``empirical``: factors from the observed labels; ``true``: from labels sampled from the model."""


def _row_seed(seed: int, row: int) -> int:
    digest = hashlib.sha256(f"gradindex/fisher/{seed}/{row}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def label_uniforms(seed: int, rows: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    """``[B, T-1]`` uniforms in [0, 1) for next-token positions (``T`` = longest length), 0 past each end."""
    T = max(lengths)
    out = torch.zeros(len(rows), max(T - 1, 1))
    for i, (r, n) in enumerate(zip(rows, lengths, strict=True)):
        if n > 1:
            out[i, : n - 1] = torch.rand(n - 1, generator=torch.Generator().manual_seed(_row_seed(seed, int(r))))
    return out[:, : max(T - 1, 0)] if T > 1 else out[:, :0]


def sample_targets(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``[N]`` targets drawn from the rows of ``probs`` ``[N, V]`` by inverse CDF at ``u`` ``[N]``."""
    cdf = probs.float().cumsum(dim=-1)  # [N, V]
    y = torch.searchsorted(cdf, u.to(cdf.device, cdf.dtype)[:, None].contiguous(), right=True)
    return y.squeeze(1).clamp_max(probs.shape[-1] - 1)
