"""Peak memory of the capture on the Qwen2.5-0.5B shape against a bare forward+backward (issue 19 item 4).

A Qwen2Config model (hidden 896, intermediate 4864, 24 layers, 14/2 heads, vocab 4096; random weights,
built from the config and saved once in float32 and once in bfloat16), the same examples (``--batch``
sequences of ``--length`` random token ids, ``--batches`` batches) through, each in a fresh child process
whose peak RSS (``wait4``'s ``ru_maxrss``) is the figure:

* ``loaded``: the model loaded (``gradindex.model.load_causal_lm``) and its weights read once, no pass:
  the floor of every row;
* ``bare``: a training step without the optimizer: ``model(**batch, labels=...).loss.backward()`` with
  parameter gradients (what the fine-tune itself costs);
* ``capture``: the default build's capture step on the same batches (``batch_gradients`` with the default
  build's per-layer projection sizes and its covariance factors; weight-free, no parameter gradient);
* ``build``: the whole default ``gradindex build`` (capture, EK-FAC fit, int4 transcode, FAISS) of the
  same examples, at the same batch size.

    flock /work/bigmem.lock python -m benchmarks.capture_memory      # about 7 GB at its peak; ~10 min on 2 CPUs
    python -m benchmarks.capture_memory --hidden 64 --intermediate 128 --layers 2 --heads 4 --batches 1   # smoke

Writes ``benchmarks/results/capture_memory.json``.
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
RESULTS = ROOT / "benchmarks" / "results" / "capture_memory.json"
MODES = ("loaded", "bare", "capture", "build")
DTYPES = ("float32", "bfloat16")


def make_model(args, work: Path) -> None:
    """Save the config's model in both dtypes and the examples (``input_ids`` records) under ``work``."""
    import numpy as np
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from fixtures.tiny import train_tokenizer

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv,
                      max_position_embeddings=max(512, args.length), tie_word_embeddings=True)
    model = Qwen2ForCausalLM(cfg)
    tok = train_tokenizer(["a b c d e f g"], vocab_size=64)  # the examples come as token ids
    for dtype in DTYPES:
        model.to(getattr(torch, dtype)).save_pretrained(work / dtype)
        tok.save_pretrained(work / dtype)
    g = np.random.default_rng(0)
    ids = g.integers(1, args.vocab, size=(args.batch * args.batches, args.length)).tolist()
    (work / "data.jsonl").write_text("".join(json.dumps({"input_ids": x}) + "\n" for x in ids))
    (work / "params.json").write_text(json.dumps({"parameters": sum(p.numel() for p in model.parameters())}))


def child(args, work: Path, mode: str, dtype: str) -> dict:
    """One measurement (in its own process): the mode's passes; returns the RSS after loading (MiB)."""
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    if mode == "build":
        from gradindex.cli import main

        t0 = time.perf_counter()
        main.main(["build", str(work / dtype), str(work / "data.jsonl"), "--out", str(work / f"idx-{dtype}"),
                   "--dtype", dtype, "--device", "cpu", "--quiet", "--overwrite", "--batch-size", str(args.batch)],
                  standalone_mode=False)
        return {"seconds": round(time.perf_counter() - t0, 1)}
    from gradindex.capture import GradientCapture, KfacSums, ProjectedRows, RowSpace
    from gradindex.capture.batch import batch_gradients
    from gradindex.capture.hooks import select_layers
    from gradindex.capture.layers import layer_info
    from gradindex.data import collate
    from gradindex.model import load_causal_lm
    from gradindex.store.basis import RowBasis
    from gradindex.store.builder import BuildConfig
    from gradindex.store.sizing import sized_projection

    model, _ = load_causal_lm(work / dtype, dtype=dtype, device="cpu")
    with torch.no_grad():
        for p in model.parameters():  # fault the (memory-mapped) weights in: the floor of every row
            p.sum()
    loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    ids = [json.loads(line)["input_ids"] for line in (work / "data.jsonl").read_text().splitlines()]
    batches = [ids[i:i + args.batch] for i in range(0, len(ids), args.batch)]
    t0 = time.perf_counter()
    if mode == "bare":
        model.requires_grad_(True)
        for b in batches:
            model.zero_grad(set_to_none=False)  # gradients kept between steps, as in training
            model(**collate(b, b, 0), use_cache=False).loss.backward()
    elif mode == "capture":
        model.requires_grad_(False)
        cfg = BuildConfig()  # the default build
        infos = {n: layer_info(m) for n, m in select_layers(model).items()}
        spec = sized_projection(cfg, infos, RowBasis())
        space = RowSpace(spec)
        with GradientCapture(model, None, ProjectedRows(space, cfg.route), KfacSums(space)) as cap:
            for b in batches:
                batch_gradients(model, cap, b, b, 0)
    return {"loaded_mib": round(loaded, 1), "seconds": round(time.perf_counter() - t0, 1)}


def measure(args, work: Path, mode: str, dtype: str) -> dict:
    """Run one child; its peak RSS (MiB) and what it reported."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "benchmarks.capture_memory", *sys.argv[1:], "--child", mode, dtype, str(work)]
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE)
    out = p.stdout.read().decode()
    _, status, usage = os.wait4(p.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"capture_memory: {mode} {dtype} failed")
    rep = json.loads(out.strip().splitlines()[-1])
    return {"peak_rss_mib": round(usage.ru_maxrss / 1024, 1), **rep}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for k, v in dict(hidden=896, intermediate=4864, layers=24, heads=14, kv=2, vocab=4096, batch=4, length=128,
                     batches=2).items():
        ap.add_argument(f"--{k}", type=int, default=v)
    ap.add_argument("--dtypes", default=",".join(DTYPES))
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--child", nargs=3, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        mode, dtype, work = args.child
        if mode == "make":
            make_model(args, Path(work))
            print("{}")
        else:
            print(json.dumps(child(args, Path(work), mode, dtype)))
        return
    Path("/work/tmp").mkdir(exist_ok=True)
    res: dict = {}
    with tempfile.TemporaryDirectory(dir="/work/tmp" if Path("/work/tmp").is_dir() else None) as d:
        work = Path(d)
        measure(args, work, "make", "-")
        params = json.loads((work / "params.json").read_text())["parameters"]
        for dtype in args.dtypes.split(","):
            modes = args.modes.split(",")
            res[dtype] = r = {m: measure(args, work, m, dtype) for m in modes}
            for m in ("capture", "build"):
                if m in r and "bare" in r:
                    r[m]["over_bare"] = round(r[m]["peak_rss_mib"] / r["bare"]["peak_rss_mib"], 3)
            print(f"{dtype}: " + ", ".join(f"{m} {r[m]['peak_rss_mib']:.0f} MiB" for m in modes)
                  + "".join(f"; {m}/bare {v['over_bare']}" for m, v in r.items() if "over_bare" in v), flush=True)
    out = {"shape": {k: getattr(args, k) for k in ("hidden", "intermediate", "layers", "heads", "kv", "vocab")},
           "parameters": params, "batch": args.batch, "length": args.length, "batches": args.batches,
           "threads": int(os.environ.get("OMP_NUM_THREADS", "2")),
           "conditions": "CPU, peak RSS (wait4 ru_maxrss) of one child process per row; random token ids of "
                         "exactly `length` tokens (no padding); model saved in the row's dtype",
           "results": res}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
