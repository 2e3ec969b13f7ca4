"""The capture benchmark runs end to end at tiny sizes and writes the figures it promises."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gradindex.capture.routing import choose_route

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_capture_benchmark_quick_mode_writes_every_figure(tmp_path):
    out = tmp_path / "capture.json"
    cmd = [sys.executable, "-m", "benchmarks.capture", "--quick", "--sequences", "16",
           "--seq-len", "16", "--sweep-lengths", "8,32", "--sweep-projections", "4x4", "--sweep-tokens", "64",
           "--out", str(out)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    c = res["compare"]
    assert set(c["sequences_per_s"]) == {"floor", "build", "capture", "naive_torch_func"}
    assert all(v > 0 for v in c["sequences_per_s"].values())
    best, t2 = c["best_seconds"], c["two_threads"]
    for k, secs in c["seconds"].items():  # each figure is what its raw timings say
        assert best[k] == min(secs) and c["sequences_per_s"][k] == pytest.approx(16 / best[k])
        assert c["ratio_to_floor"][k] == pytest.approx(best[k] / best["floor"])
    assert t2["speedup"]["build"] == pytest.approx(best["build"] / min(t2["seconds"]["build"]))
    assert [r["seq_len"] for r in res["sweep"]] == [8, 32]
    for r in res["sweep"]:
        assert set(r["capture_seq_per_s"]) == {"auto", "factorized", "materialized"}
        assert set(r["routes_chosen"]) <= {"factorized", "materialized"} and sum(r["routes_chosen"].values()) > 0
        for name, layer in r["layers"].items():  # the recorded choice is the cost model's, the fastest is timed
            B, T, n_in, n_out = layer["shape"]
            assert layer["choice"] == choose_route(B, T, n_in, n_out, 4, 4), name
            assert layer["faster"] == min(layer["seconds"], key=layer["seconds"].get)
        assert r["auto_over_best"] == pytest.approx(r["math_ms"]["auto"] / r["math_ms"]["best_per_layer"])
        assert (r["auto_over_best"] > 1.0) == bool(r["layers_misrouted"])
    assert "floor" in proc.stdout and "routing sweep" in proc.stdout


@pytest.mark.slow
def test_selection_benchmark_quick_mode_writes_its_table_and_plot(tmp_path):
    out, png = tmp_path / "selection.json", tmp_path / "selection.png"
    cmd = [sys.executable, "-m", "benchmarks.selection", "--quick", "--out", str(out), "--plot", str(png)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert set(res["overhead"]["overhead"]) == {"keep_all", "top_25%"} and png.stat().st_size > 0
    sel = res["selection"]
    assert set(sel["table"]) == {"selected", "selected_plain", "all", "random"}
    for arm, runs in sel["runs"].items():
        assert len(runs) == 2 and sel["table"][arm]["target_loss"]["values"] == [r["target_loss"] for r in runs]
        kept = 16 * 6 if arm == "all" else 4 * 6  # 16 candidates per step, 6 steps, 25% kept
        assert all(r["examples_trained"] == kept for r in runs), arm


@pytest.mark.slow
def test_gpu_check_dry_run_runs_every_step_on_the_cpu(tmp_path):
    """benchmarks/gpu_check.sh --dry-run: the same steps on a tiny config on the CPU, so the GPU script cannot rot."""
    out = tmp_path / "gpu.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
           "PYTHON": sys.executable}
    proc = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--dry-run", "--out", str(out)], capture_output=True,
                          text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["dry_run"] and res["device"] == "cpu"
    assert res["rows"]["dev_fp32"]["rel_err_max"] < 1e-5  # the same device twice: the same rows
    assert res["rows"]["dev_bf16"]["cosine_min"] > 0.98
    for dtype in ("float32", "bfloat16"):
        assert res["default_build"][dtype]["examples_per_second"] > 0
        assert res["throughput"][dtype]["capture_tokens_per_second"] > 0
        assert res["smollm2_shape"]["default_build"][dtype]["examples_per_second"] > 0  # the Llama shape too
    import shutil

    if shutil.which("nvidia-smi") is None:  # without a GPU the real run refuses at once, naming --dry-run
        no_gpu = subprocess.run(["bash", "benchmarks/gpu_check.sh"], capture_output=True, text=True, timeout=60,
                                cwd=ROOT, env=env)
        assert no_gpu.returncode == 2 and "--dry-run" in no_gpu.stderr


@pytest.mark.slow
def test_lookup_scale_builds_then_measures_against_an_independent_exact_scan(tmp_path):
    """The 10^6 lookup benchmark's two steps at 300 examples (sketch tier forced): the recall it reports is
    recomputed here from a brute-force float64 scan of the decoded store and the engine's own answers."""
    import numpy as np
    import torch

    from benchmarks import lookup_scale as L
    from gradindex.index import OpenIndex, query_vectors
    from gradindex.methods import parse_method, row_base
    from gradindex.query import QueryEngine
    from gradindex.spec.manifest import row_basis
    from gradindex.store.rows import RowReader

    out = tmp_path / "scale.json"
    L.main(["--build", "300", "--measure", "300", "--work", str(tmp_path), "--train-steps", "5",
            "--queries", "4", "--index-type", "sketch", "--out", str(out)])
    r = json.loads(out.read_text())["runs"][0]
    assert r["examples"] == 300 and r["index_kind"] == "sketch" and r["queries"] == 4
    assert 0 < r["search"]["p50_s"] <= r["search"]["p95_s"] and r["peak_rss_bytes"] > 0
    assert set(r["first_stage_recall"]) == {"50", "100", "200", "500"}
    z = np.load(tmp_path / "truth-300.npz")
    q = {k[2:]: z[k] for k in z.files if k.startswith("q:")}
    with OpenIndex(tmp_path / "idx-300") as ix:  # the index's rows, decoded: their inner products with the query
        rows = RowReader(ix.store, ix.layers).read(np.arange(300))
        with QueryEngine(tmp_path / "idx-300", load_model=False) as e:
            method = e.resolve_method(None)
            base = row_base(parse_method(method)[0], row_basis(e.manifest), method)
            m, _, _ = query_vectors(e.indices.space, e.pre, base, 1e-3, {n: torch.from_numpy(v) for n, v in q.items()})
            hits = [{h.id for h in res.hits} for res in e.search(q, k=10, texts=False)]
            si = e.index.self_influence(base, 1e-3, ix.layers) if parse_method(method)[1] else None  # (-selfnorm)
    brute = sum(np.asarray(m[n], np.float64) @ np.asarray(rows[n], np.float64).T for n in ix.layers)
    if si is not None:
        brute = brute / np.sqrt(si)[None, :]
    top = np.argsort(-brute, axis=1, kind="stable")[:, :10]
    assert (top == z["ids"][:, :10]).mean() == 1.0  # the benchmark's truth is the exhaustive scan's
    recall = np.mean([len(hits[j] & set(top[j].tolist())) / 10 for j in range(4)])
    assert r["search"]["recall@10"] == pytest.approx(recall, abs=0.1)


def test_ivf_assign_benchmark_one_process_then_two_ranks_agree(tmp_path):
    """benchmarks/ivf_assign.py: the pass shared by 2 gloo ranks gives the one process's lists, means and tops."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    args = ["-m", "benchmarks.ivf_assign", "--examples", "3000", "--numbers", "64", "--work", str(tmp_path / "w"),
            "--out", str(tmp_path / "r.json"), "--block-bytes", str(4 * 64 * 250)]  # (12 blocks of 250)
    for cmd in ([sys.executable], [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                                   "2"]):
        r = subprocess.run([*cmd, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
    runs = json.loads((tmp_path / "r.json").read_text())["runs"]
    assert [r["ranks"] for r in runs] == [1, 2] and runs[1]["equal_to_one_process"] is True, runs
