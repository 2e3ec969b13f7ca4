"""``gradindex plan`` from a config alone against a real build of a 2-layer slice of the same shape (issue 30).

For each big config (``fixtures/configs.py``: Llama-3-8B, Mixtral-8x7B) cut to ``--layers`` blocks
(``num_hidden_layers``; every other shape as published):

1. this machine's float32 matmul throughput at the slice's shapes (one block's matrices and the LM head, a
   batch of ``--batch-size`` x ``--tokens`` rows, ``--threads`` threads): the ``--tflops`` the config-only
   plan is given, so its FLOP-count time is comparable with a CPU build;
2. ``gradindex plan`` of the config folder (config.json and a tokenizer, no weights: meta device, FLOP time);
3. the model with random weights from the config (float32, ``save_pretrained`` with the tokenizer), in its
   own process; ``gradindex plan`` of that folder (with weights: a few real capture batches timed);
4. the default ``gradindex build`` of it on ``--examples`` local records of about ``--tokens`` tokens
   (``--max-length --tokens``) under ``/usr/bin/time -v`` (wall, CPU seconds, peak RSS), the index folder's
   size polled for its peak, then its final size; each stage's seconds from the build's progress lines;
5. per layer: the stored numbers and bytes per example the plan gives against the built shards (dataset
   shapes and HDF5 storage), and for the whole build: disk final / peak, host RAM, time, as ratios plan / build.

Also the config-only plan's own wall time and peak RSS for the full Llama-3-8B, Llama-3-70B and Mixtral-8x7B
configs (100,000 examples of 512 tokens, ``--dtype bfloat16``; the <= 30 s, <= 2 GB target).

    OMP_NUM_THREADS=2 python -m benchmarks.plan_slice --out benchmarks/results/plan_slice.json

Big model folders go under ``--work`` (default /work/tmp/plan-slice) and are deleted at the end unless
``--keep``. A model whose float32 slice would exceed ``--max-model-gb`` is skipped with the reason recorded
(``--fallback-layers N``: cut it to N blocks instead, the reason recorded beside the figures).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "plan_slice.json"
FULL = ("llama-3-8b", "llama-3-70b", "mixtral-8x7b")
STAGES = ("capture", "store pass (kfac)", "transcode", "fit sample")


def slice_config(name: str, layers: int, override: dict | None = None) -> dict:
    """``CONFIGS[name]`` cut to ``layers`` blocks (``override``: more fields, for a quick smoke run)."""
    from fixtures.configs import CONFIGS

    return {**CONFIGS[name], "num_hidden_layers": layers, **(override or {})}


def slice_params(c: dict) -> int:
    """Parameters of the sliced model (embeddings, head, blocks; norms ignored)."""
    h, inter, L, V = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    hd = h // c["num_attention_heads"]
    attn = h * c["num_attention_heads"] * hd * 2 + 2 * h * c["num_key_value_heads"] * hd
    experts = c.get("num_local_experts", 1)
    mlp = 3 * h * inter * experts + (h * experts if "num_local_experts" in c else 0)
    return V * h * (1 if c.get("tie_word_embeddings") else 2) + L * (attn + mlp)


# -- the local data and tokenizer ----------------------------------------------------------------------
def write_data(work: Path, examples: int, tokens: int) -> tuple[Path, Path]:
    """``(tokenizer folder, data.jsonl)``: a BPE tokenizer trained on standard-library docstrings and
    ``examples`` records of about ``tokens`` tokens (paragraphs joined, cut at ``tokens`` tokens)."""
    from fixtures.corpus import stdlib_paragraphs
    from fixtures.tiny import train_tokenizer

    tok_dir, data = work / "tokenizer", work / "data.jsonl"
    if data.exists() and (tok_dir / "tokenizer.json").exists():
        return tok_dir, data
    paras = stdlib_paragraphs()
    half = len(paras) // 2
    tok = train_tokenizer(paras[:half], vocab_size=2000)
    tok.save_pretrained(tok_dir)
    ids = tok(" ".join(paras[half:]))["input_ids"]
    if len(ids) < examples * tokens:
        raise ValueError(f"the corpus holds {len(ids):,} tokens, fewer than {examples} x {tokens}")
    with open(data, "w") as f:
        for i in range(examples):
            f.write(json.dumps({"text": tok.decode(ids[i * tokens:(i + 1) * tokens])}) + "\n")
    return tok_dir, data


# -- measurements ------------------------------------------------------------------------------------
def matmul_tflops(c: dict, rows: int, threads: int, repeats: int = 3) -> dict:
    """Float32 TFLOP/s of ``[rows, n_in] @ [n_in, n_out]`` at one block's matrices and the LM head, weighted
    by the FLOPs a token spends in each (the experts by their top-k share): the model pass's throughput."""
    import torch

    torch.set_num_threads(threads)
    h, inter, V = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    hd = h // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * hd
    share = c.get("num_experts_per_tok", 1)  # expert matrices a token goes through, per expert shape
    L = c["num_hidden_layers"]
    shapes = {"q/o": (h, h, 2 * L), "k/v": (h, kv, 2 * L), "mlp up/gate": (h, inter, 2 * L * share),
              "mlp down": (inter, h, L * share), "head": (h, V, 1)}
    g = torch.Generator().manual_seed(0)
    out, flops, secs = {}, 0.0, 0.0
    for name, (n_in, n_out, count) in shapes.items():
        x, w = torch.randn(rows, n_in, generator=g), torch.randn(n_in, n_out, generator=g)
        x @ w  # warm-up
        t = time.perf_counter()
        for _ in range(repeats):
            x @ w
        s = (time.perf_counter() - t) / repeats
        f = 2 * rows * n_in * n_out
        out[name] = round(f / s / 1e12, 4)
        flops, secs = flops + count * f, secs + count * s
        del x, w
    return {"per_shape_tflops": out, "weighted_tflops": round(flops / secs / 1e12, 4), "rows": rows,
            "threads": threads}


