"""``gradindex plan`` of a folder holding a config.json and no weights (the model on the meta device), and
``gradindex build`` refusing such a folder."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import transformers
from click.testing import CliRunner

from fixtures.configs import CONFIGS, PARAMETERS, config_dir
from fixtures.tiny import save_model_dir, tiny_llama
from gradindex.cli import main

ROOT = Path(__file__).resolve().parents[1]
OPTS = ["--max-length", "48", "--device", "cpu", "--shard-size", "16"]
RUNNER = """
import resource, sys, time
t = time.perf_counter()
from gradindex.cli import main
try:
    main(sys.argv[1:], standalone_mode=False)
finally:
    print(f"rss_mb={resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} "
          f"seconds={time.perf_counter() - t:.2f}", file=sys.stderr)
"""


def _weightless(src: Path, dst: Path) -> Path:
    """``src``'s files but its weights: config.json and the tokenizer."""
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    return dst


def _plan(model_dir, data, *args) -> dict:
    res = CliRunner().invoke(main, ["plan", str(model_dir), str(data), "--json", "--batches", "0", *OPTS, *args])
    assert res.exit_code == 0, res.output
    return json.loads(res.output.strip().splitlines()[-1])


def _mixtral_dir(tokenizer, path: Path) -> Path:
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64))
    return save_model_dir(model, tokenizer, path)


@pytest.mark.parametrize("arch", ["llama", "mixtral", "gpt2"])
def test_config_only_plan_sizes_what_the_weights_plan_sizes(arch, tokenizer, gpt2_dir, text_jsonl, tmp_path):
    """A 2-layer model with random weights, and the same folder without its weights: identical layers, stored
    sizes, disk and RAM figures (the config-only plan builds the model on the meta device)."""
    torch.manual_seed(0)
    real = {"gpt2": lambda: gpt2_dir,
            "llama": lambda: save_model_dir(tiny_llama(vocab_size=len(tokenizer), n_layer=2, hidden=64, n_head=4,
                                                       intermediate=96), tokenizer, tmp_path / "real"),
            "mixtral": lambda: _mixtral_dir(tokenizer, tmp_path / "real")}[arch]()
    bare = _weightless(real, tmp_path / "bare")
    for args in ([], ["--budget", "1/16", "--storage", "int8", "--transcode", "none"]):
        with_weights, config_only = _plan(real, text_jsonl, *args), _plan(bare, text_jsonl, *args)
        assert config_only["layers"] == with_weights["layers"]
        assert {k: v for k, v in config_only["bytes"].items() if k != "free"} == \
            {k: v for k, v in with_weights["bytes"].items() if k != "free"}
        assert config_only["ram_bytes"] == with_weights["ram_bytes"]
        assert config_only["lookup"] == with_weights["lookup"]
        est = config_only["estimate"]
        assert "estimate" not in with_weights and est["weights_loaded"] is False
        assert config_only["seconds"]["capture"] > 0 and est["gpus"] == 1
    if arch == "mixtral":
        assert sum(".experts." in x["name"] for x in config_only["layers"]) == 2 * 2 * 4  # layers x sides x experts


def test_config_only_plan_says_how_it_estimated(llama_dir, text_jsonl, tmp_path):
    bare = _weightless(llama_dir, tmp_path / "bare")
    res = CliRunner().invoke(main, ["plan", str(bare), str(text_jsonl), "--dtype", "bfloat16", *OPTS])
    assert res.exit_code == 0, res.output
    out = res.output
    assert "no weights were loaded" in out and "FLOP estimate" in out and "400 TFLOP/s per GPU (bfloat16)" in out
    assert "GPU memory of the capture (bfloat16" in out and "weights " in out and "activations " in out
    assert "full-space files (`gradindex precondition --space full`" in out and "GPUs assumed: 1 of 80 GB" in out
    assert "exact stage (`--rerank-full C`, full-space curvature read a layer at a time): weights " in out
    assert "fits one 80 GB GPU, room for " in out
    summary = out.strip().splitlines()[-1]
    assert summary.startswith("plan: 40 examples x 14 layers") and "as a FLOP estimate" in summary
    counted = _plan(bare, text_jsonl, "--tokens-per-example", "10", "--tflops", "1")
    assert counted["estimate"]["tflops_per_gpu"] == 1.0 and counted["examples"] == 40


