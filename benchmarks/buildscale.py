"""The default build's stages after the capture against the capture at growing N (issue 17's target:
at 10^5 examples, ≤ 0.5x the capture), with the peak disk against the final store.

Workload: ``benchmarks/lookup.py``'s (a trained GPT-2 2x32, vocab 1024, its 8 block layers hooked,
distinct stdlib windows of 8-23 words, batch 32, one thread), built through ``build_index`` as
``gradindex build`` builds it (the fused EK-FAC fit and transcode, int4 rows in its whitened
eigenbasis, the default index stage), each N in its own process, timed per stage with
``benchmarks.buildcost``'s exclusive stage clock and disk sampler. (``lookup.py`` times the
stages as separate calls, the fit and transcode unfused.)

    python -m benchmarks.buildscale --examples 10000 100000     # writes benchmarks/results/buildscale.json
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


def child(n: int, work: Path, steps: int) -> dict:
    import torch

    from benchmarks import lookup
    from benchmarks.buildcost import DiskPeak, Stages, _bytes
    from gradindex.capture import ProjectionSpec
    from gradindex.data import records_from_texts, tokenize_records
    from gradindex.index import IndexConfig
    from gradindex.model import load_causal_lm
    from gradindex.pipeline import BuildConfig

    torch.set_num_threads(1)
    docs, texts, _ = lookup.windows(n, 1)
    mdir = lookup.model_dir(work, docs, steps)
    model, tok = load_causal_lm(mdir, device="cpu")
    data = tokenize_records(records_from_texts(texts), tok, lookup.MAX_LENGTH)
    cfg = BuildConfig(projection=ProjectionSpec(), budget="auto", storage="int4", precondition="ekfac",
                      transcode="ekfac", max_length=lookup.MAX_LENGTH, batch_size=32)
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
    res = {"examples": n, "seconds": round(seconds, 2), "stages": st, "stages_cpu": cpu,
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
    ap.add_argument("--merge", action="store_true", help="keep the --out file's runs (but this commit's at these N)")
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.child, a.work, a.train_steps)))
        return {}
    a.work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    load = os.getloadavg()[0]
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=ROOT).stdout.strip()
    runs = [r for r in json.loads(a.out.read_text())["runs"] if (r["examples"], r.get("commit")) not in
            {(n, head) for n in a.examples}] if a.merge and a.out.exists() else []
    for n in a.examples:
        r = subprocess.run([sys.executable, "-m", "benchmarks.buildscale", "--child", str(n), "--work", str(a.work),
                            "--train-steps", str(a.train_steps)], capture_output=True, text=True, env=env, cwd=ROOT)
        if r.returncode:
            raise RuntimeError(f"N={n} failed:\n{r.stderr[-3000:]}")
        runs.append({**json.loads(r.stdout.strip().splitlines()[-1]), "commit": head})
        runs.sort(key=lambda x: (x["examples"], x["commit"]))
        print(r.stdout.strip().splitlines()[-1], flush=True)
        res = {"workload": "benchmarks/lookup.py's GPT-2 2x32 (trained), stdlib windows, batch 32, one thread; "
                           "build_index with the CLI defaults (fused EK-FAC fit + transcode, int4, default index)",
               "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "load_before": round(load, 2),
                           "load_after": round(os.getloadavg()[0], 2)},
               "runs": runs}
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