def timed(cmd: list[str], log: Path, env: dict | None = None, poll: Path | None = None) -> dict:
    """Run ``cmd`` under ``/usr/bin/time -v``: wall, CPU seconds, peak RSS (GB); with ``poll``, the folder's
    largest size seen (every 0.02 s) and its final size."""
    stop, seen = threading.Event(), [0]

    def watch():
        while not stop.wait(0.02):
            seen[0] = max(seen[0], tree_bytes(poll))

    th = threading.Thread(target=watch, daemon=True) if poll is not None else None
    if th:
        th.start()
    t0 = time.perf_counter()
    r = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", **(env or {})})
    wall = time.perf_counter() - t0
    if th:
        stop.set()
        th.join()
    log.write_text(r.stdout + "\n--- stderr ---\n" + r.stderr)
    if r.returncode:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed ({r.returncode}); see {log}:\n{r.stderr[-2000:]}")
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", r.stderr)
    cpu = sum(float(x) for x in re.findall(r"(?:User|System) time \(seconds\): ([\d.]+)", r.stderr))
    out = {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "peak_rss_gb": round(int(rss.group(1)) * 1024 / 1e9, 3),
           "stdout": r.stdout, "stderr": r.stderr}
    if poll is not None:
        final = tree_bytes(poll)
        out |= {"peak_disk_bytes": max(seen[0], final), "final_disk_bytes": final}
    return out


def tree_bytes(p: Path | None) -> int:
    """Apparent size of every file under ``p``."""
    total = 0
    for dirpath, _, files in os.walk(p or "."):
        for f in files:
            try:
                total += os.stat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass
    return total


def plan(model_dir: Path, data: Path, log: Path, threads: int, extra: list[str]) -> tuple[dict, dict]:
    """``gradindex plan MODEL_DIR DATA --json``: (the plan, its process's wall / CPU / peak RSS)."""
    r = timed([sys.executable, "-m", "gradindex", "plan", str(model_dir), str(data), "--json", *extra], log,
              {"OMP_NUM_THREADS": str(threads)})
    return json.loads(r["stdout"].strip().splitlines()[-1]), {k: r[k] for k in ("wall_s", "cpu_s", "peak_rss_gb")}


