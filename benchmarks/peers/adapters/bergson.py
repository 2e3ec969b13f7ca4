"""Bergson (EleutherAI, PyPI ``bergson``) on the shared workload, through its public Python API.

``build``: ``bergson.collect_gradients`` with a ``GradientProcessor`` (``projection_dim`` 16 →
16x16 = 256 numbers per layer, Rademacher, as ``bergson build --projection_dim 16``; 0 = the full
gradient) and an ``IndexConfig`` (summed loss per sequence, fp32, bias gradients included as
gradindex's bias column), batches of 8 sequences, into an on-disk index; the ``.part`` directory is
promoted as ``bergson build`` does, then ``bergson.Attributor`` loads it (no FAISS: exact inner
products). ``query_Q``: ``Attributor.trace`` around the first ``Q`` queries' summed-loss backward
(``k`` = every example; the sorted scores are put back in training order). Bergson hooks every
Linear / Conv1D under ``model.base_model`` — the 16 block layers here (GPT-2's LM head is outside).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.peers.common import Clock, Workload, adapter_main, summed_lm_loss  # noqa: E402


def method(projection_dim: int):
    def run(w: Workload, queries: list[int], clock: Clock) -> dict:
        from bergson import Attributor, GradientProcessor, IndexConfig, collect_gradients
        from datasets import Dataset

        N, T = w.train.shape
        out = {}
        with tempfile.TemporaryDirectory(prefix="bergson-") as d:
            with clock.phase("build"):
                ds = Dataset.from_dict({"input_ids": w.train.tolist(), "length": [T] * N})
                cfg = IndexConfig(run_path=str(Path(d) / "index"), model=str(w.root / "model"),
                                  projection_dim=projection_dim, include_bias=True, loss_reduction="sum",
                                  precision="fp32", token_batch_size=w.batch_size * T,
                                  max_batch_size=w.batch_size)
                processor = GradientProcessor(projection_dim=projection_dim or None, include_bias=True)
                cfg.partial_run_path.mkdir(parents=True)
                processor.save(cfg.partial_run_path)
                batches = [list(range(s, min(s + w.batch_size, N))) for s in range(0, N, w.batch_size)]
                collect_gradients(w.model, ds, processor, cfg, batches=batches)
                shutil.move(cfg.partial_run_path, cfg.run_path)
                attributor = Attributor(cfg.run_path, device="cpu")
            for q in queries:
                with clock.phase(f"query_{q}"):
                    ids = w.queries[:q]
                    with attributor.trace(w.model.base_model, k=None) as res:
                        summed_lm_loss(w.model(ids).logits, ids).sum().backward()
                    w.model.zero_grad(set_to_none=True)
                    scores = np.empty((q, N))
                    np.put_along_axis(scores, res.indices.numpy(), res.scores.double().numpy(), axis=1)
                    out[q] = scores
        return out

    return run


METHODS = {"graddot-proj": method(16), "graddot-full": method(0)}

if __name__ == "__main__":
    torch.set_num_threads(1)
    raise SystemExit(adapter_main(METHODS, ("bergson",)))
