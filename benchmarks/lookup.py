"""Lookup on real default rows at growing N: build seconds per stage, bytes, RAM, recall@10, latency.

Workload: a small GPT-2 built from a config (2 blocks, width 32, 4 heads, vocab 1024, 64
positions; its 8 block Conv1D layers hooked: 25,152 numbers per example, unprojected), trained
``--train-steps`` on the standard-library corpus (``fixtures.tiny.stdlib_corpus``). Training
examples: distinct windows of 8-23 words of that corpus's text (start ``i``, length ``8 + i mod 16``),
so every row is a real captured gradient of a distinct text; queries: windows of the held-out last
5% of the words. Every index is built with ``gradindex build``'s defaults (rows transcoded into the
EK-FAC whitened eigenbasis, int4: 12.6 KiB per example).

Per N: seconds of each build stage (capture, fit, transcode, index), bytes on disk (store, index),
and for each index kind (``store``: exhaustive scan of the store's codes; ``sketch``: the two-tier
index; ``SQ4``: FAISS's exhaustive scalar-quantizer copy, the old default, built with the old
settings and with the new block sizes side by side): build seconds, bytes, resident memory of
the loaded index, recall@10 of ``QueryEngine.search`` against the exact default scores
(``score_matrix``, float64 over the whole store), the sketch's first-stage recall (share of the
exact top 10 within its top C, C = 50..500, before any re-rank), and p50/p95 latency of one
query at a time (search: precondition + first tier + exact re-rank; the query's own gradient is
not included). Per-number scan costs go to ``gradindex.index.cost`` (the plan's lookup estimate).

    python -m benchmarks.lookup --examples 10000 100000        # ~25 min on 2 shared cores
    python -m benchmarks.lookup --quick                         # 2,000 examples
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import faiss  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from fixtures.tiny import stdlib_corpus, trained_gpt2_dir  # noqa: E402
from gradindex.capture import ProjectionSpec  # noqa: E402
from gradindex.data import records_from_texts, tokenize_records  # noqa: E402
from gradindex.index import IndexConfig, OpenIndex, build_indices  # noqa: E402
from gradindex.index.tiers import CandidateRequest, lookup_cost  # noqa: E402
from gradindex.model import load_causal_lm  # noqa: E402
from gradindex.precondition import FitConfig, fit_preconditioner  # noqa: E402
from gradindex.precondition.compact import transcode_in_place  # noqa: E402
from gradindex.query import QueryEngine  # noqa: E402
from gradindex.query.scores import score_matrix  # noqa: E402
from gradindex.store.builder import BuildConfig, build_store  # noqa: E402

MAX_LENGTH = 64
CS = (50, 100, 200, 500)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def rss() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def dir_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in Path(p).rglob("*") if f.is_file())


def windows(n: int, n_queries: int) -> tuple[list[str], list[str], list[str]]:
    """(all corpus documents, n training windows, query windows from the held-out tail)."""
    docs = stdlib_corpus()
    words = " ".join(docs).split()
    cut = int(len(words) * 0.95)
    train_words, held = words[:cut], words[cut:]
    out, seen, i = [], set(), 0
    while len(out) < n:
        s, L = i % (len(train_words) - 24), 8 + (i // (len(train_words) - 24) + i) % 16
        t = " ".join(train_words[s:s + L])
        if t not in seen:
            seen.add(t)
            out.append(t)
        i += 1
        if i > 40 * n + 10_000:
            raise ValueError(f"the corpus gives fewer than {n} distinct windows")
    step = max(1, (len(held) - 24) // n_queries)
    queries = [" ".join(held[j:j + 16]) for j in range(0, step * n_queries, step)][:n_queries]
    return docs, out, queries


def model_dir(work: Path, docs: list[str], steps: int) -> Path:
    if not (work / "model" / "config.json").exists():
        log(f"training the model for {steps} steps")
    return trained_gpt2_dir(work / "model", docs, steps, vocab_size=1024, n_embd=32, max_length=MAX_LENGTH)


def build(work: Path, mdir: Path, texts: list[str]) -> tuple[Path, dict]:
    """The default build's stages, one after another, each timed (the pipeline's own order)."""
    out = work / f"idx-{len(texts)}"
    stamp = out / "bench-stages.json"
    if stamp.exists():
        return out, json.loads(stamp.read_text())
    shutil.rmtree(out, ignore_errors=True)
    model, tok = load_causal_lm(mdir, device="cpu")
    data = tokenize_records(records_from_texts(texts), tok, MAX_LENGTH)
    cfg = BuildConfig(projection=ProjectionSpec(), budget="auto", storage="int4", precondition="ekfac",
                      transcode="ekfac", max_length=MAX_LENGTH, batch_size=32)
    stages = {}
    t = time.perf_counter()
    res = build_store(model, tok, data, out, cfg, model_id=str(mdir), progress=False)
    stages["capture"] = time.perf_counter() - t
    t = time.perf_counter()
    fit = FitConfig(method="ekfac", damping=cfg.damping, fisher=cfg.fisher, seed=cfg.fisher_seed)
    fit_preconditioner(out, fit, model, tok, data, progress=False, manifest=res.manifest)
    stages["fit"] = time.perf_counter() - t
    t = time.perf_counter()
    transcode_in_place(out, cfg.damping, cfg.rows.storage, progress=False)
    stages["transcode"] = time.perf_counter() - t
    stamp.write_text(json.dumps(stages))
    return out, stages


def query_rows(d: Path, mdir: Path, queries: list[str]) -> dict[str, np.ndarray]:
    with QueryEngine(d, mdir, device="cpu") as e:
        g, _, _ = e.gradients(e.tokenize(queries))
    return {n: v.numpy() for n, v in g.items()}


def first_stage(engine: QueryEngine, q: dict, truth: np.ndarray) -> dict[str, float]:
    """Share of the exact top 10 within the sketch's top C (before the re-rank), per C."""
    from gradindex.index import query_vectors
    from gradindex.methods import parse_method, row_base
    from gradindex.spec.manifest import row_basis

    method = engine.resolve_method(None)
    base = row_base(parse_method(method)[0], row_basis(engine.manifest), method)  # the operation on the rows
    _, u, _ = query_vectors(engine.indices.space, engine.pre, base, 1e-3,
                            {n: torch.from_numpy(v) for n, v in q.items()})
    out = {}
    for c in CS:
        cands = engine.indices.tier.first_stage(CandidateRequest(list(engine.layers), u, {}, c), c)
        out[str(c)] = float(np.mean([len(set(cands[j].tolist()) & set(truth[j].tolist())) / 10
                                     for j in range(len(truth))]))
    return out


