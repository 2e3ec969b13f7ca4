"""LogIX (PyPI ``logix-ai``) on the shared workload, through its public API.

LogIX tracks ``nn.Linear``, so each block ``Conv1D`` becomes the equal ``nn.Linear``. Its LoGra
projection is a LoRA-style bottleneck ``C(B(A x))`` with a zero ``B`` whose gradient is the
projected gradient: ``add_lora`` with rank 16 → 16x16 = 256 numbers per layer (``-proj``);
without LoRA the whole weight gradient is logged (``-full``; LogIX keeps no bias column).
``build``: a ``LogIXScheduler(lora=..., hessian=..., save="grad")`` run over the training batches
(GradDot: one pass; K-FAC: one pass with the covariances; EK-FAC: a covariance pass, then a pass
that logs and corrects the eigenvalues), ``finalize``, and the log data loader; ``query_Q``: the
first ``Q`` queries' gradients logged in eval mode, then ``compute_influence_all`` (damping
``None`` = 0.1 × the mean eigenvalue per module, as gradindex). Loss summed per sequence.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np  # noqa: E402

from benchmarks.peers.common import Clock, Workload, adapter_main, conv1d_to_linear, summed_lm_loss  # noqa: E402


def method(lora: str, hessian: str):
    def run(w: Workload, queries: list[int], clock: Clock) -> dict:
        import yaml
        from logix import LogIX, LogIXScheduler

        tracked = conv1d_to_linear(w.model)
        N = len(w.train)
        out = {}
        with tempfile.TemporaryDirectory(prefix="logix-") as d:
            config = Path(d) / "config.yaml"
            config.write_text(yaml.safe_dump({"root_dir": d, "lora": {"init": "random", "rank": 16}}))
            with clock.phase("build"):
                run = LogIX("peers", config=str(config))
                run.watch(w.model, name_filter=tracked)
                for _ in LogIXScheduler(run, lora=lora, hessian=hessian, save="grad"):
                    for s in range(0, N, w.batch_size):
                        ids = w.train[s:s + w.batch_size]
                        with run(data_id=[str(i) for i in range(s, s + len(ids))]):
                            w.model.zero_grad(set_to_none=True)
                            summed_lm_loss(w.model(input_ids=ids).logits, ids).sum().backward()
                    run.finalize()
                loader = run.build_log_dataloader(batch_size=64)
            run.eval()
            run.setup({"grad": ["log"]})
            for q in queries:
                with clock.phase(f"query_{q}"):
                    ids = w.queries[:q]
                    with run(data_id=[f"q{i}" for i in range(q)]):
                        w.model.zero_grad(set_to_none=True)
                        summed_lm_loss(w.model(input_ids=ids).logits, ids).sum().backward()
                    res = run.compute_influence_all(run.get_log(), loader, precondition=hessian != "none")
                    cols = np.array([int(t) for t in res["tgt_ids"]])
                    scores = np.empty((q, N))
                    scores[:, cols] = res["influence"].double().numpy()
                    out[q] = scores
        return out

    return run


METHODS = {
    "graddot-proj": method("random", "none"),
    "kfac-proj": method("random", "kfac"),
    "ekfac-proj": method("random", "ekfac"),
    "graddot-full": method("none", "none"),
    "ekfac-full": method("none", "ekfac"),
}

if __name__ == "__main__":
    raise SystemExit(adapter_main(METHODS, ("logix-ai",)))
