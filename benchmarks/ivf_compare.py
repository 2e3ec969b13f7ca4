"""The ``ivf-sketch`` tier against the exhaustive ``sketch`` tier, side by side in one process: recall@10 of the
exhaustive default, search p50/p95 one query at a time and the share of lists and rows scanned, at the build's
``nprobe`` and at others (the previous calibration's among them), over ``benchmarks/lookup_scale.py``'s real
default rows and held-out queries (its ``truth-N.npz``: the exhaustive default's top 100 and the query rows).

    python -m benchmarks.ivf_compare --sketch W/idx-N --ivf W2/idx-N --truth W/truth-N.npz --model W/model \\
        --rounds 3 --out benchmarks/results/lookup-ivf.json

Each round runs every lookup in turn (the sketch tier, then the IVF tier at each ``nprobe``); the figures are the
median over the rounds of each round's p50 and p95. ``--old`` adds the ``nprobe`` the calibration before issue
34's fix chose over the same lists (64 sample rows, each one's raw sketch top 10, target 0.97), recomputed here.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
ROOT = Path(__file__).resolve().parents[1]


def old_nprobe(e) -> int:
    """The previous calibration's ``nprobe`` over ``e``'s lists: the fewest holding 0.97 of each probe row's raw
    sketch top 10 (itself excluded)."""
    from gradindex.index.tiers import ivf_sketch as ivf

    meta, folder = e.indices.meta, e.index.dir / "faiss"
    codes = ivf._Codes(folder, meta)
    nlist = meta["ivf"]["nlist"]
    lists = np.load(folder / meta["ivf"]["lists"])
    means = np.load(folder / meta["ivf"]["centroids"])
    old = ivf.TRUTH_K, ivf.PROBE_QUERIES
    ivf.TRUTH_K, ivf.PROBE_QUERIES = 10, 64
    try:
        probe, _ = ivf._samples(codes.n, nlist, 0, 0, codes.m)
        yq = codes.read(probe)
        top = ivf._Top(len(probe))
        for s in range(0, codes.n, 1 << 15):
            e_ = min(codes.n, s + (1 << 15))
            sc = yq @ codes.block(s, e_).T
            mine = (probe >= s) & (probe < e_)
            sc[np.flatnonzero(mine), probe[mine] - s] = -np.inf
            top.add(sc, s)
        return ivf.choose_nprobe(yq @ means.T, lists, top.ids(), 0.97)[0]
    finally:
        ivf.TRUTH_K, ivf.PROBE_QUERIES = old


def scanned(e, q: dict, nprobe: int, c: int) -> tuple[float, float]:
    """Mean share of the lists and of the rows the queries' ``nprobe`` (widened to ``c`` rows) scan."""
    from gradindex.index import query_vectors
    from gradindex.query.defaults import answer_for

    layers = list(e.layers)
    ans = answer_for(e.index, None, 1e-3, layers)
    rows_q = {k: torch.from_numpy(v) for k, v in q.items()}
    _, u, _ = query_vectors(e.indices.space, e.index.pre, ans.base, 1e-3, rows_q)
    sk = e.indices.tier.sketch
    rows = [len(sk.probe(y, nprobe, c)) for y in sk.sketch.apply(u, layers)]
    sizes = np.diff(sk.offsets)
    lists = []
    for y in sk.sketch.apply(u, layers):
        rank = np.argsort(-(sk.centroids @ y), kind="stable")
        held = np.cumsum(sizes[rank])
        lists.append(max(min(nprobe, len(rank)), min(len(rank), int(np.searchsorted(held, c)) + 1)))
    return float(np.mean(lists) / len(sizes)), float(np.mean(rows) / sk.n)


def compare(a) -> dict:
    from benchmarks.lookup import lookups
    from gradindex.index.cost import sketch_candidates
    from gradindex.query import QueryEngine

    torch.set_num_threads(a.threads)
    z = np.load(a.truth)
    ids = z["ids"][:, :10]
    q = {k[2:]: z[k] for k in z.files if k.startswith("q:")}
    with QueryEngine(a.sketch, a.model, device="cpu") as es, QueryEngine(a.ivf, a.model, device="cpu") as ei:
        es.indices, ei.indices  # noqa: B018 - load them
        n, meta = ei.indices.n, ei.indices.meta["ivf"]
        c = sketch_candidates(n)
        probes = {"build": int(meta["nprobe"])}
        if a.old:
            probes["old calibration"] = int(old_nprobe(ei))
        for p in a.nprobe:
            probes[f"--nprobe {p}"] = p
        runs: dict[str, list] = {"sketch": [], **{k: [] for k in probes}}
        lookups(es, q, ids), lookups(ei, q, ids)  # warm up (row hashes, page cache)
        for r in range(a.rounds):
            runs["sketch"].append(lookups(es, q, ids))
            for k, p in probes.items():
                runs[k].append(lookups(ei, q, ids, nprobe=p))
            print(f"round {r}: " + ", ".join(f"{k} {v[-1]['recall@10']:.3f} {v[-1]['p50_s'] * 1e3:.0f}/"
                                            f"{v[-1]['p95_s'] * 1e3:.0f} ms" for k, v in runs.items()), flush=True)
        out = {"examples": n, "queries": len(ids), "threads": a.threads, "rounds": a.rounds, "candidates": c,
               "nlist": meta["nlist"], "build": {k: v for k, v in meta.items() if k not in ("centroids", "lists")},
               "load_average_start": a.load, "load_average_end": os.getloadavg(), "label": a.label, "lookups": {}}
        for k, v in runs.items():
            row = {"recall@10": v[0]["recall@10"], "p50_s": float(np.median([x["p50_s"] for x in v])),
                   "p95_s": float(np.median([x["p95_s"] for x in v])),
                   "p50_range_s": [min(x["p50_s"] for x in v), max(x["p50_s"] for x in v)]}
            if k != "sketch":
                row["nprobe"] = probes[k]
                row["lists_scanned"], row["rows_scanned"] = scanned(ei, q, probes[k], c)
            out["lookups"][k] = row
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sketch", type=Path, required=True, help="the index with the exhaustive sketch tier")
    ap.add_argument("--ivf", type=Path, required=True, help="the same rows with the ivf-sketch tier")
    ap.add_argument("--truth", type=Path, required=True, help="lookup_scale's truth-N.npz")
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--nprobe", type=int, nargs="*", default=[])
    ap.add_argument("--old", action="store_true", help="add the previous calibration's nprobe")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--label", default="")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/lookup-ivf.json")
    a = ap.parse_args(argv)
    a.load = os.getloadavg()
    t = time.perf_counter()
    entry = compare(a)
    entry["seconds"] = round(time.perf_counter() - t, 1)
    report = json.loads(a.out.read_text()) if a.out.exists() else {"runs": []}
    report.setdefault("comparisons", []).append(entry)
    a.out.write_text(json.dumps(report, indent=1))
    for k, v in entry["lookups"].items():
        print(f"{k}: recall@10 {v['recall@10']:.3f}, p50/p95 {v['p50_s'] * 1e3:.0f}/{v['p95_s'] * 1e3:.0f} ms"
              + (f", nprobe {v['nprobe']}, lists {v['lists_scanned']:.2f}, rows {v['rows_scanned']:.2f}"
                 if "nprobe" in v else ""))


if __name__ == "__main__":
    main()