def stage_seconds(text: str) -> dict[str, float]:
    """Each stage's seconds from a build's progress lines (``NAME: n/n ex in X s``, the last of each)."""
    out = {}
    for line in re.split(r"[\r\n]", text):
        m = re.match(r"\s*(.+?): (\d+)/(\d+) ex in (?:(\d+) min )?([\d.]+) s", line)
        if m and m.group(2) == m.group(3):
            out[m.group(1)] = 60 * float(m.group(4) or 0) + float(m.group(5))
    return out


def built_layers(idx: Path) -> dict[str, dict]:
    """Layer → the stored numbers (the manifest's ``rows x cols``) and bytes per example of the built shards (the
    dataset's row, with its per-row float32 scale), and the HDF5 storage of its datasets."""
    import h5py
    import numpy as np

    m = json.loads((idx / "manifest.json").read_text())
    dims = {n: v["rows"] * v["cols"] for n, v in m["build"]["layers"].items()}  # (stored k_g x k_a)
    out: dict[str, dict] = {}
    for shard in sorted((idx / "store").glob("shard-*.h5")):
        with h5py.File(shard, "r") as f:
            n = int(f["ids"].shape[0])
            for name, ds in f["grads"].items():
                per = int(np.prod(ds.shape[1:])) * ds.dtype.itemsize
                scale = f["scales"][name].dtype.itemsize if "scales" in f and name in f["scales"] else 0
                row = out.setdefault(name, {"numbers": dims[name],
                                            "bytes_per_example": per + scale, "storage_bytes": 0, "examples": 0})
                row["storage_bytes"] += ds.id.get_storage_size() + (
                    f["scales"][name].id.get_storage_size() if scale else 0)
                row["examples"] += n
    return out


def ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def compare(cfg_plan: dict, w_plan: dict, build: dict, layers: dict, est_tflops: float) -> dict:
    """Plan / build ratios: per layer (numbers, bytes per example), disk final / peak, RAM, time."""
    from gradindex.store.codes import row_bytes

    per_layer = {}
    for lp in cfg_plan["layers"]:
        b = layers[lp["name"]]
        planned = row_bytes(cfg_plan["storage"], lp["numbers"])
        per_layer[lp["name"]] = {"shape": [lp["n_out"], lp["n_in"]], "stored": [lp["k_g"], lp["k_a"]],
                                 "numbers_plan": lp["numbers"], "numbers_built": b["numbers"],
                                 "bytes_plan": planned, "bytes_built": b["bytes_per_example"],
                                 "bytes_ratio": ratio(planned, b["bytes_per_example"]),
                                 "disk_per_example_built": round(b["storage_bytes"] / b["examples"], 1)}
    same = [x["name"] for x in cfg_plan["layers"]] == [x["name"] for x in w_plan["layers"]] and \
        all(a == b for a, b in zip(cfg_plan["layers"], w_plan["layers"], strict=True))
    stages = build["stages"]
    out = {"layers_same_as_weights_plan": same,
           "per_layer_bytes_ratio_range": [min(x["bytes_ratio"] for x in per_layer.values()),
                                           max(x["bytes_ratio"] for x in per_layer.values())],
           "per_layer_numbers_equal": all(x["numbers_plan"] == x["numbers_built"] for x in per_layer.values()),
           "per_example_bytes": {"plan": cfg_plan["bytes"]["per_example"],
                                 "built_rows": sum(x["bytes_per_example"] for x in layers.values())},
           "per_layer": per_layer}
    for who, p in (("config_only", cfg_plan), ("with_weights", w_plan)):
        secs = p["seconds"]
        total = sum(secs.values())
        out[who] = {
            "final_disk": ratio(p["bytes"]["final"], build["final_disk_bytes"]),
            "peak_disk": ratio(p["bytes"]["peak"], build["peak_disk_bytes"]),
            "ram": ratio(p["ram_bytes"], build["peak_rss_gb"] * 1e9),
            "time_vs_stages": ratio(total, sum(stages.values())),
            "time_vs_wall": ratio(total, build["wall_s"]),
            "capture_vs_capture": ratio(secs.get("capture", 0), stages.get("capture", 0)),
            "seconds_plan": {k: round(v, 2) for k, v in secs.items()}}
    out["config_only"]["tflops_given"] = est_tflops
    return out


