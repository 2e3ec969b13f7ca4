"""One captured batch appended to a shard: the step of every loop that writes store rows (the
build's capture loop and the eigenbasis-store repair), and the row sink that receives the batch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from torch import nn

from gradindex.capture import GradientCapture
from gradindex.capture.batch import batch_gradients, finite_rows
from gradindex.data import Tokenized
from gradindex.store.shards import ShardWriter


class RowSink:
    """What each captured batch of a store build goes to. This one writes the rows as captured (the plain
    writer); :class:`~gradindex.precondition.sampled.EigenCoder` codes them in a fit's whitened eigenbasis.
    ``heads`` (a :class:`~gradindex.precondition.fullspace.HeadGrads`): also keep each batch's gradient
    w.r.t. the final hidden states there, for the full-space fit's correction pass."""

    storage = ""  # codes of the rows it writes; empty: the build's capture storage
    coded = False  # rows coded after a fit: no factor sums, per-shard results kept (a partial shard is redone)

    def __init__(self, heads=None) -> None:
        self.heads = heads

    def identity(self, identity: dict) -> dict:  # what the build records (a coder adds what its rows depend on)
        return identity

    def start(self, out: Path, manifest: dict) -> dict:  # the manifest it starts with (a coder writes its basis)
        return manifest

    def rows(self, s: int, grads: dict[str, np.ndarray]) -> dict[str, np.ndarray]:  # rows of examples s, s+1, ...
        return grads

    def shard_done(self, k: int, start: int, end: int) -> None:
        """Shard ``k`` (examples ``start:end``) is captured, about to be sealed."""


def append_batch(w: ShardWriter, model: nn.Module, capture: GradientCapture, data: Tokenized, s: int, e: int,
                 pad_id: int, hashes: list[bytes], sink: RowSink) -> np.ndarray:
    """Capture examples ``s:e`` and append them to ``w`` (non-finite rows as zeros, through ``sink.rows``),
    with their loss, token count, finite flag and token hash; return the ``[e - s]`` finite mask."""
    bg = batch_gradients(model, capture, data.input_ids[s:e], data.labels[s:e], pad_id,
                         keep_head_grad=sink.heads is not None)
    if sink.heads is not None:
        sink.heads.put(range(s, e), bg.head_grad)
    grads = {n: v.cpu().numpy() for n, v in bg.grads.items()}
    ok = finite_rows(grads)
    if not ok.all():
        for n in grads:
            grads[n][~ok] = 0.0
    w.append(np.arange(s, e, dtype=np.int64), sink.rows(s, grads),
             loss=bg.loss.float().cpu().numpy(), num_tokens=bg.num_tokens.cpu().numpy().astype(np.int32),
             finite=ok, token_hash=np.frombuffer(b"".join(hashes[s:e]), np.uint8).reshape(-1, 16))
    return ok
