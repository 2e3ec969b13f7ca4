"""The default lookup at growing N on real captured default rows: build seconds per stage, bytes, RAM,
recall@10 against the exhaustive default, first-stage recall, p50/p95 latency (issue 17, item 5).

Workload: ``benchmarks/lookup.py``'s (a trained GPT-2 2x32, vocab 1024, its 8 block layers hooked:
25,152 numbers per example; int4 rows in the EK-FAC whitened eigenbasis, 12.6 KiB per example), but
the model is trained on, and the training texts are, :func:`windows` of the standard-library
corpus and the GNU info manuals (distinct windows of 8-27 words, up to ~2.8x10^6 of them:
``lookup.windows`` gives at most ~1.2x10^5). Each N is built by
``build_index`` as ``gradindex build`` builds it (the fused fit + transcode, the default ``auto``
index), in its own process (``--build N``), timed per stage with ``benchmarks.buildcost``'s clock.

    python -m benchmarks.lookup_scale --build 200000 --work /work/tmp/lookup   # one build, resumable

    python -m benchmarks.lookup_scale --measure 200000 --work /work/tmp/lookup  # exact top 100, then lookups

``--measure N`` computes the exhaustive default's scores once (``--truth``, in its own process, kept in
``truth-N.npz``), then, in a fresh process, opens the index as the build left it with its model and
times 40 queries one at a time (search alone, and end to end with the query's gradient), their
recall@10 against the exhaustive scores, the sketch's first-stage recall, and the process's memory
(``benchmarks/results/lookup-scale.json``).

``--measure N --tier T`` first rebuilds the index stage alone as tier ``T`` (``sketch``, ``ivf-sketch``...; the
store is kept; seconds recorded), then measures it as above; a run is kept per (N, page cache, threads, tier).
An IVF tier's run adds its lists, the ``nprobe`` and recall its build chose, lookups at other ``nprobe``, and
the share of the exhaustive sketch tier's top 10 (its run over the same N, in the same file) it returns:

    python -m benchmarks.lookup_scale --measure 100000 --tier sketch --out benchmarks/results/lookup-ivf.json
    python -m benchmarks.lookup_scale --measure 100000 --tier ivf-sketch --out benchmarks/results/lookup-ivf.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
LENGTHS = 20  # window lengths 8 .. 8 + LENGTHS - 1 words
SPARE = 12 << 30  # disk left to others while the fused transcode keeps its rotated copy


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def windows(n: int, n_queries: int) -> tuple[list[str], list[str], list[str]]:
    """(corpus documents, ``n`` distinct training windows, query windows from the held-out tails).
    The corpus is the standard-library paragraphs and the GNU info manuals (``fixtures.corpus``), each
    with its last 5% of words held out; the training words are both heads, one after the other.
    Window ``i``: start ``s = i mod M``, length ``8 + (i // M + 7 s) mod 20`` words (every start takes
    all 20 lengths over the first 20 M windows); queries: 16-word windows spread over both tails."""
    from fixtures.corpus import gnu_info_paragraphs
    from fixtures.tiny import stdlib_corpus

    docs = stdlib_corpus() + gnu_info_paragraphs(max_chars=600)
    train, held = [], []
    for part in (stdlib_corpus(), gnu_info_paragraphs(max_chars=600)):
        words = " ".join(part).split()
        cut = int(len(words) * 0.95)
        train += words[:cut]
        held.append(words[cut:])
    m = len(train) - 8 - LENGTHS
    if n > m * LENGTHS:
        raise ValueError(f"the corpus gives at most {m * LENGTHS} windows, asked for {n}")
    out, seen, i = [], set(), 0
    while len(out) < n and i < m * LENGTHS:
        s = i % m
        t = " ".join(train[s:s + 8 + (i // m + 7 * s) % LENGTHS])
        if t not in seen:
            seen.add(t)
            out.append(t)
        i += 1
    if len(out) < n:
        raise ValueError(f"the corpus gives {len(out)} distinct windows, asked for {n}")
    queries = []
    for j in range(n_queries):
        tail = held[j % 2]
        step = max(1, (len(tail) - 16) // ((n_queries + 1) // 2))
        queries.append(" ".join(tail[(j // 2) * step:(j // 2) * step + 16]))
    return docs, out, queries


def _spare_copy():
    """The fused transcode keeps its rotated copy only where that leaves SPARE bytes to others; returns the undo
    (the patch is process-wide: a caller in a test suite must restore it)."""
    from gradindex.precondition import fused

    keeps = fused.keeps_copy

    def keeps_with_spare(d, manifest, storage):
        dims = [int(v["rows"]) * int(v["cols"]) for v in manifest["build"]["layers"].values()]
        need = 2 * int(manifest["counts"]["examples"]) * sum(dims)
        ok = keeps(d, manifest, storage) and fused.free_bytes(d) - 1.1 * need > SPARE
        log(f"rotated copy kept: {ok}")
        return ok

    fused.keeps_copy = keeps_with_spare
    return lambda: setattr(fused, "keeps_copy", keeps)


def build(n: int, work: Path, steps: int, index_type: str = "auto") -> dict:
    """Build (or resume) ``work/idx-N``; its stage seconds, bytes and peak disk go to its ``bench-build.json``
    (a resumed build adds one entry per attempt)."""
    import resource

    import torch

    from benchmarks import lookup
    from benchmarks.buildcost import DiskPeak, Stages, _bytes
    from gradindex.capture import ProjectionSpec
    from gradindex.data import records_from_texts, tokenize_records
    from gradindex.index import IndexConfig
    from gradindex.model import load_causal_lm
    from gradindex.pipeline import BuildConfig

    torch.set_num_threads(1)
    out = work / f"idx-{n}"
    stamp = out.parent / f"idx-{n}.build.json"
    done = json.loads(stamp.read_text()) if stamp.exists() else {"attempts": []}
    if done.get("complete"):
        return done
    docs, texts, _ = windows(n, 1)
    mdir = lookup.model_dir(work, docs, steps)
    model, tok = load_causal_lm(mdir, device="cpu")
    data = tokenize_records(records_from_texts(texts), tok, lookup.MAX_LENGTH)
    cfg = BuildConfig(projection=ProjectionSpec(), budget="auto", storage="int4", precondition="ekfac",
                      transcode="ekfac", max_length=lookup.MAX_LENGTH, batch_size=32)
    undo = _spare_copy()
    stages = Stages()
    stages.wrap()
    import gradindex.pipeline as pipeline

    log(f"N={n}: building {out}")
    rss_before = _vm("VmRSS")  # (the model, the windows and their token ids: the harness's own)
    t = time.perf_counter()
    try:
        with DiskPeak(out, stages) as disk:
            pipeline.build_index(model, tok, data, out, cfg, index=IndexConfig(factory=index_type),
                                 model_id=str(mdir), progress=True)
    finally:
        undo()
        stages.unwrap()
    done["attempts"].append({"seconds": round(time.perf_counter() - t, 2),
                             "stages": {k: round(v, 2) for k, v in stages.seconds.items()},
                             "stages_cpu": {k: round(v, 2) for k, v in stages.cpu.items()},
                             "peak_disk_bytes": disk.peak, "peak_disk_stage": disk.peak_stage,
                             "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                             "rss_before_build_mb": round(rss_before / 2 ** 20, 1),
                             "peak_rss_mb_by_stage": {k: round(v / 2 ** 20, 1) for k, v in disk.rss_by_stage.items()},
                             "load_end": round(os.getloadavg()[0], 2)})
    done.update(complete=True, examples=n, store_bytes=_bytes(out / "store"), index_dir_bytes=_bytes(out))
    stamp.write_text(json.dumps(done, indent=1))
    log(f"N={n}: built, {json.dumps(done['attempts'][-1])}")
    return done


def _vm(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def truth(n: int, work: Path, n_queries: int) -> Path:
    """The exhaustive default's top 100 per query (``score_matrix``: float64 over every stored row),
    with the query rows, in ``work/truth-N.npz`` (its own process: its memory is not the lookup's)."""
    import numpy as np
    import torch

    from benchmarks.lookup import query_rows
    from gradindex.index import OpenIndex
    from gradindex.query.scores import score_matrix

    torch.set_num_threads(1)
    f = work / f"truth-{n}.npz"
    if f.exists():
        return f
    d, mdir = work / f"idx-{n}", work / "model"
    _, _, queries = windows(1, n_queries)
    q = query_rows(d, mdir, queries)
    log(f"N={n}: exact scores of {len(queries)} queries over every row")
    with OpenIndex(d) as ix:
        t = time.perf_counter()
        exact = score_matrix(ix, {k: torch.from_numpy(v) for k, v in q.items()}, None, 1e-3, ix.layers)
        secs = time.perf_counter() - t
    top = np.argsort(-exact, axis=1, kind="stable")[:, :100]
    np.savez(f, ids=top, scores=np.take_along_axis(exact, top, 1), seconds=secs,
             **{f"q:{k}": v for k, v in q.items()})
    log(f"N={n}: exact scores took {secs:.0f} s ({secs / len(queries):.1f} s a query, batched)")
    return f


def page_cache(d: Path, state: str) -> None:
    """``warm``: read every store file once (as the build or a long-running server leaves them); ``cold``: drop the
    page cache (root only); ``as-is``: nothing."""
    if state == "warm":
        for f in sorted((d / "store").glob("*.h5")):
            with open(f, "rb") as fh:
                while fh.read(64 << 20):
                    pass
    elif state == "cold":
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("1\n")


def rebuild_tier(d: Path, tier: str) -> dict:
    """Rebuild ``d``'s index stage as ``tier`` (nothing when it is that already); its seconds."""
    from gradindex.index import IndexConfig, build_indices

    t = time.perf_counter()
    res = build_indices(d, IndexConfig(factory=tier), progress=False)
    log(f"{d.name}: index stage {tier}: {time.perf_counter() - t:.0f} s (up to date: {res.up_to_date})")
    return {"seconds": round(time.perf_counter() - t, 2), "up_to_date": res.up_to_date}


def ivf_entry(e, q: dict, ids, report: dict, n: int, top10: list) -> dict:
    """An IVF tier's lists and build-time choice, lookups at other nprobe, and the share of the sketch tier's top
    10 (its run in ``report``) that it returns."""
    from benchmarks.lookup import lookups

    ivf = {k: v for k, v in e.indices.meta["ivf"].items() if k not in ("centroids", "lists")}
    ivf["search_by_nprobe"] = {str(p): lookups(e, q, ids, nprobe=p) for p in
                               sorted({max(1, ivf["nprobe"] // 4), max(1, ivf["nprobe"] // 2), 2 * ivf["nprobe"]})}
    sk = [r for r in report.get("runs", []) if r["examples"] == n and r.get("index_kind") == "sketch"]
    if sk and sk[0].get("top10"):
        ivf["recall@10_of_the_sketch_tier"] = float(sum(len(set(a) & set(b)) for a, b in zip(
            top10, sk[0]["top10"], strict=True)) / (10 * len(top10)))
    return ivf


def measure(n: int, work: Path, n_queries: int, out: Path, cache: str = "warm", threads: int = 1,
            tier: str | None = None) -> dict:
    """Recall@10 against :func:`truth`, latency one query at a time and this process's memory, on the
    index as the build left it (``auto``: the sketch tier at 10^6) or rebuilt as ``tier``, the store's page cache in
    state ``cache``."""
    import subprocess
    import sys

    import numpy as np
    import torch

    from benchmarks.lookup import first_stage, lookups
    from gradindex.index.tiers import lookup_cost
    from gradindex.query import QueryEngine

    f = work / f"truth-{n}.npz"
    if not f.exists():
        subprocess.run([sys.executable, "-m", "benchmarks.lookup_scale", "--truth", str(n), "--work", str(work),
                        "--queries", str(n_queries)], check=True)
    torch.set_num_threads(threads)
    z = np.load(f)
    ids = z["ids"][:, :10]
    q = {k[2:]: z[k] for k in z.files if k.startswith("q:")}
    _, _, queries = windows(1, n_queries)
    d = work / f"idx-{n}"
    rebuilt = rebuild_tier(d, tier) if tier else None
    report = json.loads(out.read_text()) if out.exists() else {
        "workload": __doc__.split("\n\n")[1], "machine": {"cpus": os.cpu_count()}, "runs": []}
    rss0 = _vm("VmRSS")
    entry: dict = {"examples": n, "queries": len(queries), "exact_seconds_batched": float(z["seconds"]),
                   "page_cache": cache, "threads": threads}
    if rebuilt:
        entry["index_stage"] = rebuilt
    with QueryEngine(d, work / "model", device="cpu") as e:
        e.indices  # noqa: B018 - load them
        page_cache(d, cache)
        sk = e.indices.sketch
        entry["first_pass"] = lookups(e, q, ids)  # (each shard's row hashes loaded once; then the steady state)
        entry["index_kind"] = e.indices.kind
        entry["rss_after_open_bytes"] = _vm("VmRSS")
        entry["rss_open_index_bytes"] = _vm("VmRSS") - rss0
        entry["index_ram_bytes"] = int((sk.nbytes() if sk is not None else 0) + e.indices.sq_norms.nbytes)
        numbers = sum(e.index.store.dims.values())
        entry["search"] = lookups(e, q, ids)
        if sk is not None:
            entry["search_by_C"] = {str(c): lookups(e, q, ids, candidates=c) for c in (100, 500, 1000)}
        entry["top10"] = [[h.id for h in r.hits] for r in e.search(q, k=10, texts=False)]
        if "ivf" in e.indices.meta:
            entry["ivf"] = ivf_entry(e, q, ids, report, n, entry["top10"])
        ts = []
        for text in queries:  # end to end: tokenize, forward/backward, search, texts
            t = time.perf_counter()
            e.query(text, k=10)
            ts.append(time.perf_counter() - t)
        entry["end_to_end"] = {"p50_s": float(np.percentile(ts, 50)), "p95_s": float(np.percentile(ts, 95))}
        entry["peak_rss_lookups_bytes"] = _vm("VmHWM")  # (before the batched first-stage analysis below)
        if sk is not None:
            entry["first_stage_recall"] = first_stage(e, q, ids)
    entry["peak_rss_bytes"] = _vm("VmHWM")
    if entry["index_kind"] in ("store", "sketch", "ivf-sketch"):
        entry["estimate"] = lookup_cost(n, numbers, "int4", entry["index_kind"], layers=len(q)).to_dict()
    stamp = work / f"idx-{n}.build.json"
    if stamp.exists():
        b = json.loads(stamp.read_text())
        entry["build"] = {k: b.get(k) for k in ("store_bytes", "index_dir_bytes")}
        entry["build"]["attempts"] = b["attempts"]
        entry["index_dir_over_rows"] = b["index_dir_bytes"] / b["store_bytes"]
    entry["load_average"] = os.getloadavg()
    report = json.loads(out.read_text()) if out.exists() else report  # (as it is now)
    key = (n, cache, threads, entry["index_kind"])
    def key_of(r):
        return r["examples"], r.get("page_cache", ""), r.get("threads", 1), r.get("index_kind", "")

    report["runs"] = sorted([r for r in report["runs"] if key_of(r) != key] + [entry], key=key_of)
    out.write_text(json.dumps(report, indent=1))
    log(f"N={n}: {entry['index_kind']}, recall@10 {entry['search']['recall@10']:.3f}, search p50/p95 "
        f"{entry['search']['p50_s'] * 1e3:.0f}/{entry['search']['p95_s'] * 1e3:.0f} ms, end to end p95 "
        f"{entry['end_to_end']['p95_s'] * 1e3:.0f} ms, peak RSS {entry['peak_rss_lookups_bytes'] / 2**30:.2f} GiB")
    return entry


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", type=int, nargs="*", default=[])
    ap.add_argument("--truth", type=int, nargs="*", default=[])
    ap.add_argument("--measure", type=int, nargs="*", default=[])
    ap.add_argument("--queries", type=int, default=40)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the lookups (the int8 scan)")
    ap.add_argument("--page-cache", choices=("warm", "cold", "as-is"), default="warm",
                    help="the store's page cache before the lookups (cold: root only)")
    ap.add_argument("--work", type=Path, default=Path("/work/tmp/lookup"))
    ap.add_argument("--train-steps", type=int, default=300)
    ap.add_argument("--index-type", default="auto", help="the build's --index-type (auto: store or sketch by N)")
    ap.add_argument("--tier", default=None, help="--measure: rebuild the index stage as this tier first")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/lookup-scale.json")
    a = ap.parse_args(argv)
    a.work.mkdir(parents=True, exist_ok=True)
    for n in a.build:
        build(n, a.work, a.train_steps, a.index_type)
    for n in a.truth:
        truth(n, a.work, a.queries)
    if len(a.measure) > 1:  # each N in its own process: its peak RSS is its own
        import subprocess
        import sys

        rest = ["--work", str(a.work), "--queries", str(a.queries), "--out", str(a.out), "--page-cache", a.page_cache,
                "--threads", str(a.threads)] + (["--tier", a.tier] if a.tier else [])
        for n in a.measure:
            subprocess.run([sys.executable, "-m", "benchmarks.lookup_scale", "--measure", str(n), *rest], check=True)
        return
    for n in a.measure:
        measure(n, a.work, a.queries, a.out, a.page_cache, a.threads, a.tier)


if __name__ == "__main__":
    main()
