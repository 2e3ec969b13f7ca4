"""Peak RSS of ``gradindex audit`` against the number of training examples (issue 33 item 11: memory flat in N).

A tiny GPT-2 from a config (2 blocks, width ``--width``, a BPE tokenizer trained on the data), ``N`` random
sentences of ``--words`` words, a default build (auto budget, int4 rows in the EK-FAC whitened eigenbasis)
and its FAISS stage in one process; then in a fresh process :func:`gradindex.apps.report.build_report` (4 queries,
k 5, outliers, duplicate groups, plots), whose peak RSS is measured. One thread. Prints one JSON line per size
``{"examples", "row_numbers", "peak_rss_mb", "seconds"}`` and, with ``--out``, writes them.

    python -m benchmarks.audit_memory --sizes 200,1000 --out benchmarks/results/audit_memory.json
    python -m benchmarks.audit_memory --sizes 200,1000 --root /path/to/other/checkout   # its gradindex
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("the cat sat on a mat while some dog ran far away from home and ate fish bread at noon "
         "under blue sky with red sun over green hills near old town river").split()
QUERIES = ["the cat sat on a mat", "dog ran far away from home", "bread at noon under blue sky",
           "red sun over green hills"]


def _texts(n: int, words: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, words))) for _ in range(n)]


def build(n: int, out: Path, width: int, words: int) -> dict:
    """A model directory, a data file of ``n`` texts and their default index under ``out``."""
    import torch

    from fixtures.tiny import save_model_dir, tiny_gpt2, train_tokenizer
    from gradindex.data import load_records, tokenize_records
    from gradindex.index import build_indices
    from gradindex.pipeline import BuildConfig, build_index

    torch.set_num_threads(1)
    texts = _texts(n, words)
    data = out / "train.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    tok = train_tokenizer(_texts(200, words, seed=1) + [" ".join(WORDS)], vocab_size=300)
    model_dir = save_model_dir(tiny_gpt2(vocab_size=len(tok), n_layer=2, n_embd=width, n_head=4), tok, out / "model")
    tokens = tokenize_records(load_records(data), tok, 64)
    build_index(_model(model_dir), tok, tokens, out / "index", BuildConfig(max_length=64),
                model_id=str(model_dir), data_id=str(data), progress=False)
    build_indices(out / "index", progress=False)
    return {"examples": n}


def _model(model_dir: Path):
    from gradindex.model import load_causal_lm

    return load_causal_lm(model_dir, device="cpu")[0]


def audit(out: Path) -> dict:
    """``build_report`` over the index in ``out``; this process's peak RSS."""
    import torch

    from gradindex.apps.report import ReportConfig, build_report
    from gradindex.query import QueryEngine

    torch.set_num_threads(1)
    t = time.perf_counter()
    with QueryEngine(out / "index", device="cpu", use_gpu=False) as engine:
        build_report(engine, [{"text": q} for q in QUERIES], out / "report", ReportConfig(k=5, outliers=10))
        numbers = sum(engine.store.dims.values())
        n = engine.n
    return {"examples": n, "row_numbers": numbers,
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "seconds": round(time.perf_counter() - t, 2)}


def measure(n: int, width: int = 64, words: int = 40, python: str = sys.executable, root: Path = ROOT) -> dict:
    """A build of ``n`` examples, then the audit in a fresh interpreter of ``python`` on the checkout ``root``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "TRANSFORMERS_VERBOSITY": "error"}
    with tempfile.TemporaryDirectory(prefix="gradindex-auditmem-") as d:
        for step in ("build", "audit"):
            res = subprocess.run([python, "-m", "benchmarks.audit_memory", f"--{step}", str(n), d, "--width",
                                  str(width), "--words", str(words), "--root", str(root)],
                                 capture_output=True, text=True, env=env, timeout=1800, cwd=ROOT)
            if res.returncode:
                raise RuntimeError(f"the {n}-example {step} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="200,1000")
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--words", type=int, default=40)
    ap.add_argument("--build", nargs=2, metavar=("N", "DIR"))
    ap.add_argument("--audit", nargs=2, metavar=("N", "DIR"))
    ap.add_argument("--root", type=Path, default=ROOT, help="the checkout to measure (default: this one)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.root != ROOT:  # measure another checkout's gradindex (before/after a change)
        sys.path.insert(0, str(args.root))
    if args.build or args.audit:
        n, d = args.build or args.audit
        got = build(int(n), Path(d), args.width, args.words) if args.build else audit(Path(d))
        print(json.dumps(got))
        return []
    rows = [measure(int(n), args.width, args.words, root=args.root) for n in args.sizes.split(",")]
    for r in rows:
        print(json.dumps(r))
    if args.out:
        args.out.write_text(json.dumps({"width": args.width, "words": args.words, "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
