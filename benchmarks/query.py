"""Lookup at scale: recall@10 of the ANN + exact re-rank pipeline, and latency per query.

Workload: the demo model (GPT-2 from a config, 2 blocks, width 128, vocab 2048, 128 positions,
trained ``--train-steps``, 300 as in the demo, on the standard-library corpus of
``fixtures.tiny.stdlib_corpus``); its 8 block linear layers hooked with a 16x16 projection:
8 layers x 256 numbers per example.

Vectors: the real capture of that model over the corpus (each document, and its first and second
half: about 3,100 rows, the "base"), extended to ``N`` rows with synthetic rows, each a random
Gaussian combination of 3 base rows (weights N(0, 1/3), the same combination in every layer, so
each layer keeps the real decaying spectrum and the layers keep their real cross-correlation).
The store of ``N`` rows is written to disk in the library's HDF5 format (float32), with the base
store's manifest, so the query engine opens it as it opens any index. Token hashes: the base rows
keep their own, each synthetic row gets a distinct one (so ``gradindex dedup`` finds no exact copies
among them).

Queries: held-out corpus documents, their gradients captured by the engine itself. Exact top-10
by ``gradindex.query.scores.score_matrix`` (float64 over the whole store). For each index type and
(candidates, shortlist, nprobe) setting: recall@10, and p50/p95 latency of one query at a time:
``search`` (precondition, per-layer ANN, exact per-layer shortlist and exact re-rank from the
store) and ``e2e`` (tokenize, forward/backward of the query, then the same). Also build time,
index size and resident memory.

    python -m benchmarks.query --examples 100000                     # ~10 min on 2 cores
    python -m benchmarks.query --examples 1000000 --configs auto     # ~8 GB store, ~40 min
    python -m benchmarks.query --quick                               # 100k rows, one config
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import logging
import os
import platform
import shutil
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # a shared CPU: do not spin on idle cores
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import faiss  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from fixtures.tiny import stdlib_corpus, trained_gpt2_dir  # noqa: E402
from gradindex.capture import ProjectionSpec  # noqa: E402
from gradindex.data import records_from_texts, tokenize_records  # noqa: E402
from gradindex.index import IndexConfig, build_indices, default_factory  # noqa: E402
from gradindex.index.factory import default_nlist  # noqa: E402
from gradindex.model import load_causal_lm  # noqa: E402
from gradindex.query import QueryEngine  # noqa: E402
from gradindex.query.scores import score_matrix  # noqa: E402
from gradindex.spec.manifest import read_manifest, write_manifest  # noqa: E402
from gradindex.store import STORE_DIR, ShardWriter, Store, shard_name  # noqa: E402
from gradindex.store.builder import BuildConfig, build_store  # noqa: E402

MAX_LENGTH = 128


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def rss() -> int:
    """Resident memory of this process in bytes."""
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def corpus(n_queries: int) -> tuple[list[str], list[str], list[str]]:
    """(all documents, base texts: documents and their halves, held-out query documents)."""
    docs = stdlib_corpus()
    rng = np.random.default_rng(0)
    q_idx = set(rng.choice(len(docs), n_queries, replace=False).tolist())
    base = []
    for i, d in enumerate(docs):
        if i in q_idx:
            continue
        w = d.split()
        base += [d, " ".join(w[: len(w) // 2]), " ".join(w[len(w) // 2:])]
    return docs, [b for b in base if len(b.split()) >= 3], [docs[i] for i in sorted(q_idx)]


def demo_model(work: Path, docs: list[str], steps: int) -> Path:
    if not (work / "model" / "config.json").exists():
        log(f"training the demo model for {steps} steps")
    return trained_gpt2_dir(work / "model", docs, steps, vocab_size=2048, n_embd=128, max_length=MAX_LENGTH)


def base_store(work: Path, model_dir: Path, texts: list[str]) -> Path:
    out = work / "base"
    if (out / "manifest.json").exists() and read_manifest(out).get("status") == "complete":
        return out
    log(f"capturing {len(texts)} real rows")
    model, tok = load_causal_lm(model_dir, device="cpu")
    data = tokenize_records(records_from_texts(texts), tok, MAX_LENGTH)
    cfg = BuildConfig.raw(projection=ProjectionSpec(k_a=16, k_g=16), max_length=MAX_LENGTH, shard_size=1 << 16)
    build_store(model, tok, data, out, cfg, model_id=str(model_dir), progress=False)
    return out


def synthetic_store(work: Path, base: Path, n: int, shard: int = 1 << 16, block: int = 1 << 14) -> Path:
    """``n`` rows: the base rows, then Gaussian combinations of 3 base rows (module doc)."""
    out = work / f"store-{n}"
    if (out / "manifest.json").exists() and read_manifest(out).get("status") == "complete":
        return out
    shutil.rmtree(out, ignore_errors=True)
    (out / STORE_DIR).mkdir(parents=True)
    with Store(base) as s:
        X = s.read_rows(np.arange(len(s)))  # {layer: [n0, D]}
        layers, n0 = s.layers, len(s)
        base_hash = s.column("token_hash")
    log(f"writing a {n}-row store ({n * sum(x.shape[1] for x in X.values()) * 4 / 2**30:.1f} GiB)")
    rng = np.random.default_rng(1)
    fp = f"synthetic-{n}"
    for k in range(-(-n // shard)):
        first, rows = k * shard, min(shard, n - k * shard)
        dims = {m: x.shape[1] for m, x in X.items()}
        w = ShardWriter(out / STORE_DIR / shard_name(k), first, rows, dims, fp)
        w.open()
        for s in range(first, first + rows, block):
            e = min(s + block, first + rows)
            ids = np.arange(s, e)
            j = rng.integers(0, n0, (e - s, 3))
            c = rng.normal(0.0, 1 / np.sqrt(3), (e - s, 3)).astype(np.float32)
            real = ids < n0
            grads = {}
            th = np.zeros((e - s, 16), np.uint8)  # synthetic rows: distinct hashes (row id), real rows: their own
            th[:, :8] = ids.astype("<u8").view(np.uint8).reshape(-1, 8)
            th[:, 8:] = 0xFF
            th[real] = base_hash[ids[real]]
            for m in layers:
                g = np.einsum("bk,bkd->bd", c, X[m][j])
                g[real] = X[m][ids[real]]
                grads[m] = g
            w.append(ids, grads, loss=np.zeros(e - s, np.float32), num_tokens=np.ones(e - s, np.int32),
                     finite=np.ones(e - s, bool), token_hash=th)
        w.finish()
    m = read_manifest(base)
    m["build"]["data_fingerprint"] = fp
    m["data_id"] = ""
    m["counts"] = {**m["counts"], "examples": n, "truncated": 0}
    write_manifest(out, m)
    return out


def percentiles(ts: list[float]) -> dict[str, float]:
    return {"p50_ms": 1e3 * float(np.percentile(ts, 50)), "p95_ms": 1e3 * float(np.percentile(ts, 95))}


def recall(found: list[int], truth: np.ndarray) -> float:
    return len(set(found) & set(truth.tolist())) / len(truth)


def measure(engine: QueryEngine, q: dict[str, torch.Tensor], truth: np.ndarray, k: int, setting: dict) -> dict:
    """Recall@k and latency of ``search`` (precondition, ANN, exact re-rank), one query at a time."""
    rec, ts = [], []
    for j in range(len(truth)):
        qj = {n: v[j:j + 1] for n, v in q.items()}
        t = time.perf_counter()
        r = engine.search(qj, k=k, method="graddot", texts=False, **setting)[0]
        ts.append(time.perf_counter() - t)
        rec.append(recall([h.id for h in r.hits], truth[j]))
    return {**setting, "recall@10": float(np.mean(rec)), "recall_min": float(np.min(rec)), **percentiles(ts)}


def end_to_end(engine: QueryEngine, texts: list[str], k: int, setting: dict) -> dict:
    """Latency of ``query_batch([text])``: tokenize, forward/backward, then ``search``."""
    engine.query_batch(texts[:1], k=k, method="graddot", texts=False)  # warm up
    ts, parts = [], {}
    for t in texts:
        t0 = time.perf_counter()
        r = engine.query_batch([t], k=k, method="graddot", texts=False, **setting)[0]
        ts.append(time.perf_counter() - t0)
        for key, v in r.seconds.items():
            parts.setdefault(key, []).append(v)
    return {**percentiles(ts), "parts_p50_ms": {key: 1e3 * float(np.median(v)) for key, v in parts.items()}}


def settings(engine: QueryEngine, args) -> list[dict]:
    """(candidates, shortlist, nprobe) grid; nprobe as shares of the lists for IVF indices."""
    li = next(iter(engine.indices.layers.values()))
    if li.exhaustive:
        return [{}]
    try:
        nlist = faiss.extract_index_ivf(li.index).nlist
        probes = sorted({max(1, round(nlist * f)) for f in args.nprobe_share})
    except RuntimeError:
        probes = [None]
    return [{"candidates": c, "shortlist": s, "nprobe": p} for p in probes for c in args.candidates
            for s in args.shortlist if s <= c]


def bends(sweep: list[dict], goals=(0.9, 0.95, 0.99)) -> dict[str, dict | None]:
    """The cheapest setting (by p95) reaching each recall goal."""
    out = {}
    for g in goals:
        ok = [r for r in sweep if r["recall@10"] >= g]
        out[str(g)] = min(ok, key=lambda r: r["p95_ms"]) if ok else None
    return out


def run_scale(args, work: Path, model_dir: Path, base: Path, queries: list[str]) -> list[dict]:
    n = args.examples_now
    store = synthetic_store(work, base, n)
    model, tok = load_causal_lm(model_dir, device="cpu")
    truth_file = work / f"truth-{n}.npz"
    out = []
    for factory in args.configs:
        factory = default_factory(n, 256) if factory == "auto" else factory.replace("{nlist}",
                                                                                     str(default_nlist(n)))
        log(f"N={n}: building {factory} indices")
        t0 = time.perf_counter()
        build_indices(store, IndexConfig(factory=factory), progress=not args.quiet, force=True)
        build_s = time.perf_counter() - t0
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        m0 = rss()
        engine = QueryEngine(store, model=model, tokenizer=tok)
        mem = rss() - m0
        q, _, _ = engine.gradients(engine.tokenize(queries))
        if truth_file.exists():
            truth = np.load(truth_file)["top"]
        else:
            log("exact scores over the whole store (score_matrix)")
            S = score_matrix(store, q, method="graddot", block=8192)
            truth = np.argsort(-S, axis=1)[:, : args.k]
            np.savez(truth_file, top=truth)
        entry = {"examples": n, "factory": factory, "build_seconds": build_s,
                 "index_bytes": engine.indices.nbytes(),
                 "index_bytes_per_example": engine.indices.nbytes() / n,
                 "rss_bytes_per_example": mem / n,
                 "store_bytes_per_example": sum(p.stat().st_size for p in (store / STORE_DIR).glob("*.h5"))
                 / n,
                 "sweep": []}
        grid = settings(engine, args)
        measure(engine, q, truth, args.k, grid[-1])  # warm up: fault the store pages in
        for setting in grid:
            row = measure(engine, q, truth, args.k, setting)
            entry["sweep"].append(row)
            log(f"  {setting}: recall@10 {row['recall@10']:.3f} "
                f"(min {row['recall_min']:.1f}) search p50 {row['p50_ms']:.1f} ms p95 {row['p95_ms']:.1f} ms")
        entry["bends"] = bends(entry["sweep"])
        best = entry["bends"][str(args.target_recall)] if str(args.target_recall) in entry["bends"] else None
        best = best or max(entry["sweep"], key=lambda r: (r["recall@10"], -r["p95_ms"]))
        entry["chosen"] = best
        chosen = {key: best[key] for key in ("candidates", "shortlist", "nprobe") if key in best}
        entry["e2e"] = end_to_end(engine, queries[: args.e2e_queries], args.k, chosen)
        entry["defaults"] = measure(engine, q, truth, args.k, {})  # what a query gets without knobs
        entry["defaults"]["e2e"] = end_to_end(engine, queries[: args.e2e_queries], args.k, {})
        d = entry["defaults"]
        log(f"  engine defaults: recall@10 {d['recall@10']:.3f}, search p50 {d['p50_ms']:.1f} ms "
            f"p95 {d['p95_ms']:.1f} ms, end-to-end p50 {d['e2e']['p50_ms']:.0f} ms p95 {d['e2e']['p95_ms']:.0f} ms")
        log(f"  chosen {chosen}: "
            f"recall@10 {best['recall@10']:.3f}, "
            f"search p95 {best['p95_ms']:.1f} ms, end-to-end p50 {entry['e2e']['p50_ms']:.0f} ms "
            f"p95 {entry['e2e']['p95_ms']:.0f} ms; index {entry['index_bytes'] / 2**20:.0f} MiB "
            f"({entry['index_bytes_per_example']:.0f} B/example), "
            f"RSS {entry['rss_bytes_per_example']:.0f} B/example")
        engine.close()
        del engine
        out.append(entry)
    if not args.keep:
        shutil.rmtree(store)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--examples", type=int, nargs="+", default=[100_000])
    ap.add_argument("--configs", nargs="+",
                    default=["auto", "IVF{nlist},PQ64x4fs", "IVF{nlist},SQ8", "HNSW32"],
                    help="FAISS factory strings ({nlist}: the default's); auto = the library default.")
    ap.add_argument("--candidates", type=int, nargs="+", default=[250, 500, 1000, 2000],
                    help="ANN results per layer.")
    ap.add_argument("--shortlist", type=int, nargs="+", default=[25, 50, 100],
                    help="Kept per layer after exact per-layer scoring.")
    ap.add_argument("--nprobe-share", type=float, nargs="+", default=[1 / 8, 1 / 4],
                    help="Shares of the IVF lists visited per layer.")
    ap.add_argument("--queries", type=int, default=40)
    ap.add_argument("--e2e-queries", type=int, default=20)
    ap.add_argument("-k", "--k", type=int, default=10)
    ap.add_argument("--target-recall", type=float, default=0.95)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--train-steps", type=int, default=300, help="As the demo trains its model.")
    ap.add_argument("--work-dir", default="/tmp/gradindex-bench-query")
    ap.add_argument("--keep", action="store_true", help="Keep the synthetic stores (large) for a re-run.")
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--quick", action="store_true", help="100k rows, the default index, 4 settings.")
    ap.add_argument("--out", default="benchmarks/results/query.json")
    args = ap.parse_args()
    if args.quick:
        args.examples, args.configs, args.candidates, args.shortlist = [100_000], ["auto"], [500, 1000], [50]
        args.queries, args.e2e_queries, args.train_steps = 10, 5, 20
    logging.getLogger("gradindex").setLevel(logging.ERROR)  # long queries are truncated: expected here
    torch.set_num_threads(args.threads)
    faiss.omp_set_num_threads(args.threads)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    docs, base_texts, queries = corpus(args.queries)
    model_dir = demo_model(work, docs, args.train_steps)
    base = base_store(work, model_dir, base_texts)
    report = {"machine": {"cpus": os.cpu_count(), "threads": args.threads, "platform": platform.platform(),
                          "faiss": faiss.__version__, "torch": torch.__version__,
                          "gpus": faiss.get_num_gpus(),
                          "load_avg_start": os.getloadavg()},
              "workload": {"model": "GPT-2 2x128, vocab 2048 (demo)", "layers": 8, "dim_per_layer": 256,
                           "base_rows": len(base_texts), "queries": len(queries), "k": args.k,
                           "vectors": "real capture + Gaussian combinations of 3 real rows (module doc)"},
              "results": []}
    for n in args.examples:
        args.examples_now = n
        report["results"] += run_scale(args, work, model_dir, base, queries)
    report["machine"]["load_avg_end"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