def make_model(c: dict, tok_dir: Path, out: Path, log: Path) -> dict:
    """The sliced model with random weights (float32) saved with the tokenizer into ``out``, in its own process."""
    code = ("import json, sys, shutil, torch, transformers\n"
            "c = json.loads(sys.argv[1]); out = sys.argv[2]\n"
            "torch.manual_seed(0)\n"
            "cfg = transformers.AutoConfig.for_model(c.pop('model_type'), **{k: v for k, v in c.items()\n"
            "     if k not in ('architectures', 'torch_dtype')})\n"
            "cfg.architectures = c['architectures']\n"
            "model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)\n"
            "model.save_pretrained(out)\n"
            "transformers.AutoTokenizer.from_pretrained(sys.argv[3]).save_pretrained(out)\n")
    return {k: v for k, v in timed([sys.executable, "-c", code, json.dumps(c), str(out), str(tok_dir)], log,
                                   {"OMP_NUM_THREADS": "2"}).items() if k in ("wall_s", "cpu_s", "peak_rss_gb")}


def run_slice(name: str, args, tok_dir: Path, data: Path, override: dict | None = None) -> dict:
    work = args.work / name
    work.mkdir(parents=True, exist_ok=True)
    c = slice_config(name, args.layers, override)
    gb = 4 * slice_params(c) / 1e9
    res: dict = {"layers": args.layers, "float32_weights_gb": round(gb, 2)}
    if gb > args.max_model_gb:
        why = (f"the {args.layers}-layer slice's float32 weights alone are {gb:.1f} GB, more than --max-model-gb "
               f"{args.max_model_gb:g} (the machine's memory is shared)")
        if not args.fallback_layers:
            return {**res, "skipped": why}
        c = slice_config(name, args.fallback_layers, override)
        gb = 4 * slice_params(c) / 1e9
        res = {"layers": args.fallback_layers, "float32_weights_gb": round(gb, 2), "not_2_layers": why}
    opts = ["--max-length", str(args.tokens), "--batch-size", str(args.batch_size), "--device", "cpu"]
    res["matmul"] = mm = matmul_tflops(c, args.batch_size * args.tokens, args.threads)
    print(f"{name}: float32 matmul {mm['weighted_tflops'] * 1e3:.0f} GFLOP/s at {args.threads} threads "
          f"({mm['per_shape_tflops']})", flush=True)
    cfg_dir = work / "config-only"
    if cfg_dir.exists():
        shutil.rmtree(cfg_dir)
    shutil.copytree(tok_dir, cfg_dir)
    (cfg_dir / "config.json").write_text(json.dumps(c, indent=2))
    cfg_plan, res["config_only_plan"] = plan(cfg_dir, data, work / "plan-config.log", args.threads,
                                             [*opts, "--tflops", str(mm["weighted_tflops"])])
    print(f"{name}: config-only plan {res['config_only_plan']}", flush=True)
    model_dir, idx = work / "model", work / "idx"
    if not (model_dir / "config.json").exists():
        res["make_model"] = make_model(dict(c), tok_dir, model_dir, work / "make-model.log")
        print(f"{name}: model saved {res['make_model']}", flush=True)
    w_plan, res["weights_plan"] = plan(model_dir, data, work / "plan-weights.log", args.threads, opts)
    print(f"{name}: with-weights plan {res['weights_plan']}", flush=True)
    if idx.exists():
        shutil.rmtree(idx)
    load = os.getloadavg()
    b = timed([sys.executable, "-m", "gradindex", "build", str(model_dir), str(data), "--out", str(idx), *opts],
              work / "build.log", {"OMP_NUM_THREADS": str(args.threads)}, poll=idx)
    build = {k: b[k] for k in ("wall_s", "cpu_s", "peak_rss_gb", "peak_disk_bytes", "final_disk_bytes")}
    build["stages"] = stage_seconds(b["stderr"] + b["stdout"])
    build["load_before_after"] = [round(load[0], 2), round(os.getloadavg()[0], 2)]
    res["build"] = build
    print(f"{name}: build {build}", flush=True)
    layers = built_layers(idx)
    res["plans"] = {"config_only": {k: cfg_plan[k] for k in ("bytes", "ram_bytes", "seconds")},
                    "with_weights": {k: w_plan[k] for k in ("bytes", "ram_bytes", "seconds")},
                    "estimate": cfg_plan["estimate"]}
    res["ratios"] = compare(cfg_plan, w_plan, build, layers, mm["weighted_tflops"])
    r = res["ratios"]
    print(f"{name}: per layer bytes ratio {r['per_layer_bytes_ratio_range']}, numbers equal "
          f"{r['per_layer_numbers_equal']}; config-only {_short(r['config_only'])}; with weights "
          f"{_short(r['with_weights'])}", flush=True)
    if not args.keep:
        shutil.rmtree(model_dir, ignore_errors=True)
        shutil.rmtree(idx, ignore_errors=True)
    return res


