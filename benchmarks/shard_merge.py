"""Simulated ranks building one layer's FAISS index in parts, merged two ways (docs/scaling.md).

One layer of ``N`` vectors (``D`` numbers, Gaussian) is split over ``R`` simulated ranks. The
coarse quantizer and codes are trained once on a sample (rank 0), every rank adds its own rows
(with their global ids) to a copy of the trained, empty index, and the parts are then

* merged into one index with FAISS's ``merge_from`` (what a build does before serving), and
* searched as ``IndexShards`` (what a server does with parts on several machines or GPUs).

Both must answer exactly as one index that added every row itself. Prints the timings and writes
``benchmarks/results/shard_merge.json``.

    python -m benchmarks.shard_merge [--n 200000] [--dim 256] [--ranks 4]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import faiss
import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200_000)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--queries", type=int, default=64)
    ap.add_argument("--factory", default="IVF512,PQ128x4fs")
    ap.add_argument("--out", default=str(RESULTS / "shard_merge.json"))
    args = ap.parse_args(argv)
    faiss.omp_set_num_threads(1)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.n, args.dim), dtype=np.float32)
    q = rng.standard_normal((args.queries, args.dim), dtype=np.float32)
    ids = np.arange(args.n, dtype=np.int64)

    t0 = time.perf_counter()
    trained = faiss.index_factory(args.dim, args.factory, faiss.METRIC_INNER_PRODUCT)
    trained.train(x[rng.choice(args.n, min(args.n, 64 * 512), replace=False)])
    t_train = time.perf_counter() - t0
    blob = faiss.serialize_index(trained)  # what rank 0 sends to the others

    t0 = time.perf_counter()
    whole = faiss.deserialize_index(blob)
    whole.add_with_ids(x, ids)
    t_one = time.perf_counter() - t0

    parts, t_parts = [], []
    for part in np.array_split(ids, args.ranks):
        t0 = time.perf_counter()
        p = faiss.deserialize_index(blob)
        p.add_with_ids(x[part], part)
        parts.append(p)
        t_parts.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    merged = faiss.deserialize_index(blob)
    for p in parts:
        merged.merge_from(faiss.clone_index(p), 0)  # ids kept: each part added its global ids
    t_merge = time.perf_counter() - t0
    shards = faiss.IndexShards(args.dim, False, False)  # successive_ids off: each part keeps its global ids
    for p in parts:
        shards.add_shard(p)

    k = 10
    for ix in (whole, merged):
        faiss.extract_index_ivf(ix).nprobe = 128
    for p in parts:
        faiss.extract_index_ivf(p).nprobe = 128
    d1, i1 = whole.search(q, k)
    d2, i2 = merged.search(q, k)
    d3, i3 = shards.search(q, k)
    same_merged = bool((i1 == i2).all() and np.allclose(d1, d2))
    same_shards = bool((i1 == i3).all() and np.allclose(d1, d3))
    res = {"n": args.n, "dim": args.dim, "ranks": args.ranks, "factory": args.factory,
           "seconds": {"train": round(t_train, 3), "one_index_add": round(t_one, 3),
                       "per_rank_add": [round(t, 3) for t in t_parts], "merge": round(t_merge, 3)},
           "merged_equals_one_index": same_merged, "shards_equal_one_index": same_shards,
           "bytes_per_vector": round(faiss.serialize_index(merged).size / args.n, 2)}
    print(json.dumps(res, indent=2))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    return 0 if same_merged and same_shards else 1


if __name__ == "__main__":
    raise SystemExit(main())