def test_config_only_plan_needs_token_counts(tmp_path, text_jsonl):
    """No tokenizer in the folder and text data: a one-line error naming --tokens-per-example; pre-tokenized data
    needs none."""
    bare = config_dir("qwen2.5-0.5b", tmp_path / "qwen")
    res = CliRunner().invoke(main, ["plan", str(bare), str(text_jsonl)])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert "no weights and no tokenizer files" in res.output and "--tokens-per-example N" in res.output
    ids = tmp_path / "ids.jsonl"
    ids.write_text("".join(json.dumps({"input_ids": list(range(1, 20 + i))}) + "\n" for i in range(30)))
    plan = _plan(bare, ids, "--no-index")
    assert plan["examples"] == 30 and plan["estimate"]["batch_tokens"] == 8 * 48  # the longest, cut to --max-length


def test_tokens_per_example_is_for_a_weightless_folder(llama_dir, text_jsonl):
    res = CliRunner().invoke(main, ["plan", str(llama_dir), str(text_jsonl), "--tokens-per-example", "64", *OPTS])
    assert res.exit_code == 2 and "are for a MODEL_DIR without weights" in res.output, res.output


def test_build_refuses_a_weightless_folder(llama_dir, text_jsonl, tmp_path):
    bare = _weightless(llama_dir, tmp_path / "bare")
    out = tmp_path / "idx"
    res = CliRunner().invoke(main, ["build", str(bare), str(text_jsonl), "--out", str(out), "--quiet", *OPTS])
    assert res.exit_code == 2, (res.exit_code, res.output)
    errors = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(errors) == 1 and errors[0].startswith("Error: "), res.output
    assert "holds a config.json but no weights" in errors[0] and "`gradindex plan MODEL_DIR DATA`" in errors[0]
    assert not out.exists()  # nothing written