def _short(r: dict) -> dict:
    return {k: v for k, v in r.items() if k not in ("seconds_plan",)}


def full_configs(args, data: Path) -> dict:
    """The config-only plan of the full configs: its process's wall time and peak RSS (<= 30 s, <= 2 GB)."""
    from fixtures.configs import config_dir

    many = args.work / "many.jsonl"
    many.write_text('{"text": "x"}\n' * 100_000)
    out = {}
    for name in FULL:
        d = config_dir(name, args.work / "full" / name)
        p, cost = plan(d, many, args.work / f"plan-full-{name}.log", 1,
                       ["--dtype", "bfloat16", "--tokens-per-example", "512"])
        out[name] = {**cost, "layers": len(p["layers"]), "final_disk_gib": round(p["bytes"]["final"] / 2**30, 2),
                     "peak_disk_gib": round(p["bytes"]["peak"] / 2**30, 2),
                     "host_ram_gib": round(p["ram_bytes"] / 2**30, 1),
                     "estimated_minutes": round(sum(p["seconds"].values()) / 60, 1),
                     "gpus": p["estimate"]["gpus"], "gpu_gib": round(p["estimate"]["gpu"]["total"] / 2**30, 1)}
        print(f"{name} (full config, 100,000 x 512 tokens, bfloat16): {out[name]}", flush=True)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="llama-3-8b,mixtral-8x7b")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--fallback-layers", type=int, default=0,
                    help="blocks to cut a model to when the --layers slice is over --max-model-gb (0: skip it)")
    ap.add_argument("--max-model-gb", type=float, default=8.0,
                    help="largest float32 slice built (the build holds it, the plan's timing holds it again)")
    ap.add_argument("--examples", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    ap.add_argument("--override", default="", help="JSON of config fields for every slice (a smoke run)")
    ap.add_argument("--no-full", action="store_true", help="skip the full configs' plan timings")
    ap.add_argument("--work", type=Path, default=Path("/work/tmp/plan-slice"))
    ap.add_argument("--keep", action="store_true", help="keep the model folders and indexes")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    tok_dir, data = write_data(args.work, args.examples, args.tokens)
    override = json.loads(args.override) if args.override else None
    load = os.getloadavg()
    res: dict = {"conditions": {
        "machine": f"{os.cpu_count()} cores, load {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} at the start "
                   "(shared with another engineer's processes)",
        "threads": args.threads, "examples": args.examples, "max_length": args.tokens,
        "batch_size": args.batch_size, "dtype": "float32", "device": "cpu",
        "data": f"{args.examples} records of standard-library docstrings, each about {args.tokens} tokens of a "
                "local 2,000-token BPE tokenizer",
        "build": "the default `gradindex build` (auto budget, EK-FAC, int4 rows transcoded in its eigenbasis, "
                 "the store index)", "override": override}}
    res["slices"] = {name: run_slice(name, args, tok_dir, data, override) for name in args.models.split(",") if name}
    if not args.no_full:
        res["full_configs"] = full_configs(args, data)
    load = os.getloadavg()
    res["conditions"]["load_at_end"] = [round(x, 2) for x in load]
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1) + "\n")
        print(f"wrote {args.out}")
    return res


if __name__ == "__main__":
    main()
