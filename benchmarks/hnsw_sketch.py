"""HNSW over the sketch tier's codes, as a candidate sublinear first tier (issue 34): a FAISS ``IndexHNSWSQ``
(8-bit) over each example's sketch divided by its row norm (the default ``ekfac-selfnorm`` ranks by direction),
searched for the top ``C`` = 500 at several ``efSearch``; recall of the exhaustive sketch's top 10 (and, at the
truth file's full N, of the exhaustive default's), distance computations and seconds a query, and the build's
seconds, over the first N rows of ``benchmarks/lookup_scale.py``'s real default rows and held-out queries.

    python -m benchmarks.hnsw_sketch --sketch W/idx-300000 --truth W/truth-300000.npz --model W/model --n 20000

One torch and FAISS thread. The build cost is what decides: measured here, 27 ms a row on one shared core at
2,044 numbers a sketch (10^7 rows: ~75 CPU-hours).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
C = 500


def query_sketches(index: Path, truth: np.lib.npyio.NpzFile, model: str) -> np.ndarray:
    """The held-out queries' sketches, as the sketch tier makes them (the default method and damping)."""
    from gradindex.index import query_vectors
    from gradindex.query import QueryEngine
    from gradindex.query.defaults import answer_for

    q = {k[2:]: torch.from_numpy(truth[k]) for k in truth.files if k.startswith("q:")}
    with QueryEngine(index, model, device="cpu") as e:
        layers = list(e.layers)
        ans = answer_for(e.index, None, 1e-3, layers)
        _, u, _ = query_vectors(e.indices.space, e.index.pre, ans.base, 1e-3, q)
        return np.ascontiguousarray(e.indices.tier.sketch.sketch.apply(u, layers), dtype=np.float32)


def recall(truth: np.ndarray, found: np.ndarray) -> float:
    return float(np.mean([len(set(a) & set(b)) / len(a) for a, b in zip(truth, found, strict=True)]))


def main(argv: list[str] | None = None) -> dict:
    import faiss

    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--sketch", type=Path, required=True, help="an index with the sketch tier")
    p.add_argument("--truth", type=Path, required=True, help="lookup_scale's truth-N.npz over that index")
    p.add_argument("--model", required=True)
    p.add_argument("--n", type=int, default=20000, help="the first N rows")
    p.add_argument("--m", type=int, default=32, help="HNSW neighbours a node")
    p.add_argument("--ef-construction", type=int, default=64)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "lookup-hnsw.json")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    faiss.omp_set_num_threads(1)
    folder, z = a.sketch / "faiss", np.load(a.truth)
    codes = np.load(folder / "sketch.codes.npy", mmap_mode="r")
    n = min(a.n, len(codes))
    scales = np.load(folder / "sketch.scales.npy")[:n].astype(np.float32)
    norm = np.sqrt(np.load(folder / "norms.npy")[:n].sum(axis=1, dtype=np.float64))
    factor = (scales / np.where(norm > 0, norm, 1.0)).astype(np.float32)

    def block(s: int, e: int) -> np.ndarray:  # (FAISS's code + 128 layout back to int8, times the factor)
        signed = (np.asarray(codes[s:e]).view(np.uint8) ^ np.uint8(0x80)).view(np.int8)
        return signed.astype(np.float32) * factor[s:e, None]

    yq = query_sketches(a.sketch, z, a.model)
    t0 = time.perf_counter()
    scores = np.zeros((len(yq), n), np.float32)
    for s in range(0, n, 1 << 14):
        scores[:, s:s + (1 << 14)] = yq @ block(s, min(n, s + (1 << 14))).T
    flat = (time.perf_counter() - t0) / len(yq)
    sketch10 = np.argsort(-scores, axis=1)[:, :10]
    exact10 = z["ids"][:, :10] if n == len(codes) else None
    index = faiss.IndexHNSWSQ(codes.shape[1], faiss.ScalarQuantizer.QT_8bit, a.m, faiss.METRIC_INNER_PRODUCT)
    index.hnsw.efConstruction = a.ef_construction
    index.train(block(0, min(n, 20000)))
    t0 = time.perf_counter()
    for s in range(0, n, 1 << 14):
        index.add(block(s, min(n, s + (1 << 14))))
    build = time.perf_counter() - t0
    rows = []
    for ef in (500, 750, 1000, 1500, 2000, 3000):
        index.hnsw.efSearch = ef
        faiss.cvar.hnsw_stats.reset()
        t0 = time.perf_counter()
        _, found = index.search(yq, C)
        row = {"efSearch": ef, "seconds_per_query": round((time.perf_counter() - t0) / len(yq), 4),
               "distances_per_query": int(faiss.cvar.hnsw_stats.ndis / len(yq)),
               "recall_sketch_top10": recall(sketch10, found)}
        row["share_of_rows"] = round(row["distances_per_query"] / n, 4)
        if exact10 is not None:
            row["recall_exact_top10"] = recall(exact10, found)
        rows.append(row)
        print(json.dumps(row), flush=True)
    res = {"n": n, "dims": int(codes.shape[1]), "m": a.m, "ef_construction": a.ef_construction, "candidates": C,
           "queries": len(yq), "build_seconds": round(build, 1), "build_ms_per_row": round(1000 * build / n, 2),
           "flat_float_scan_seconds_per_query": round(flat, 4), "search": rows}
    out = json.loads(a.out.read_text()) if a.out.exists() else {}
    out[str(n)] = res
    a.out.write_text(json.dumps(out, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k != "search"}))
    return res


if __name__ == "__main__":
    main()