def lookups(engine: QueryEngine, q: dict, truth: np.ndarray, **kw) -> dict:
    """recall@10 and p50/p95 seconds of one query at a time."""
    ts, rec = [], []
    Q = len(truth)
    for j in range(Q):
        one = {n: v[j:j + 1] for n, v in q.items()}
        t = time.perf_counter()
        r = engine.search(one, k=10, texts=False, **kw)[0]
        ts.append(time.perf_counter() - t)
        rec.append(len({h.id for h in r.hits} & set(truth[j].tolist())) / 10)
    return {"recall@10": float(np.mean(rec)), "p50_s": float(np.percentile(ts, 50)),
            "p95_s": float(np.percentile(ts, 95)), "queries": Q}


def kinds(args) -> list[tuple[str, IndexConfig]]:
    out = [("store", IndexConfig(factory="store")), ("sketch", IndexConfig(factory="sketch"))]
    out += [(f"sketch {b} B", IndexConfig(factory="sketch", sketch_bytes=b)) for b in args.sketch_bytes]
    if args.faiss:  # the old default's FAISS copy, with the old block and sample sizes, then the new ones
        out += [("SQ4 (old blocks)", IndexConfig(factory="SQ4", block_bytes=1 << 62, train_size=16384)),
                ("SQ4", IndexConfig(factory="SQ4"))]
    return out


