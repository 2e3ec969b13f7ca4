"""Small-N index builds: the `auto` index type against the IVF-PQ it used to pick, and FAISS's stderr.

For N examples of D numbers per layer (default 512 x 4096, one thread) it builds, from the same
Gaussian rows, the index `auto` picks now (:func:`gradindex.index.factory.default_factory`: Flat
below 50,000 examples) and the one it picked before (``IVF{nlist},PQ{D/2}x4fs`` once
``N·D > 2^24``), each with FAISS's k-means warnings silenced as the library does and without.
It reports train+add seconds and the lines FAISS wrote to stderr (fd 2), and writes JSON.

    python -m benchmarks.index_small                       # 512 x 4096, ~20 s
    python -m benchmarks.index_small --dims 4096,16384     # wider layers take minutes (IVF-PQ)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import faiss
import numpy as np

from gradindex.index.factory import default_factory, default_nlist, make_index  # noqa: E402


def stderr_lines(fn) -> tuple[float, int]:
    """Seconds ``fn()`` takes and the lines written to file descriptor 2 meanwhile."""
    with tempfile.TemporaryFile() as tmp:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(tmp.fileno(), 2)
        try:
            t0 = time.perf_counter()
            fn()
            seconds = time.perf_counter() - t0
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        tmp.seek(0)
        return seconds, tmp.read().count(b"\n")


def build(factory: str, x: np.ndarray, quiet: bool) -> None:
    d = x.shape[1]
    index = make_index(factory, d) if quiet else faiss.index_factory(d, factory, faiss.METRIC_INNER_PRODUCT)
    if not index.is_trained:
        index.train(x)
    index.add(x)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=512)
    ap.add_argument("--dims", default="4096", help="Comma-separated layer dimensions.")
    ap.add_argument("--out", default="benchmarks/results/index_small.json")
    args = ap.parse_args(argv)
    faiss.omp_set_num_threads(1)
    n, rows = args.examples, []
    for d in (int(v) for v in args.dims.split(",")):
        x = np.random.default_rng(0).standard_normal((n, d)).astype(np.float32)
        before = f"IVF{default_nlist(n)},PQ{d // 2}x4fs" if d % 2 == 0 else f"IVF{default_nlist(n)},SQ8"
        for label, factory, quiet in (("auto now", default_factory(n, d), True),
                                      ("auto before, quiet", before, True),
                                      ("auto before, as FAISS prints", before, False)):
            seconds, lines = stderr_lines(lambda f=factory, q=quiet, x=x: build(f, x, q))
            rows.append({"examples": n, "dim": d, "case": label, "factory": factory,
                         "seconds": round(seconds, 3), "stderr_lines": lines})
            print(f"N={n} D={d:>6}  {label:<30} {factory:<22} {seconds:8.2f} s  {lines:>7} stderr lines",
                  flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"threads": 1, "faiss": faiss.__version__, "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
