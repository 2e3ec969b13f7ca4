"""The GPU check behind ``benchmarks/gpu_check.sh`` (run that; ``--dry-run`` runs this on the CPU, tiny).

On two shapes built from configs (random weights), on CUDA: Qwen2.5-0.5B (Qwen2Config: hidden 896,
intermediate 4864, 24 layers, 14/2 heads, vocab 4096) and SmolLM2-135M (LlamaConfig: hidden 576,
intermediate 1536, 30 layers, 9/3 heads, its vocabulary of 49,152, tied embeddings; the registry's
real weights, 98 MB, cannot travel to the device, whose copy of the tree is limited to 64 MiB):

1. rows: per-example projected gradients (``--projection 32``, no preconditioner, float32 rows) of
   the first examples built on CUDA in float32 and in bfloat16 against the same rows built on the CPU
   in float32 (relative error and cosine per example);
2. the default build (``gradindex build`` with no options: per-layer projection, EK-FAC, int4
   eigenbasis rows, FAISS) in float32 and bfloat16: seconds and examples per second;
3. FAISS search on the GPU: query latency (p50/p95 over the queries) of that index;
4. capture against a bare training step on the same batches: tokens per second and peak CUDA
   memory of a bare forward+backward (parameter gradients, HF loss) and of the weight-free capture.

Writes ``benchmarks/results/gpu.json`` (``--out`` elsewhere). Nothing in the tests needs a GPU; a test
runs ``--dry-run`` so this script cannot rot.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

FULL = dict(arch="qwen2", hidden=896, intermediate=4864, layers=24, heads=14, kv=2, vocab=4096, examples=64,
            length=256, check=4, queries=8, batch=8)
SMOLLM2 = dict(FULL, arch="llama", hidden=576, intermediate=1536, layers=30, heads=9, kv=3, vocab=49152)
DRY = dict(arch="qwen2", hidden=32, intermediate=64, layers=2, heads=4, kv=2, vocab=256, examples=10, length=24,
           check=2, queries=2, batch=4)
DRY_LLAMA = dict(DRY, arch="llama", heads=2, kv=1)


def make_model(s: dict, where: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from fixtures.tiny import train_tokenizer

    torch.manual_seed(0)
    tok: PreTrainedTokenizerFast = train_tokenizer(["a b c d e f g"], vocab_size=64)  # ids come pre-tokenized
    config, cls = (Qwen2Config, Qwen2ForCausalLM) if s["arch"] == "qwen2" else (LlamaConfig, LlamaForCausalLM)
    cfg = config(vocab_size=max(s["vocab"], len(tok)), hidden_size=s["hidden"], intermediate_size=s["intermediate"],
                 num_hidden_layers=s["layers"], num_attention_heads=s["heads"], num_key_value_heads=s["kv"],
                 max_position_embeddings=max(512, s["length"]), tie_word_embeddings=True)
    model = cls(cfg)
    model.save_pretrained(where)
    tok.save_pretrained(where)
    return where


def write_data(s: dict, path: Path) -> list[list[int]]:
    g = np.random.default_rng(0)
    seqs = [g.integers(1, s["vocab"], size=int(g.integers(s["length"] // 2, s["length"] + 1))).tolist()
            for _ in range(s["examples"])]
    path.write_text("".join(json.dumps({"input_ids": x}) + "\n" for x in seqs))
    return seqs


def gradindex(*args: str) -> None:
    from gradindex.cli import main

    main.main(list(map(str, args)), standalone_mode=False)


def rows_check(model_dir: Path, data: Path, s: dict, work: Path, device: str) -> dict:
    from gradindex.store import Store

    small = work / "check.jsonl"
    small.write_text("".join(data.read_text().splitlines(keepends=True)[: s["check"]]))
    rows = {}
    for name, dev, dtype in (("cpu_fp32", "cpu", "float32"), ("dev_fp32", device, "float32"),
                             ("dev_bf16", device, "bfloat16")):
        out = work / f"rows-{name}"
        gradindex("build", model_dir, small, "--out", out, "--projection", "32", "--precondition", "none",
                  "--storage", "fp32", "--no-index", "--device", dev, "--dtype", dtype, "--quiet")
        with Store(out) as st:
            r = st.read_rows(np.arange(s["check"]))
            rows[name] = np.concatenate([r[n] for n in sorted(r)], axis=1).astype(np.float64)  # [check, D]
    ref = rows["cpu_fp32"]
    out = {}
    for name in ("dev_fp32", "dev_bf16"):
        x = rows[name]
        rel = np.linalg.norm(x - ref, axis=1) / np.linalg.norm(ref, axis=1)
        cos = (x * ref).sum(1) / (np.linalg.norm(x, axis=1) * np.linalg.norm(ref, axis=1))
        out[name] = {"rel_err_max": float(rel.max()), "cosine_min": float(cos.min())}
    return out


def default_builds(model_dir: Path, data: Path, s: dict, work: Path, device: str, seqs) -> dict:
    from gradindex.query import QueryEngine

    out = {}
    for dtype in ("float32", "bfloat16"):
        idx = work / f"default-{dtype}"
        t0 = time.perf_counter()
        gradindex("build", model_dir, data, "--out", idx, "--device", device, "--dtype", dtype, "--quiet",
                  "--batch-size", s["batch"])
        sec = time.perf_counter() - t0
        with QueryEngine(idx, device=device) as engine:
            engine.query(seqs[0], k=10)  # warm: model, FAISS indices to the GPU
            lat = []
            for q in seqs[1: 1 + s["queries"]]:
                t = time.perf_counter()
                engine.query(q, k=10)
                lat.append(time.perf_counter() - t)
        out[dtype] = {"build_seconds": round(sec, 2), "examples_per_second": round(s["examples"] / sec, 2),
                      "query_p50_ms": round(1e3 * float(np.median(lat)), 1),
                      "query_p95_ms": round(1e3 * float(np.percentile(lat, 95)), 1)}
    return out


def _timed(fn, device: str, reps: int) -> tuple[float, int]:
    cuda = device.startswith("cuda")
    fn()  # warm
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps, (torch.cuda.max_memory_allocated() if cuda else 0)


def throughput(model_dir: Path, s: dict, device: str, seqs) -> dict:
    from gradindex.capture import GradientCapture, ProjectedRows, ProjectionSpec, RowSpace
    from gradindex.capture.batch import batch_gradients
    from gradindex.data import collate
    from gradindex.model import load_causal_lm

    out = {}
    batch = seqs[: s["batch"]]
    tokens = sum(map(len, batch))
    for dtype in ("float32", "bfloat16"):
        model, _ = load_causal_lm(model_dir, dtype=dtype, device=device)
        b = {k: v.to(device) for k, v in collate(batch, batch, 0).items()}

        def bare(model=model, b=b):
            model.requires_grad_(True)
            model.zero_grad(set_to_none=True)
            model(**b, use_cache=False).loss.backward()

        t_bare, m_bare = _timed(bare, device, 3)
        model.zero_grad(set_to_none=True)
        model.requires_grad_(False)
        with GradientCapture(model, None, ProjectedRows(RowSpace(ProjectionSpec(k_a=32, k_g=32)))) as cap:
            t_cap, m_cap = _timed(lambda cap=cap, model=model: batch_gradients(model, cap, batch, batch, 0), device, 3)
        out[dtype] = {"bare_tokens_per_second": round(tokens / t_bare), "capture_tokens_per_second": round(
            tokens / t_cap), "capture_over_bare_time": round(t_cap / t_bare, 3),
            "bare_peak_mib": round(m_bare / 2**20, 1), "capture_peak_mib": round(m_cap / 2**20, 1)}
        del model
    return out


def run_shape(s: dict, device: str) -> dict:
    """Rows against the CPU, the default builds and capture throughput of one model shape."""
    res = {}
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        model_dir = make_model(s, work / "model")
        seqs = write_data(s, work / "data.jsonl")
        for step, fn in (("rows", lambda: rows_check(model_dir, work / "data.jsonl", s, work, device)),
                         ("default_build", lambda: default_builds(model_dir, work / "data.jsonl", s, work, device,
                                                                  seqs)),
                         ("throughput", lambda: throughput(model_dir, s, device, seqs))):
            t0 = time.perf_counter()
            res[step] = fn()
            print(f"gpu_check: {s['arch']} {step} ({time.perf_counter() - t0:.1f} s): {json.dumps(res[step])}",
                  flush=True)
    return res


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="GPU check (benchmarks/gpu_check.sh)")
    p.add_argument("--dry-run", action="store_true", help="A tiny config on the CPU: checks the script runs.")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "gpu.json"))
    args = p.parse_args(argv)
    s = DRY if args.dry_run else FULL
    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check: torch sees no CUDA GPU; run with --dry-run for the CPU smoke mode")
    import faiss

    res = {"dry_run": args.dry_run, "shape": s, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
           "torch": torch.__version__, "faiss_gpus": faiss.get_num_gpus() if hasattr(faiss, "get_num_gpus") else 0}
    res |= run_shape(s, device)
    res["smollm2_shape"] = {"shape": DRY_LLAMA if args.dry_run else SMOLLM2} | run_shape(
        DRY_LLAMA if args.dry_run else SMOLLM2, device)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    print(f"gpu_check: wrote {args.out}")


if __name__ == "__main__":
    main()