def run_n(args, work: Path, mdir: Path, n: int) -> dict:
    _, texts, queries = windows(n, args.queries)
    log(f"N={n}: building the store")
    d, stages = build(work, mdir, texts)
    q = query_rows(d, mdir, queries)
    with OpenIndex(d) as ix:
        t = time.perf_counter()
        exact = score_matrix(ix, {n_: torch.from_numpy(v) for n_, v in q.items()}, None, 1e-3, ix.layers)  # the default
        t_exact = time.perf_counter() - t
        numbers = sum(ix.store.dims.values())
    truth = np.argsort(-exact, axis=1, kind="stable")[:, :10]
    store_bytes = dir_bytes(d / "store")
    entry = {"examples": n, "numbers_per_example": numbers, "stages_s": stages, "store_bytes": store_bytes,
             "exact_score_matrix_s_per_query": t_exact / len(queries), "kinds": {}}
    for name, cfg in kinds(args):
        shutil.rmtree(d / "faiss", ignore_errors=True)
        t = time.perf_counter()
        res = build_indices(d, cfg, progress=False, force=True)
        secs = time.perf_counter() - t
        ib = dir_bytes(d / "faiss")
        m0 = rss()
        with QueryEngine(d, load_model=False) as e:
            e.indices  # noqa: B018 - load them (their RAM is measured)
            ram = rss() - m0  # noisy (allocator reuse); the loaded index's own bytes follow
            sk = e.indices.sketch
            held = (sk.nbytes() if sk is not None else 0) + e.indices.sq_norms.nbytes
            k = {"index_ram_bytes": int(held),
                 "build_s": secs, "vectors_per_s": n * len(res.meta["layers"]) / secs, "index_bytes": ib,
                 "index_dir_over_rows": (store_bytes + ib) / store_bytes, "ram_bytes": ram,
                 **lookups(e, q, truth)}
            if e.indices.sketch is not None:
                k["first_stage_recall"] = first_stage(e, q, truth)
                k["sketch_numbers"] = e.indices.sketch.sketch.m
                for c in (100, 500):
                    k[f"C={c}"] = lookups(e, q, truth, candidates=c)
        kind = name.split()[0] if name.startswith(("store", "sketch")) else "store"
        k["estimate"] = lookup_cost(n, numbers, "int4", kind, layers=len(res.meta["layers"]),
                                    sketch_bytes=cfg.sketch_bytes).to_dict()
        entry["kinds"][name] = k
        log(f"N={n} {name}: build {secs:.1f} s, {ib / n:.0f} B/example, RAM {held / 2**20:.0f} MiB, "
            f"recall@10 {k['recall@10']:.3f}, p50/p95 {k['p50_s'] * 1e3:.0f}/{k['p95_s'] * 1e3:.0f} ms"
            + (f", first stage {k['first_stage_recall']}" if "first_stage_recall" in k else ""))
    return entry


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--examples", type=int, nargs="+", default=[10_000, 100_000])
    ap.add_argument("--queries", type=int, default=40)
    ap.add_argument("--train-steps", type=int, default=300)
    ap.add_argument("--work", default="/tmp/gradindex-lookup")
    ap.add_argument("--no-faiss", dest="faiss", action="store_false", help="Skip the FAISS SQ4 comparison.")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--sketch-bytes", type=int, nargs="*", default=[4096, 8192],
                    help="Further sketch sizes measured beside the default (bytes per example).")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/lookup.json")
    args = ap.parse_args()
    if args.quick:
        args.examples, args.queries = [2000], 10
    torch.set_num_threads(args.threads)
    faiss.omp_set_num_threads(args.threads)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    docs, _, _ = windows(10, 1)
    mdir = model_dir(work, docs, args.train_steps)
    report = {"machine": {"cpus": os.cpu_count(), "threads": args.threads, "platform": platform.platform(),
                          "load_average_start": os.getloadavg()},
              "workload": __doc__.split("\n\n")[1], "runs": []}
    for n in args.examples:
        report["runs"].append(run_n(args, work, mdir, n))
        report["machine"]["max_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        report["machine"]["load_average_end"] = os.getloadavg()
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
