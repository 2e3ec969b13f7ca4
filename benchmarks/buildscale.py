"""The default build's stages after the capture against the capture at growing N (issue 17's target:
at 10^5 examples, ≤ 0.5x the capture), with the peak disk against the final store.

Workload: ``benchmarks/lookup.py``'s (a trained GPT-2 2x32, vocab 1024, its 8 block layers hooked,
distinct stdlib windows of 8-23 words, batch 32, one thread), built through ``build_index`` as
``gradindex build`` builds it (the fused EK-FAC fit and transcode, int4 rows in its whitened
eigenbasis, the default index stage), each N in its own process, timed per stage with
``benchmarks.buildcost``'s exclusive stage clock and disk sampler. (``lookup.py`` times the
stages as separate calls, the fit and transcode unfused.) ``--fit-sample S`` (the build's default
8192): N > S fits on a sample of S and codes the rows in the capture pass (``fit_sample`` stage: the
sample's capture and fit); 0: the fused fit and transcode over every row. Older runs are kept.

``--quality N``: at N examples, the index fitted on a sample of each ``--fit-sample`` against the one
fitted on every example (S = 0): per held-out query (``--queries``), the top-10 overlap and the
Spearman correlation of the default (EK-FAC) scores of every training example, written under ``quality``.

    python -m benchmarks.buildscale --examples 100000 --merge   # writes benchmarks/results/buildscale.json
    python -m benchmarks.buildscale --quality 20000 --merge
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _inputs(n: int, work: Path, steps: int, queries: int = 1):
    import torch

    from benchmarks import lookup
    from gradindex.data import records_from_texts, tokenize_records
    from gradindex.model import load_causal_lm

    torch.set_num_threads(1)
    docs, texts, held = lookup.windows(n, queries)
    mdir = lookup.model_dir(work, docs, steps)
    model, tok = load_causal_lm(mdir, device="cpu")
    return mdir, model, tok, tokenize_records(records_from_texts(texts), tok, lookup.MAX_LENGTH), held


def _config(fit_sample: int):
    from benchmarks import lookup
    from gradindex.capture import ProjectionSpec
    from gradindex.pipeline import BuildConfig

    return BuildConfig(projection=ProjectionSpec(), budget="auto", storage="int4", precondition="ekfac",
                       transcode="ekfac", max_length=lookup.MAX_LENGTH, batch_size=32, fit_sample=fit_sample)


def quality(n: int, work: Path, steps: int, samples: list[int], queries: int) -> dict:
    """Indices fitted on each sample size and on every example (no index stage): their scores compared."""
    import numpy as np
    import torch

    from benchmarks import lookup
    from gradindex.index import OpenIndex
    from gradindex.pipeline import build_index
    from gradindex.query.scores import score_matrix

    mdir, model, tok, data, held = _inputs(n, work, steps, queries)
    scores = {}
    for s in [0, *samples]:
        out = work / f"quality-{n}-{s}"
        t = time.perf_counter()
        if not (out / "manifest.json").exists() or json.loads((out / "manifest.json").read_text())["status"] != \
                "complete" or "ekfac" not in json.loads((out / "manifest.json").read_text()).get("preconditioners", {}):
            build_index(model, tok, data, out, _config(s), model_id=str(mdir), progress=False, rerank_fit=False)
        q = lookup.query_rows(out, mdir, held)
        with OpenIndex(out) as ix:
            scores[s] = score_matrix(ix, {k: torch.from_numpy(v) for k, v in q.items()}, "ekfac", 1e-3, ix.layers)
        print(f"S={s}: built and scored in {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
    ref = scores[0]
    top = np.argsort(-ref, axis=1, kind="stable")[:, :10]
    res = {"examples": n, "queries": len(held), "against": "the index fitted on every example (--fit-sample 0)",
           "scores": "EK-FAC scores of every training example (the default query's exact stage)", "samples": {}}
    for s in samples:
        got = np.argsort(-scores[s], axis=1, kind="stable")[:, :10]
        overlap = [len(set(a) & set(b)) / 10 for a, b in zip(got, top)]
        rank = lambda x: np.argsort(np.argsort(x, kind="stable"), kind="stable")  # noqa: E731 (no ties in float scores)
        rho = [float(np.corrcoef(rank(a), rank(b))[0, 1]) for a, b in zip(scores[s], ref)]
        res["samples"][str(s)] = {"top10_overlap_mean": round(float(np.mean(overlap)), 4),
                                  "top10_overlap_min": round(float(np.min(overlap)), 4),
                                  "spearman_mean": round(float(np.mean(rho)), 4),
                                  "spearman_min": round(float(np.min(rho)), 4)}
    return res


def child(n: int, work: Path, steps: int, fit_sample: int = 8192) -> dict:
    from benchmarks.buildcost import DiskPeak, Stages, _bytes
    from gradindex.index import IndexConfig

    mdir, model, tok, data, _ = _inputs(n, work, steps)
    cfg = _config(fit_sample)
    out = work / f"idx-{n}"
    shutil.rmtree(out, ignore_errors=True)
    stages = Stages()
    stages.wrap()
    import gradindex.pipeline as pipeline

    t = time.perf_counter()
    with DiskPeak(out, stages) as disk:
        pipeline.build_index(model, tok, data, out, cfg, index=IndexConfig(), model_id=str(mdir), progress=False)
    seconds = time.perf_counter() - t
    store = _bytes(out / "store")
    st = {k: round(v, 2) for k, v in stages.seconds.items()}
    cpu = {k: round(v, 2) for k, v in stages.cpu.items()}
    after = sum(v for k, v in st.items() if k != "capture")
    res = {"examples": n, "fit_sample": fit_sample, "seconds": round(seconds, 2), "stages": st, "stages_cpu": cpu,
           "after_capture_over_capture_cpu":
               round(sum(v for k, v in cpu.items() if k != "capture") / cpu["capture"], 3),
           "after_capture_over_capture": round(after / st["capture"], 3),
           "after_capture_without_index_over_capture": round((after - st.get("faiss", 0.0)) / st["capture"], 3),
           "store_bytes": store, "index_bytes": _bytes(out), "peak_disk_bytes": disk.peak,
           "peak_disk_over_store": round(disk.peak / store, 3), "peak_disk_stage": disk.peak_stage,
           "disk_at_peak": disk.at_peak,
           "peak_disk_by_stage_over_store": {k: round(v / store, 3) for k, v in disk.by_stage.items()},
           "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
    shutil.rmtree(out, ignore_errors=True)
    return res


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--examples", type=int, nargs="+", default=[10_000, 100_000])
    ap.add_argument("--work", type=Path, default=Path(os.environ.get("BUILDSCALE_WORK", "/tmp/gradindex-buildscale")))
    ap.add_argument("--train-steps", type=int, default=300)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "buildscale.json")
    ap.add_argument("--child", type=int, default=0)
    ap.add_argument("--fit-sample", type=int, nargs="+", default=[8192],
                    help="the build's --fit-sample (each in turn; with --quality: the samples compared with 0)")
    ap.add_argument("--quality", type=int, default=0, help="compare sampled fits with the full one at this N")
    ap.add_argument("--queries", type=int, default=32)
    ap.add_argument("--merge", action="store_true", help="keep the --out file's runs (but this commit's at these N)")
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.child, a.work, a.train_steps, a.fit_sample[0])))
        return {}
    a.work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    load = os.getloadavg()[0]
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=ROOT).stdout.strip()
    if a.quality:
        import torch

        torch.set_num_threads(1)
        q = {**quality(a.quality, a.work, a.train_steps, a.fit_sample, a.queries), "commit": head}
        print(json.dumps(q), flush=True)
        return _write(a.out, load, quality=q)
    res = {}
    for n in a.examples:
        for s in a.fit_sample:
            r = subprocess.run([sys.executable, "-m", "benchmarks.buildscale", "--child", str(n), "--work",
                                str(a.work), "--train-steps", str(a.train_steps), "--fit-sample", str(s)],
                               capture_output=True, text=True, env=env, cwd=ROOT)
            if r.returncode:
                raise RuntimeError(f"N={n} failed:\n{r.stderr[-3000:]}")
            run = {**json.loads(r.stdout.strip().splitlines()[-1]), "commit": head}
            print(r.stdout.strip().splitlines()[-1], flush=True)
            res = _write(a.out, load, run=run, keep=a.merge or bool(res))
    return res


def _key(r: dict) -> tuple:
    return r["examples"], r.get("commit"), r.get("fit_sample", 0)


def _write(out: Path, load: float, run: dict | None = None, quality: dict | None = None, keep: bool = True) -> dict:
    """Add ``run`` (replacing this commit's at its N and sample) or ``quality`` to ``out``, keeping the rest."""
    old = json.loads(out.read_text()) if keep and out.exists() else {}
    runs = [r for r in old.get("runs", []) if run is None or _key(r) != _key(run)] + ([run] if run else [])
    runs.sort(key=lambda x: (x["examples"], x.get("commit") or "", x.get("fit_sample", 0)))
    res = {"workload": "benchmarks/lookup.py's GPT-2 2x32 (trained), stdlib windows, batch 32, one thread; "
                       "build_index with the CLI defaults (int4 rows in the EK-FAC whitened eigenbasis, default "
                       "index; runs without fit_sample: the fused fit + transcode over every row)",
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "load_before": round(load, 2),
                       "load_after": round(os.getloadavg()[0], 2)},
           "runs": runs,
           "quality": [x for x in old.get("quality", []) if quality is None or x["examples"] != quality["examples"]
                       or x["commit"] != quality["commit"]] + ([quality] if quality else [])}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    return res

if __name__ == "__main__":
    main()
