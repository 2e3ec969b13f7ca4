"""One captured batch appended to a shard: the step of every loop that writes store rows (the
build's capture loop and the eigenbasis-store repair)."""

from __future__ import annotations

import numpy as np
from torch import nn

from gradindex.capture import GradientCapture
from gradindex.capture.batch import batch_gradients, finite_rows
from gradindex.data import Tokenized
from gradindex.store.shards import ShardWriter


def append_batch(w: ShardWriter, model: nn.Module, capture: GradientCapture, data: Tokenized, s: int, e: int,
                 pad_id: int, hashes: list[bytes], rows=None, heads=None) -> np.ndarray:
    """Capture examples ``s:e`` and append them to ``w`` (non-finite rows as zeros, through ``rows(grads)``
    when given), with their loss, token count, finite flag and token hash; return the ``[e - s]`` finite mask.
    ``heads`` (a :class:`~gradindex.precondition.fullspace.HeadGrads`): keep the batch's gradient w.r.t. the
    final hidden states there (the model must have a plain head), for the full-space fit's correction pass."""
    bg = batch_gradients(model, capture, data.input_ids[s:e], data.labels[s:e], pad_id,
                         keep_head_grad=heads is not None)
    if heads is not None:
        heads.put(range(s, e), bg.head_grad)
    grads = {n: v.cpu().numpy() for n, v in bg.grads.items()}
    ok = finite_rows(grads)
    if not ok.all():
        for n in grads:
            grads[n][~ok] = 0.0
    w.append(np.arange(s, e, dtype=np.int64), rows(grads) if rows else grads,
             loss=bg.loss.float().cpu().numpy(), num_tokens=bg.num_tokens.cpu().numpy().astype(np.int32),
             finite=ok, token_hash=np.frombuffer(b"".join(hashes[s:e]), np.uint8).reshape(-1, 16))
    return ok
