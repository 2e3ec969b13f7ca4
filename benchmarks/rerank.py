"""Full-space re-rank: top-10 agreement with exhaustive full-space EK-FAC, and lookup latency.

On the fidelity benchmark's setup (``benchmarks/fidelity.py``: the model trained on standard-library
docstring paragraphs, its training set and held-out queries; ``--quick``: its smoke configuration):

* the index: 16x16 factored projection, EK-FAC in the projected space, FAISS default factory, plus
  the full-space EK-FAC fit (``FitConfig(space="full")``);
* the truth: an unprojected index of the same data with its own (stored-space) EK-FAC fit, every
  training example scored by ``score_matrix`` (store pass, float64): exhaustive full-space EK-FAC;
* for each number of re-ranked candidates C (0 = the compressed index alone): each query through
  ``QueryEngine.query(..., method="ekfac", k=10, rerank_full=C)``, one at a time, timed end to end.

Reports top-10 overlap (|lookup ∩ truth| / 10) and rank-by-rank agreement (share of positions
1..10 holding the same example), their means over queries, and p50/p95 latency (wall, and process
CPU time, which other jobs on a shared machine disturb less), with ``--threads`` (default 2) torch
and FAISS threads. Writes ``benchmarks/results/rerank.json``.

    python -m benchmarks.rerank            # fidelity's default setup (256 training, 96 queries)
    python -m benchmarks.rerank --quick    # its smoke setup, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import query_gradients, train_model  # noqa: E402
from benchmarks.fidelity import QUICK, FidelityConfig, make_setup, new_model  # noqa: E402
from gradindex.capture import ProjectionSpec  # noqa: E402
from gradindex.data import load_records, tokenize_records  # noqa: E402
from gradindex.index import IndexConfig, build_indices  # noqa: E402
from gradindex.pipeline import BuildConfig, build_index  # noqa: E402
from gradindex.precondition import FitConfig, fit_preconditioner  # noqa: E402
from gradindex.query import QueryEngine  # noqa: E402
from gradindex.query.scores import score_matrix  # noqa: E402

HERE = Path(__file__).resolve().parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--candidates", default="0,10,20,30,50,100")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--damping", type=float, default=0.1)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    import faiss

    cfg = QUICK if args.quick else FidelityConfig()
    torch.set_num_threads(1)
    setup = make_setup(cfg)
    model = new_model(cfg, len(setup.tokenizer))
    t0 = time.perf_counter()
    train_model(model, setup.train.input_ids, cfg, seed=1000)
    print(f"trained in {time.perf_counter() - t0:.0f} s", flush=True)
    model.eval()
    tok = setup.tokenizer
    work = Path(tempfile.mkdtemp())
    try:
        from fixtures.tiny import save_model_dir

        save_model_dir(model, tok, work / "model")
        texts = [tok.decode(x) for x in setup.train.input_ids]
        path = work / "train.jsonl"
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        data = tokenize_records(load_records(path), tok, cfg.max_tokens)
        res: dict = {"loadavg_before": os.getloadavg(), "setup": "quick" if args.quick else "fidelity default",
                     "examples": len(data), "queries": len(setup.query), "threads": args.threads,
                     "damping": args.damping}
        dirs = {}
        t0 = time.perf_counter()
        for name, proj in (("16x16", "16"), ("none", "none")):
            d = work / name
            bc = BuildConfig.raw(projection=ProjectionSpec.parse(proj), max_length=cfg.max_tokens, batch_size=16,
                             precondition="ekfac")
            build_index(model, tok, data, d, bc, model_id=str(work / "model"), data_id=str(path), progress=False)
            dirs[name] = d
        build_indices(dirs["16x16"], IndexConfig(), progress=False)
        t1 = time.perf_counter()
        fit_preconditioner(dirs["16x16"], FitConfig(method="ekfac", space="full"), model, tok, data)
        res["full_space_fit_seconds"] = time.perf_counter() - t1
        print(f"built in {t1 - t0:.0f} s, full-space fit {res['full_space_fit_seconds']:.1f} s", flush=True)
        queries = [{"input_ids": x} for x in setup.query.input_ids]
        grads = query_gradients(model, tok, setup.query, BuildConfig.raw(projection=ProjectionSpec.parse("none"),
                                                                      batch_size=16))
        truth = score_matrix(dirs["none"], grads, "ekfac", damping=args.damping, device="cpu")  # [Q, N]
        res["full_space_numbers_per_example"] = int(sum(v.shape[1] for v in grads.values()))
        top_true = np.argsort(-truth, axis=1, kind="stable")[:, :10]
        torch.set_num_threads(args.threads)
        faiss.omp_set_num_threads(args.threads)
        rows = []
        with QueryEngine(dirs["16x16"], model=model, tokenizer=tok) as e:
            e.query(queries[0], k=10, method="ekfac", rerank_full=10)  # warm-up
            for C in [int(c) for c in args.candidates.split(",")]:
                overlap, same, lat, cpu = [], [], [], []
                for j, q in enumerate(queries):
                    t, c = time.perf_counter(), time.process_time()
                    r = e.query(q, k=10, method="ekfac", damping=args.damping, rerank_full=C, texts=False)
                    lat.append(time.perf_counter() - t)
                    cpu.append(time.process_time() - c)
                    got = [h.id for h in r.hits]
                    overlap.append(len(set(got) & set(top_true[j].tolist())) / 10)
                    same.append(float(np.mean([a == b for a, b in zip(got, top_true[j], strict=True)])))
                row = {"candidates": C, "top10_overlap": float(np.mean(overlap)),
                       "rank_agreement": float(np.mean(same)),
                       "p50_s": float(np.percentile(lat, 50)), "p95_s": float(np.percentile(lat, 95)),
                       "cpu_p50_s": float(np.percentile(cpu, 50)), "cpu_p95_s": float(np.percentile(cpu, 95))}
                rows.append(row)
                print(json.dumps(row), flush=True)
        res["rows"] = rows
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res["loadavg_after"] = os.getloadavg()
    out = args.out or HERE / "results" / ("rerank-quick.json" if args.quick else "rerank.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
