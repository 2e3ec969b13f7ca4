"""The sketch tier's first-stage scan at 10⁴-10⁶ rows: its two kernels (int8, float) against FAISS's kernel.

The first tier scores every example (:class:`gradindex.index.sketch.SketchIndex`): one query's
sketch against ``N`` int8 rows of ``m`` numbers (``m`` = 2,044 at the default 2,048 bytes per
example), then the per-row scales and the top/bottom ``C`` (:func:`gradindex.query.search.top_and_bottom`).
Its time depends on ``N`` and ``m``, not on the values, so random codes time it (recall on real
rows is :mod:`benchmarks.lookup`'s). The index's kernels (``torch._int_mm`` of two int8 query levels;
float32 blocks) and FAISS's ``QT_8bit_direct_signed`` search for all ``N`` run side by side in one process
on the same codes, one query at a time; the scores are checked against each other, and the kernel the
index's timing (``GRADINDEX_SKETCH_KERNEL=auto``) picks on this CPU is recorded.

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

from gradindex.index.sketch import SKETCH_BYTES, Sketch, SketchIndex, scan_kernel
from gradindex.query.search import top_and_bottom

RESULTS = Path(__file__).resolve().parent / "results"


def time_kernel(scores, q: np.ndarray, c: int) -> tuple[dict, np.ndarray]:
    """p50/p95 seconds of the scan plus the top/bottom ``c``, one query at a time; the scores."""
    ts, out = [], []
    for j in range(len(q)):
        t = time.perf_counter()
        s = scores(q[j:j + 1]).astype(np.float64)
        top_and_bottom(s, c, c, margin=0)
        ts.append(time.perf_counter() - t)
        out.append(s[0])
    return {"p50_s": float(np.percentile(ts[1:], 50)), "p95_s": float(np.percentile(ts[1:], 95))}, np.array(out)


def faiss_scores(codes: np.ndarray, scales: np.ndarray):
    """``scores(q)`` by FAISS's direct-signed kernel asked for all ``N`` (the heap is most of its time)."""
    m = codes.shape[1]
    index = faiss.IndexScalarQuantizer(m, faiss.ScalarQuantizer.QT_8bit_direct_signed, faiss.METRIC_INNER_PRODUCT)
    index.train(np.zeros((1, m), np.float32))
    index.add_sa_codes(codes)

    def scores(q: np.ndarray) -> np.ndarray:
        d, i = index.search(q, len(codes))
        out = np.empty_like(d)
        np.put_along_axis(out, i, d, axis=1)
        return out * scales[None, :]
    return scores


def run_n(n: int, m: int, queries: int, c: int) -> dict:
    rng = np.random.default_rng(n)
    codes = rng.integers(0, 256, size=(n, m), dtype=np.uint8)
    scales = rng.lognormal(0, 1, n).astype(np.float32)
    q = rng.standard_normal((queries + 1, m)).astype(np.float32)  # the first is a warm-up
    sk = Sketch(0, {"all": m}, {"all": m})
    ix = SketchIndex(sk, codes, scales)
    row = {"examples": n, "sketch_numbers": m, "auto_kernel": scan_kernel(m)}
    got = {}
    for kernel in ("int8", "float"):
        ix.kernel = kernel
        row[kernel], got[kernel] = time_kernel(ix.scores, q, c)
    row["faiss"], got["faiss"] = time_kernel(faiss_scores(codes, scales), q, c)
    ref = np.abs(got["faiss"]).max()
    row["max_rel_score_diff"] = {k: float(np.abs(got[k] - got["faiss"]).max() / ref) for k in ("int8", "float")}
    row["int8_equals_float"] = bool(np.array_equal(got["int8"], got["float"]))  # (the same integers, bit for bit)
    print(f"N={n:>8}: p50/p95 s int8 {row['int8']['p50_s']:.3f}/{row['int8']['p95_s']:.3f}, float "
          f"{row['float']['p50_s']:.3f}/{row['float']['p95_s']:.3f}, FAISS {row['faiss']['p50_s']:.3f}/"
          f"{row['faiss']['p95_s']:.3f}; auto picks {row['auto_kernel']}; max rel. score diff "
          f"{max(row['max_rel_score_diff'].values()):.1e} (FAISS); int8 == float: {row['int8_equals_float']}",
          flush=True)
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
