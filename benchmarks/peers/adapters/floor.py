"""The floor: a bare forward + backward over the training sequences in batches (run in gradindex's venv).

The same function as ``benchmarks/capture.py``'s floor (HF mean loss, weight gradients,
``zero_grad(set_to_none=True)``); no scores (it attributes nothing).
"""

from __future__ import annotations

from benchmarks.capture import run_floor  # noqa: E402
from benchmarks.peers.common import Clock, Workload, adapter_main  # noqa: E402


def floor(w: Workload, queries: list[int], clock: Clock) -> dict:
    seqs = w.train.tolist()
    with clock.phase("build"):
        run_floor(w.model, seqs, w.batch_size)
    return {}


if __name__ == "__main__":
    raise SystemExit(adapter_main({"floor": floor}))