def check_exact_stage(c: dict, est: dict, name: str) -> None:
    """The exact stage's GPU memory against the config's shapes: one query's float32 ``M`` (a number per hooked
    weight, the q/k/v biases of Qwen2 included), the largest layer's ``Q_S``, ``Q_A``, ``Λ`` (kept at least, the
    cache budget otherwise), the weights and activations of the capture; fits one 80 GB GPU at 8B, not
    at 70B (the bfloat16 weights alone are 141 GB)."""
    from gradindex.precondition.preconditioner import CURVATURE_CACHE_BYTES

    h, inter, L = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    hd = h // c["num_attention_heads"]
    bias = int(c["model_type"] == "qwen2")
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    shapes = [(q, h + bias), (kv, h + bias), (kv, h + bias), (h, q), (inter, h), (inter, h), (h, inter)]
    largest = max(4 * (o * o + i * i + o * i) for o, i in shapes)
    x = est["exact_stage"]
    assert x["m"] == 4 * L * sum(o * i for o, i in shapes)
    assert x["largest_layer"] == largest and x["curvature"] == max(largest, CURVATURE_CACHE_BYTES)
    assert x["weights"] == est["gpu"]["weights"] and x["activations"] == est["gpu"]["activations"]
    total = x["weights"] + x["m"] + x["curvature"] + x["activations"] + x["hooks"]
    assert x["total"] == total and x["queries_per_gpu"] == max(0, (80 * 10**9 - total + x["m"]) // x["m"])
    if name == "llama-3-8b":
        assert x["fits_one_gpu"] and x["queries_per_gpu"] == 1 and total < 80 * 10**9 < est["full_space_bytes"]
    if name == "llama-3-70b":
        assert not x["fits_one_gpu"]


@pytest.fixture(scope="module")
def many_examples(tmp_path_factory) -> Path:
    """100,000 examples (only their count matters with --tokens-per-example)."""
    p = tmp_path_factory.mktemp("many") / "train.jsonl"
    p.write_text('{"text": "x"}\n' * 100_000)
    return p


@pytest.mark.parametrize("name", list(CONFIGS))
def test_plan_of_a_big_config_answers_in_seconds_and_little_memory(name, many_examples, tmp_path):
    """Llama-3-8B/70B, Qwen2.5-0.5B/7B/72B, Mixtral-8x7B from their config.json alone: under 30 s and 2 GB RSS
    (the process, imports included), every block's linears (and each expert's two matrices) hooked."""
    model_dir = config_dir(name, tmp_path / name)
    args = ["plan", str(model_dir), str(many_examples), "--dtype", "bfloat16", "--tokens-per-example", "512",
            "--json"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    t = time.perf_counter()
    res = subprocess.run([sys.executable, "-c", RUNNER, *args], capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=120)
    wall = time.perf_counter() - t
    assert res.returncode == 0, res.stderr
    rss = int(res.stderr.rsplit("rss_mb=", 1)[1].split()[0])
    assert wall < 30 and rss < 2048, (wall, rss)
    plan = json.loads(res.stdout.strip().splitlines()[-1])
    c, est = CONFIGS[name], plan["estimate"]
    experts = c.get("num_local_experts", 0)
    assert len(plan["layers"]) == c["num_hidden_layers"] * (4 + (2 * experts if experts else 3))
    assert est["gpu"]["weights"] == 2 * PARAMETERS[name]  # bfloat16
    assert plan["examples"] == 100_000 and plan["bytes"]["final"] > 0 and est["full_space_bytes"] > 0
    assert est["gpus"] == -(-est["gpu"]["total"] // est["gpu_bytes_each"])
    if not experts:
        check_exact_stage(c, est, name)
    print(f"{name}: {wall:.1f} s, {rss} MB RSS; {json.dumps({k: plan['bytes'][k] for k in ('peak', 'final')})}, "
          f"RAM {plan['ram_bytes']}, GPU {est['gpu']}, GPUs {est['gpus']}, full space {est['full_space_bytes']} "
          f"({est['full_space_gpus']} GPUs), seconds {plan['seconds']}")


@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_flop_model_counts_what_torch_counts_in_a_capture_batch(arch):
    """The config-only plan's capture FLOPs (model pass, hooks, experts' recomputed forward) against torch's
    FlopCounterMode over one real capture batch (eager experts: the counter does not see grouped_mm)."""
    import numpy as np
    from torch.utils.flop_counter import FlopCounterMode

    from gradindex.capture import GradientCapture, KfacSums, ProjectedRows, RowSpace
    from gradindex.capture.batch import batch_gradients
    from gradindex.capture.hooks import select_layers
    from gradindex.capture.layers import layer_info
    from gradindex.estimate import stage_flops
    from gradindex.plan import plan_build
    from gradindex.store.basis import RowBasis
    from gradindex.store.builder import BuildConfig
    from gradindex.store.sizing import sized_projection

    torch.manual_seed(0)
    shape = dict(vocab_size=1000, hidden_size=128, intermediate_size=352, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=256)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(num_hidden_layers=2, **shape)) if arch == "llama" \
        else transformers.MixtralForCausalLM(transformers.MixtralConfig(
            num_hidden_layers=1, num_local_experts=4, num_experts_per_tok=2, experts_implementation="eager", **shape))
    model.eval().requires_grad_(False)
    B, T = 4, 128
    cfg = BuildConfig(batch_size=B, max_length=T)
    plan = plan_build(model, cfg, 100_000)
    gpu, _ = stage_flops(model, cfg, plan, np.full(B, T))
    spec = sized_projection(cfg, {n: layer_info(m) for n, m in select_layers(model).items()}, RowBasis())
    ids = torch.randint(0, 1000, (B, T), generator=torch.Generator().manual_seed(1)).tolist()
    space = RowSpace(spec)
    with GradientCapture(model, cfg.layers, ProjectedRows(space, cfg.route), KfacSums(space)) as cap:
        batch_gradients(model, cap, ids, ids, 0)  # (the projection maps drawn)
        with FlopCounterMode(display=False) as counter:
            batch_gradients(model, cap, ids, ids, 0)
    assert 0.85 < gpu["capture"] / counter.get_total_flops() < 1.15, (gpu["capture"], counter.get_total_flops())
