"""The sketch tier's first-stage scan at 10⁴-10⁶ rows: the int8 matrix product against FAISS's kernel.

The first tier scores every example (:class:`gradindex.index.sketch.SketchIndex`): one query's
sketch against ``N`` int8 rows of ``m`` numbers (``m`` = 2,044 at the default 2,048 bytes per
example), then the per-row scales and the top/bottom ``C`` (:func:`gradindex.query.search.top_and_bottom`).
Its time depends on ``N`` and ``m``, not on the values, so random codes time it (recall on real
rows is :mod:`benchmarks.lookup`'s). Both kernels run side by side in one process on the same
codes, one query at a time; the scores are checked against each other.

    python -m benchmarks.sketch_scan                         # N = 10⁴, 10⁵, 10⁶ (about 4.5 GB RAM)
    python -m benchmarks.sketch_scan --examples 100000 --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import time
from pathlib import Path

import faiss
import numpy as np
import torch

from gradindex.index.sketch import SKETCH_BYTES, Sketch, SketchIndex
from gradindex.query.search import top_and_bottom

RESULTS = Path(__file__).resolve().parent / "results"


def time_kernel(ix: SketchIndex, q: np.ndarray, c: int) -> tuple[dict, np.ndarray]:
    """p50/p95 seconds of the scan plus the top/bottom ``c``, one query at a time; the scores."""
    ts, out = [], []
    for j in range(len(q)):
        t = time.perf_counter()
        s = ix.scores(q[j:j + 1]).astype(np.float64)
        top_and_bottom(s, c, c, margin=0)
        ts.append(time.perf_counter() - t)
        out.append(s[0])
    return {"p50_s": float(np.percentile(ts[1:], 50)), "p95_s": float(np.percentile(ts[1:], 95))}, np.array(out)


def run_n(n: int, m: int, queries: int, c: int) -> dict:
    rng = np.random.default_rng(n)
    codes = rng.integers(0, 256, size=(n, m), dtype=np.uint8)
    scales = rng.lognormal(0, 1, n).astype(np.float32)
    q = rng.standard_normal((queries + 1, m)).astype(np.float32)  # the first is a warm-up
    sk = Sketch(0, {"all": m}, {"all": m})
    ix = SketchIndex(sk, codes, scales)
    assert ix.index is None, "torch._int_mm is not usable here"
    fast, s_fast = time_kernel(ix, q, c)
    ix._to_faiss(codes, 1 << 16)
    slow, s_slow = time_kernel(ix, q, c)
    rel = float(np.abs(s_fast - s_slow).max() / np.abs(s_slow).max())
    row = {"examples": n, "sketch_numbers": m, "int8_matmul": fast, "faiss": slow,
           "speedup_p50": slow["p50_s"] / fast["p50_s"], "max_rel_score_diff": rel}
    print(f"N={n:>8}: int8 matmul p50/p95 {fast['p50_s']:.3f}/{fast['p95_s']:.3f} s, "
          f"FAISS {slow['p50_s']:.3f}/{slow['p95_s']:.3f} s ({row['speedup_p50']:.1f}x), "
          f"max rel. score diff {rel:.1e}", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--examples", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    ap.add_argument("--numbers", type=int, default=SKETCH_BYTES - 4, help="sketch numbers per example")
    ap.add_argument("--queries", type=int, default=20)
    ap.add_argument("--candidates", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=RESULTS / "sketch_scan.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    faiss.omp_set_num_threads(args.threads)
    load0 = os.getloadavg()
    runs = [run_n(n, args.numbers, args.queries, args.candidates) for n in args.examples]
    res = {"what": __doc__.split("\n\n")[0], "machine": {
        "cpus": os.cpu_count(), "threads": args.threads, "platform": platform.platform(),
        "torch": torch.__version__, "faiss": faiss.__version__, "load_average_start": load0,
        "load_average_end": os.getloadavg(),
        "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024},
        "queries": args.queries, "candidates": args.candidates, "runs": runs}
    args.out.write_text(json.dumps(res, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
