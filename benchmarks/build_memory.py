"""Peak RSS of a default build against the number of examples (issue 21 item 9: memory flat in N).

Each size runs in a fresh process (peak RSS is per process): a tiny GPT-2 from a config (2 blocks,
width 48, vocab 256), N random sequences of ``--tokens`` ids, ``build_index`` with the CLI's defaults
(auto budget, int4 rows in the EK-FAC whitened eigenbasis, no FAISS stage), one thread. Prints
one JSON line per size ``{"examples", "peak_rss_mb", "seconds"}`` and, with ``--out``, writes them.

    python -m benchmarks.build_memory --sizes 300,3000 --out benchmarks/results/build_memory.json
    python -m benchmarks.build_memory --sizes 300,3000 --root /path/to/other/checkout   # its gradindex
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

ROOT = Path(__file__).resolve().parents[1]


def child(n: int, out: str, tokens: int, root: Path = ROOT) -> dict:
    """One default build of ``n`` examples into ``out``; its peak RSS (this process's high-water mark)."""
    if root != ROOT:  # measure another checkout's gradindex (before/after a change)
        sys.path.insert(0, str(root))
    from types import SimpleNamespace

    import torch

    from fixtures.tiny import tiny_gpt2
    from gradindex.capture import ProjectionSpec
    from gradindex.data import Tokenized
    from gradindex.pipeline import BuildConfig, build_index

    torch.set_num_threads(1)
    model = tiny_gpt2(vocab_size=256, n_layer=2, n_embd=48, n_head=4, n_positions=max(16, tokens))
    g = torch.Generator().manual_seed(0)
    seqs = torch.randint(256, (n, tokens), generator=g).tolist()
    data = Tokenized(seqs, [list(s) for s in seqs], 0, "input_ids")
    cfg = BuildConfig(projection=ProjectionSpec(), budget="auto", storage="int4", precondition="ekfac",
                      transcode="ekfac", max_length=tokens, batch_size=8)
    t = time.perf_counter()
    build_index(model, SimpleNamespace(pad_token_id=0), data, Path(out), cfg, progress=False)
    return {"examples": n, "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "seconds": round(time.perf_counter() - t, 2)}


def measure(n: int, tokens: int = 16, python: str = sys.executable, root: Path = ROOT) -> dict:
    """:func:`child` in a fresh interpreter of ``python`` on the checkout ``root``; its JSON line."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           }
    with tempfile.TemporaryDirectory(prefix="gradindex-mem-") as d:
        res = subprocess.run([python, "-m", "benchmarks.build_memory", "--child", str(n), str(Path(d) / "idx"),
                              "--tokens", str(tokens), "--root", str(root)],
                             capture_output=True, text=True, env=env, timeout=1800, cwd=ROOT)
    if res.returncode:
        raise RuntimeError(f"the {n}-example build failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="300,3000")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--child", nargs=2, metavar=("N", "DIR"))
    ap.add_argument("--root", type=Path, default=ROOT, help="the checkout to measure (default: this one)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(int(args.child[0]), args.child[1], args.tokens, args.root)))
        return []
    rows = [measure(int(n), args.tokens, root=args.root) for n in args.sizes.split(",")]
    for r in rows:
        print(json.dumps(r))
    if args.out:
        args.out.write_text(json.dumps({"tokens": args.tokens, "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
