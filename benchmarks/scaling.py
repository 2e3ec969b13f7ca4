"""How build cost grows with the model and the sequence length (issue 10, scaling curves).

For GPT-2-style models built from configs (blocks × width from 4 × 256 to 24 × 1024) at 128
tokens, and for the 4 × 256 model at 128 to 2048 tokens, each configuration runs in its own child
process (so its peak memory is its own), single-threaded, on random token ids:

* ``floor``: a bare forward + backward over the sequences;
* ``graddot-K`` and ``ekfac-K`` for ``K`` in (16, 64): ``gradindex.pipeline.build_index`` with a
  ``K × K`` projection, int8 rows, no FAISS stage (EK-FAC: factors from the same pass, then the fit).

Per run: seconds, sequences/s, ratio to the floor, peak RSS and store bytes per example. The
log-log fit of seconds against the model's parameter count (and against the length) gives the
exponent printed in the table. Writes ``benchmarks/results/scaling.json`` and
``benchmarks/results/scaling.png``.

    python -m benchmarks.scaling                # the sweep (tens of minutes on 2 CPU cores)
    python -m benchmarks.scaling --quick        # two tiny configs, a minute
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
METHODS = ("floor", "graddot-16", "ekfac-16", "graddot-64", "ekfac-64")
MODELS = [(4, 256), (8, 256), (4, 512), (8, 512), (12, 768), (24, 1024)]
LENGTHS = [128, 256, 512, 1024, 2048]


def child(layers: int, width: int, length: int, n: int, method: str) -> dict:
    """One measurement, in this (child) process, on capture.py's workload (random ids, GPT-2 from a config)."""
    import torch

    from benchmarks.capture import run_floor
    from benchmarks.common import Workload, make_model, make_sequences
    from gradindex.capture import ProjectionSpec
    from gradindex.data import Tokenized
    from gradindex.pipeline import BuildConfig, build_index

    torch.set_num_threads(1)
    w = Workload(layers=layers, width=width, heads=max(4, width // 64), seq_len=length, sequences=n,
                 batch_size=8 if length <= 256 else max(1, 2048 // length))
    model = make_model(w, max(128, length))
    params = sum(p.numel() for p in model.parameters())
    ids, batch = make_sequences(w, n, length), w.batch_size
    t0 = time.perf_counter()
    if method == "floor":
        run_floor(model, ids, batch)
        store = 0
    else:
        kind, k = method.split("-")
        data = Tokenized(input_ids=ids, labels=[list(x) for x in ids], n_truncated=0, field="input_ids")
        cfg = BuildConfig.raw(projection=ProjectionSpec.parse(k), storage="int8", batch_size=batch, max_length=length,
                          precondition="ekfac" if kind == "ekfac" else "none")
        with tempfile.TemporaryDirectory() as d:
            res, _ = build_index(model, None, data, Path(d) / "idx", cfg, progress=False)
            store = sum(f.stat().st_size for f in (Path(d) / "idx" / "store").glob("*.h5")) / n
    seconds = time.perf_counter() - t0
    return {"layers": layers, "width": width, "length": length, "examples": n, "method": method,
            "params": params, "seconds": seconds, "sequences_per_s": n / seconds,
            "store_bytes_per_example": store, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def run(layers: int, width: int, length: int, n: int, method: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "benchmarks.scaling", "--child", json.dumps([layers, width, length, n, method])]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600, cwd=ROOT)
    if r.returncode != 0:
        return {"layers": layers, "width": width, "length": length, "method": method, "error": r.stderr[-500:]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def slope(x, y) -> float:
    x, y = np.log(np.asarray(x, float)), np.log(np.asarray(y, float))
    return float(np.polyfit(x, y, 1)[0]) if len(x) > 1 else float("nan")


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, xkey, xlabel in ((axes[0], "models", "params", "parameters"),
                                  (axes[1], "lengths", "length", "tokens per sequence")):
        for m in METHODS:
            rows = [r for r in res[key] if r["method"] == m and "error" not in r]
            if rows:
                ax.loglog([r[xkey] for r in rows], [r["seconds"] / r["examples"] for r in rows], "o-",
                          label=f"{m} (slope {res['exponents'][key][m]:.2f})")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("seconds per sequence (1 thread)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_title("model size (128 tokens)")
    axes[1].set_title("sequence length (4 x 256 model)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--examples", type=int, default=16, help="Sequences per run (halved for the largest).")
    ap.add_argument("--out", default=str(RESULTS / "scaling.json"))
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(*json.loads(args.child))))
        return 0
    models = [(2, 64), (2, 128)] if args.quick else MODELS
    lengths = [32, 64] if args.quick else LENGTHS
    n = 4 if args.quick else args.examples
    res: dict = {"models": [], "lengths": [], "load_start": os.getloadavg()[0]}
    for layers, width in models:
        for m in METHODS:
            r = run(layers, width, 128 if not args.quick else 32, n if layers * width < 12 * 768 else max(2, n // 2),
                    m)
            res["models"].append(r)
            print(json.dumps(r), flush=True)
    for length in lengths:
        for m in METHODS:
            r = run(*(models[0]), length, n if length <= 512 else max(2, n // 4), m)
            res["lengths"].append(r)
            print(json.dumps(r), flush=True)
    res["load_end"] = os.getloadavg()[0]
    res["exponents"] = {key: {m: slope([r["params" if key == "models" else "length"] for r in res[key]
                                        if r["method"] == m and "error" not in r],
                                       [r["seconds"] / r["examples"] for r in res[key]
                                        if r["method"] == m and "error" not in r]) for m in METHODS}
                        for key in ("models", "lengths")}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    plot(res, out.with_suffix(".png"))
    print("exponents (seconds per sequence ~ size^e):", json.dumps(res["exponents"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
