"""The fused transcode with each row rotated once (its float16 rotated copy) against rotating twice, side by side.

Workload: ``benchmarks/lookup.py``'s model and examples (a small GPT-2 trained on the standard-library
corpus, distinct windows of its text; 25,152 numbers per example), ``--examples`` of them captured once
with the default build's settings; the store is copied and each copy finishes the default build two ways:

* ``once`` (the default): the fit pass keeps its rotated rows as float16 and the transcode only scales
  and codes them (:mod:`gradindex.precondition.rotated`);
* ``twice`` (the previous default; what the build still does where the disk has no room for the copy):
  the transcode reads the store again and rotates every row a second time.

Per way: seconds of the fit + transcode, the most bytes on disk while it runs (sampled); then the
agreement of the two indices' exhaustive default scores (``score_matrix``, EK-FAC on the stored int4
rows) for held-out queries: Spearman over the whole training set and the shared share of the top 10.
Writes ``benchmarks/results/rotate_once.json``.

    python -m benchmarks.rotate_once --examples 2000
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.buildcost import DiskPeak, _bytes  # noqa: E402
from benchmarks.common import spearman  # noqa: E402
from benchmarks.lookup import model_dir, query_rows, windows  # noqa: E402
from gradindex.capture import ProjectionSpec  # noqa: E402
from gradindex.data import records_from_texts, tokenize_records  # noqa: E402
from gradindex.lock import index_lock  # noqa: E402
from gradindex.model import load_causal_lm  # noqa: E402
from gradindex.precondition import FitConfig, fused  # noqa: E402
from gradindex.query.scores import score_matrix  # noqa: E402
from gradindex.store.builder import BuildConfig, build_store  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def finish(d: Path, model, tok, data, cfg: BuildConfig, once: bool) -> dict:
    """The default build's fit + transcode on ``d``'s captured store, with or without the rotated copy."""
    real = fused.keeps_copy
    fused.keeps_copy = real if once else (lambda *a: False)
    fit = FitConfig(method="ekfac", damping=cfg.damping, fisher=cfg.fisher, seed=cfg.fisher_seed)
    try:
        with index_lock(d, "benchmark"), DiskPeak(d) as disk:
            t = time.perf_counter()
            fused.fit_and_transcode(d, fit, cfg.rows.storage, model, tok, data, progress=False)
            secs = time.perf_counter() - t
    finally:
        fused.keeps_copy = real
    return {"fit_and_transcode_s": round(secs, 2), "peak_disk_bytes": disk.peak, "store_bytes": _bytes(d / "store")}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--examples", type=int, default=2000)
    ap.add_argument("--queries", type=int, default=20)
    ap.add_argument("--train-steps", type=int, default=300)
    ap.add_argument("--work", type=Path, default=Path("/tmp/gradindex-rotate-once"))
    ap.add_argument("--out", type=Path, default=RESULTS / "rotate_once.json")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    load = os.getloadavg()[0]
    a.work.mkdir(parents=True, exist_ok=True)
    docs, texts, queries = windows(a.examples, a.queries)
    mdir = model_dir(a.work, docs, a.train_steps)
    model, tok = load_causal_lm(mdir, device="cpu")
    data = tokenize_records(records_from_texts(texts), tok, 64)
    cfg = BuildConfig(projection=ProjectionSpec(), budget="auto", storage="int4", precondition="ekfac",
                      transcode="ekfac", max_length=64, batch_size=32)
    cap = a.work / "captured"
    shutil.rmtree(cap, ignore_errors=True)
    t = time.perf_counter()
    build_store(model, tok, data, cap, cfg, model_id=str(mdir), progress=False)
    capture_s = time.perf_counter() - t
    ways = {}
    for name in ("twice", "once"):
        d = a.work / name
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(cap, d)
        ways[name] = finish(d, model, tok, data, cfg, once=name == "once")
        print(name, json.dumps(ways[name]), flush=True)
    q = {n: torch.from_numpy(v) for n, v in query_rows(a.work / "once", mdir, queries).items()}
    s = {name: score_matrix(a.work / name, q, "ekfac", device="cpu") for name in ways}
    rho = [spearman(s["once"][j], s["twice"][j]) for j in range(len(queries))]
    top = [len(set(np.argsort(-s["once"][j])[:10]) & set(np.argsort(-s["twice"][j])[:10])) / 10
           for j in range(len(queries))]
    res = {
        "workload": __doc__.split("\n\n")[1].replace("\n", " "),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "threads": 1,
                    "load_before": round(load, 2), "load_after": round(os.getloadavg()[0], 2)},
        "examples": a.examples, "capture_s": round(capture_s, 2), "captured_bytes": _bytes(cap / "store"),
        "ways": ways,
        "once_over_twice_seconds": round(ways["once"]["fit_and_transcode_s"] / ways["twice"]["fit_and_transcode_s"], 3),
        "agreement": {"queries": len(queries), "spearman_mean": float(np.mean(rho)), "spearman_min": float(np.min(rho)),
                      "top10_mean": float(np.mean(top)), "top10_min": float(np.min(top))},
    }
    print(json.dumps({k: res[k] for k in ("once_over_twice_seconds", "agreement")}, indent=1))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1))
    shutil.rmtree(a.work / "once"), shutil.rmtree(a.work / "twice"), shutil.rmtree(cap)
    return res


if __name__ == "__main__":
    main()
