"""Peak RSS of a top-5 exact-stage query (issue 30 item 3): the full-space curvature streamed a layer at a time.

Subjects: tiny GPT-2 and Llama from configs (``--width``, 4 blocks, a BPE tokenizer trained on the data), each a
budget-bound index (1/64, EK-FAC) with the exact stage's full-space fit (``rerank_fit``), built once with this
checkout; and, with ``--smollm2 DIR``, the LoRA-fine-tuned SmolLM2-135M-Instruct of :mod:`benchmarks.real_llm`
(Q4_1-rounded weights de-quantized to float32; ``DIR/merged``, ``DIR/idx-full``, ``DIR/queries.jsonl``).

Each measurement is a fresh interpreter (one thread) of the checkout ``--root`` (``--before ROOT``: another
checkout, e.g. ``git archive`` of the commit before the change) that opens a :class:`~gradindex.query.QueryEngine`
on the CPU, answers the query's first stage, resets the process's peak RSS (``/proc/self/clear_refs``), then
answers ``rerank_full=5``: ``exact_peak_mb`` is the peak RSS during that exact query, ``rss_before_mb`` the RSS
when it started, ``peak_rss_mb`` the process's peak. With ``--budgets``, the curvature cache budget
(``QueryEngine.curvature_cache_bytes``) of each "after" run.

    git archive de11b1d gradindex benchmarks fixtures | tar -x -C /tmp/exact_before     # the checkout before
    python -m benchmarks.exact_memory --before /tmp/exact_before --before-label de11b1d --budgets 0,8,1024 \\
        --smollm2 /work/cache/smollm2/ft-n160-s0-fef273aca2 --out benchmarks/results/exact_memory.json
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
QUERY = {"text": "the cat sat on a mat while the dog ran home"}
K = 5


def _texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 40))) for _ in range(n)]


def build(arch: str, out: Path, width: int, n: int = 200) -> None:
    """A tiny ``arch`` model folder, ``n`` texts and their budget-bound index with the full-space fit under ``out``."""
    import torch

    from fixtures.tiny import save_model_dir, tiny_gpt2, tiny_llama, train_tokenizer
    from gradindex.capture import ProjectionSpec
    from gradindex.data import load_records, tokenize_records
    from gradindex.index import build_indices
    from gradindex.model import load_causal_lm
    from gradindex.pipeline import BuildConfig, build_index

    torch.set_num_threads(1)
    data = out / "train.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in _texts(n)))
    tok = train_tokenizer(_texts(200, seed=1) + [" ".join(WORDS)], vocab_size=300)
    net = tiny_gpt2(vocab_size=len(tok), n_layer=4, n_embd=width, n_head=4) if arch == "gpt2" else \
        tiny_llama(vocab_size=len(tok), n_layer=4, hidden=width, n_head=4, intermediate=width * 8 // 3)
    model_dir = save_model_dir(net, tok, out / "model")
    model, tok = load_causal_lm(model_dir, device="cpu")
    cfg = BuildConfig(projection=ProjectionSpec(), budget="1/64", precondition="ekfac", shard_size=64,
                      max_length=64, rerank_fit=True)
    build_index(model, tok, tokenize_records(load_records(data), tok, 64), out / "index", cfg,
                model_id=str(model_dir), data_id=str(data), progress=False)
    build_indices(out / "index", progress=False)


def _status_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


def query(index: Path, record: dict, method: str, budget: int, model: str | None) -> dict:
    """The first stage, then a top-``K`` exact stage in this process: its peak RSS (module docstring)."""
    import torch

    from gradindex.query import QueryEngine

    torch.set_num_threads(1)
    with QueryEngine(index, model, device="cpu", use_gpu=False) as e:
        if budget and hasattr(e, "curvature_cache_bytes"):
            e.curvature_cache_bytes = budget
        e.query(record, k=K, method=method, rerank_full=0)
        before = _status_mb("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # the peak RSS (VmHWM) starts again from here
        t = time.perf_counter()
        r = e.query(record, k=K, method=method, rerank_full=K)
        secs = time.perf_counter() - t
        held = getattr(e.full_preconditioner(method), "cache", None)  # (None before the change)
    return {"rss_before_mb": round(before, 1), "exact_peak_mb": round(_status_mb("VmHWM"), 1),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "seconds": round(secs, 2), "ids": [h.id for h in r.hits[:K]],
            "full_scores": [h.full_score for h in r.hits[:K]],
            "curvature_peak_mb": round(held.peak / 2**20, 1) if held is not None else None,
            "budget_mb": round(held.budget / 2**20, 1) if held is not None and held.budget else None}


def measure(index: Path, record: dict, method: str, root: Path, budget: int = 0, model: str | None = None) -> dict:
    """:func:`query` in a fresh interpreter on the checkout ``root``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "TRANSFORMERS_VERBOSITY": "error", "PYTHONPATH": str(root)}
    cmd = [sys.executable, "-m", "benchmarks.exact_memory", "--query", str(index), json.dumps(record), method,
           str(budget), model or "", "--root", str(root)]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600, cwd=ROOT)
    if res.returncode:
        raise RuntimeError(f"the exact query on {index} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def subject(name: str, index: Path, record: dict, method: str, args, model: str | None = None) -> dict:
    """Before (``args.before``, if given) and after at each budget of ``args.budgets`` (0: the default)."""
    out: dict = {"index": str(index), "method": method, "k": K}
    if args.before:
        out["before"] = measure(index, record, method, args.before, model=model)
        print(name, "before", json.dumps(out["before"]), flush=True)
    for b in args.budgets:
        out[f"after_{b >> 20}MiB" if b else "after"] = got = measure(index, record, method, args.root, b, model)
        print(name, "after", b, json.dumps(got), flush=True)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--methods", default="ekfac,ekfac-selfnorm")
    ap.add_argument("--budgets", default="0,8", help="curvature cache budgets in MiB (0: the default)")
    ap.add_argument("--before", type=Path, help="a checkout of gradindex before the change")
    ap.add_argument("--before-label", default="", help="what --before is (e.g. its commit), kept in the results")
    ap.add_argument("--smollm2", type=Path, help="the real_llm work folder (merged/, idx-full/, queries.jsonl)")
    ap.add_argument("--root", type=Path, default=ROOT)
    ap.add_argument("--build", nargs=2, metavar=("ARCH", "DIR"))
    ap.add_argument("--query", nargs=5, metavar=("INDEX", "RECORD", "METHOD", "BUDGET", "MODEL"))
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.root != ROOT:
        sys.path.insert(0, str(args.root))
    if args.build:
        build(args.build[0], Path(args.build[1]), args.width)
        return {}
    if args.query:
        idx, rec, method, budget, model = args.query
        print(json.dumps(query(Path(idx), json.loads(rec), method, int(budget), model or None)))
        return {}
    args.budgets = [int(b) << 20 for b in args.budgets.split(",")]
    results = run(args)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    return results


def run(args) -> dict:
    """Every subject, before and after (:func:`subject`)."""
    conditions = ("one thread, CPU, float32; a fresh process per measurement; exact_peak_mb: peak RSS during the "
                  f"top-{K} exact query after the first stage (VmHWM reset); a shared 2-core machine")
    results: dict = {"conditions": conditions, "before": args.before_label, "subjects": {}}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "TRANSFORMERS_VERBOSITY": "error"}
    with tempfile.TemporaryDirectory(prefix="gradindex-exactmem-") as d:
        for arch in ("gpt2", "llama"):
            out = Path(d) / arch
            out.mkdir()
            subprocess.run([sys.executable, "-m", "benchmarks.exact_memory", "--build", arch, str(out), "--width",
                            str(args.width)], check=True, env=env, cwd=ROOT)
            for m in args.methods.split(","):
                results["subjects"][f"tiny-{arch}-{args.width}/{m}"] = subject(arch, out / "index", QUERY, m, args)
    if args.smollm2:
        first = json.loads((args.smollm2 / "queries.jsonl").read_text().splitlines()[0])
        for m in args.methods.split(","):
            results["subjects"][f"smollm2-135m-ft/{m}"] = subject("smollm2", args.smollm2 / "idx-full", first, m,
                                                                   args, str(args.smollm2 / "merged"))
    return results


if __name__ == "__main__":
    main()
