"""The default build's stages after the capture on 1 and 2 torchrun ranks (issue 34: the EK-FAC correction's
store pass and the transcode shared by the ranks, each over its own store files).

Workload: a config-built GPT-2 (``--layers`` x ``--width``, untrained, vocab 512), ``--examples`` distinct stdlib
windows of up to 32 tokens, ``gradindex build`` with its defaults (rows projected to the auto budget, EK-FAC fitted
on every example and the rows transcoded to int4 in its eigenbasis, the default tier), ``--shard-size`` examples a
store file, on the CPU, one thread a process (``OMP_NUM_THREADS=1``): once as one process, once under
``torchrun --nproc_per_node 2`` (gloo). Per run: the build's wall seconds, the fused fit + transcode's
(``preconditioners.ekfac.seconds``, the stage the ranks share), the transcode's part of it, the tier's, and the
load average before and after; the two indices' recorded hashes must be equal.

    python -m benchmarks.build_ranks --examples 2000   # writes benchmarks/results/build-ranks.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def inputs(work: Path, n: int, layers: int, width: int) -> tuple[Path, Path]:
    """The model directory and the data file."""
    from fixtures.tiny import save_model_dir, stdlib_corpus, tiny_gpt2, train_tokenizer

    docs = stdlib_corpus()
    words = " ".join(docs).split()
    texts = [" ".join(words[i * 7:i * 7 + 8 + i % 16]) for i in range(n)]
    tok = train_tokenizer(texts[:2000], vocab_size=512)
    mdir = save_model_dir(tiny_gpt2(vocab_size=len(tok), n_layer=layers, n_embd=width, n_head=4), tok, work / "model")
    data = work / "train.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return mdir, data


def run(ranks: int, mdir: Path, data: Path, out: Path, shard_size: int) -> dict:
    """One build; its stage seconds."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    head = [sys.executable, "-m", "gradindex"] if ranks == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks), "-m",
         "gradindex"]
    cmd = [*head, "build", str(mdir), str(data), "--out", str(out), "--shard-size", str(shard_size),
           "--max-length", "32", "--device", "cpu", "--quiet", "--overwrite"]
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    m = json.loads((out / "manifest.json").read_text())
    tier = json.loads((out / "faiss" / "index.json").read_text())
    return {"ranks": ranks, "build_seconds": round(wall, 2),
            "fit_and_transcode_seconds": m["preconditioners"]["ekfac"]["seconds"],
            "transcode_seconds": m["transcode"]["seconds"], "tier_seconds": round(tier["seconds"], 2),
            "load_before": round(load, 2), "load_after": round(os.getloadavg()[0], 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=2000)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--shard-size", type=int, default=125)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--work", default="/tmp/build-ranks")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/build-ranks.json"))
    a = ap.parse_args()
    from gradindex.checksum import read_checksums
    from gradindex.spec.manifest import Manifest

    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    mdir, data = inputs(work, a.examples, a.layers, a.width)
    runs = []
    for _ in range(a.repeats):  # (interleaved: the machine's load drifts)
        for ranks in (1, 2):
            runs.append(run(ranks, mdir, data, work / f"r{ranks}", a.shard_size))
            print(json.dumps(runs[-1]), flush=True)
    hashes = [{n: e["blake2b"] for n, e in read_checksums(work / f"r{r}").items() if not n.startswith("faiss")}
              for r in (1, 2)]
    m = json.loads((work / "r1" / "manifest.json").read_text())
    dims = [s.dim for s in Manifest(m).layers.values()]
    res = {"workload": {"model": f"GPT-2 {a.layers}x{a.width} (config-built)", "examples": a.examples,
                        "shard_size": a.shard_size, "store_files": m["counts"]["shards"],
                        "storage": m["build"]["storage"],
                        "row_numbers": sum(dims), "layers": len(dims),
                        "threads_per_process": 1, "cpus": os.cpu_count()},
           "same_store_fits_basis_hashes": hashes[0] == hashes[1], "runs": runs, "date": time.strftime("%Y-%m-%d")}
    Path(a.out).write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
