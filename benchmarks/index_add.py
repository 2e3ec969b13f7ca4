"""The index stage on wide rows: FAISS's SQ4 add with the old and the new block sizes, and the kinds that replace it.

Workload: the demo's model shape (GPT-2 from a config, 2 blocks, width 128, vocab 2048, 128
positions, untrained; its 8 block Conv1D layers whole: 395,520 numbers per example), 4,096
examples (the standard-library corpus's documents, repeated), rows stored raw as int4 (193 KiB per
example, 0.8 GB). Side by side in one run, each on the same store: ``SQ4`` built as before this
change (blocks of 16,384 rows whatever their width, a training sample of every row up to 16,384:
4.3 GB of float32 a step for a 66k-number layer at 16k examples), ``SQ4`` with byte-bounded blocks
(64 MB) and a 4,096-row training sample, ``store`` (no FAISS copy: one pass for the norms) and
``sketch`` (two tiers). Seconds, vectors (rows × layers) per second, peak RSS of each build
(a fresh process each), index bytes.

    python -m benchmarks.index_add                  # ~10 min on 2 shared cores
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]

CONFIGS = {
    "SQ4 (old blocks)": "IndexConfig(factory='SQ4', block_bytes=1 << 62, train_size=16384)",
    "SQ4": "IndexConfig(factory='SQ4')",
    "store": "IndexConfig(factory='store')",
    "sketch": "IndexConfig(factory='sketch')",
}
CHILD = """
import json, resource, sys, time, faiss, torch
torch.set_num_threads(1); faiss.omp_set_num_threads(1)
from gradindex.index import IndexConfig, build_indices
t = time.perf_counter()
r = build_indices(sys.argv[1], {cfg}, progress=False, force=True)
s = time.perf_counter() - t
print(json.dumps({{"seconds": s, "layers": len(r.meta["layers"]), "examples": r.meta["examples"],
                  "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}}))
"""


def store(work: Path, n: int) -> Path:
    out = work / f"store-{n}"
    if (out / "manifest.json").exists():
        return out
    import torch

    from fixtures.tiny import save_model_dir, stdlib_corpus, tiny_gpt2, train_tokenizer
    from gradindex.capture import ProjectionSpec
    from gradindex.data import records_from_texts, tokenize_records
    from gradindex.store.builder import BuildConfig, build_store

    torch.manual_seed(0)
    docs = stdlib_corpus()
    tok = train_tokenizer(docs, vocab_size=2048)
    model = tiny_gpt2(vocab_size=len(tok), n_layer=2, n_embd=128, n_head=4, n_positions=128)
    mdir = save_model_dir(model, tok, work / "model")
    data = tokenize_records(records_from_texts([docs[i % len(docs)] for i in range(n)]), tok, 128)
    cfg = BuildConfig.raw(projection=ProjectionSpec.parse("none"), storage="int4", max_length=128)
    build_store(model, tok, data, out, cfg, model_id=str(mdir), progress=False)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--examples", type=int, default=4096)
    ap.add_argument("--work", default="/tmp/gradindex-index-add")
    ap.add_argument("--out", default="benchmarks/results/index_add.json")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    d = store(work, args.examples)
    rows = sum(f.stat().st_size for f in (d / "store").iterdir())
    report = {"workload": __doc__.split("\n\n")[1], "store_bytes": rows, "load_average_start": os.getloadavg(),
              "runs": {}}
    for name, cfg in CONFIGS.items():
        t = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", CHILD.format(cfg=cfg), str(d)], capture_output=True, text=True,
                             cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if out.returncode:
            raise RuntimeError(out.stderr[-2000:])
        r = json.loads(out.stdout.strip().splitlines()[-1])
        r["index_bytes"] = sum(f.stat().st_size for f in (d / "faiss").iterdir())
        r["vectors_per_s"] = r["examples"] * r["layers"] / r["seconds"]
        r["wall_s"] = time.perf_counter() - t
        report["runs"][name] = r
        print(f"{name}: {r['seconds']:.1f} s, {r['vectors_per_s']:.0f} vectors/s, peak RSS "
              f"{r['max_rss_bytes'] / 2**30:.2f} GiB, {r['index_bytes'] / 2**20:.0f} MiB", flush=True)
    report["load_average_end"] = os.getloadavg()
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
