"""The peers benchmark's harness (benchmarks/peers/run.py) on gradindex alone, at tiny sizes, no peer installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks.peers.run import spearman

ROOT = Path(__file__).resolve().parents[1]


def test_spearman_against_the_rank_difference_formula():
    rng = np.random.default_rng(0)
    a = rng.normal(size=50)
    assert spearman(a, np.exp(a)) == pytest.approx(1.0)
    assert spearman(a, -a) == pytest.approx(-1.0)
    b = rng.normal(size=50)
    d = np.argsort(np.argsort(a)) - np.argsort(np.argsort(b))
    assert spearman(a, b) == pytest.approx(1 - 6 * (d ** 2).sum() / (50 * (50 ** 2 - 1)))


def per_example_graddot(root: Path, bias: bool) -> np.ndarray:
    """``[Q, N]`` full-gradient dot products from plain autograd, one sequence at a time (summed token loss)."""
    from transformers import GPT2LMHeadModel
    from transformers.pytorch_utils import Conv1D

    model = GPT2LMHeadModel.from_pretrained(root / "model").eval()
    params = [p for n, m in model.named_modules() if isinstance(m, Conv1D) and ".h." in f".{n}."
              for p in ((m.weight, m.bias) if bias else (m.weight,))]

    def grad(ids: np.ndarray) -> torch.Tensor:
        x = torch.as_tensor(ids)[None]
        logits = model(input_ids=x).logits[0, :-1]
        loss = torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="sum")
        return torch.cat([g.flatten() for g in torch.autograd.grad(loss, params)]).double()

    train = torch.stack([grad(s) for s in np.load(root / "train.npy")])
    queries = torch.stack([grad(s) for s in np.load(root / "queries.npy")])
    return (queries @ train.T).numpy()


@pytest.mark.slow
def test_quick_run_writes_the_floor_and_gradindex_rows(tmp_path):
    keep = tmp_path / "work"
    cmd = [sys.executable, "-m", "benchmarks.peers.run", "--quick", "--peers", "gradindex",
           "--methods", "graddot-proj,graddot-full", "--venvs", str(tmp_path / "venvs"), "--out-dir", str(tmp_path),
           "--keep", str(keep)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp_path / "peers.json").read_text())
    s = res["summary"]
    assert len(s["floor_runs"]) == 2 and all(x > 0 for x in s["floor_runs"])  # first and last
    assert s["floor_seconds"] == pytest.approx(np.mean(s["floor_runs"]))
    rows = {r["method"]: r for r in s["rows"]}
    assert set(rows) == {"graddot-proj", "graddot-full"} and {r["library"] for r in s["rows"]} == {"gradindex"}
    n = res["workload"]["train"]
    for r in rows.values():  # each figure is what its raw timings say
        assert r["ok"], r["why"]
        q = r["query_s"]
        assert set(q) == {"4", "1"} and all(v > 0 for v in q.values())
        assert r["total_s"] == pytest.approx(r["build_s"] + q["4"])
        assert r["sequences_per_s"] == pytest.approx(n / r["total_s"])
        assert r["ratio_to_floor"] == pytest.approx(r["total_s"] / s["floor_seconds"])
        assert r["rss_peak_mb"] >= r["rss_loaded_mb"] > 100
    proj = rows["graddot-proj"]["spearman_vs_gradindex_full"]
    assert proj is not None and -1 <= proj["min"] <= proj["mean"] <= 1
    assert res["install"]["gradindex"]["ok"]

    # the full-gradient GradDot every peer is compared with, against plain autograd (with and without bias)
    run = next(keep.glob("runs/*-gradindex-graddot-full"))
    for name, bias in (("scores_4.npy", True), ("scores_4-nobias.npy", False)):
        ours, ref = np.load(run / name), per_example_graddot(keep / "workload", bias)
        assert np.abs(ours - ref).max() <= 1e-4 * np.abs(ref).max(), name

    md = (tmp_path / "peers.md").read_text()
    for r in rows.values():
        assert f"| gradindex | {r['method']} | {r['build_s']:.1f} |" in md and f"| {r['total_s']:.1f} |" in md
    assert "Floor (bare forward + backward)" in md
    assert (tmp_path / "peers.png").stat().st_size > 1000


def test_dattri_logra_keeps_its_batch_metadata_out_of_the_working_directory(tmp_path, monkeypatch):
    """dattri's LoGra writes ``batch_metadata.json`` into ``cache_dir``, the working directory when none is
    given (dattri 0.3's ``MetadataManager(cache_dir or ".")``); a stand-in with that behaviour shows where."""
    import importlib
    import types

    from benchmarks.peers.common import Clock, Workload
    from fixtures.tiny import tiny_gpt2

    seen = {}

    class LoGraAttributor:
        def __init__(self, task, layer_names, hessian, device, proj_dim, offload, cache_dir=None):
            self.dir = Path(cache_dir or ".")

        def cache(self, train):
            seen["n"] = sum(len(b["input_ids"]) for b in train)
            (self.dir / "batch_metadata.json").write_text("{}")
            seen["written"] = (self.dir / "batch_metadata.json").resolve()

        def attribute(self, train, test):
            return torch.zeros(seen["n"], sum(len(b["input_ids"]) for b in test))

    fake = {"dattri": types.ModuleType("dattri"), "dattri.algorithm": types.ModuleType("dattri.algorithm"),
            "dattri.algorithm.logra": types.SimpleNamespace(LoGraAttributor=LoGraAttributor),
            "dattri.task": types.SimpleNamespace(AttributionTask=lambda **kw: kw)}
    for name, mod in fake.items():
        monkeypatch.setitem(sys.modules, name, mod)
    adapter = importlib.import_module("benchmarks.peers.adapters.dattri")
    ids = torch.randint(64, (6, 8), generator=torch.Generator().manual_seed(0))
    w = Workload(tiny_gpt2(vocab_size=64, n_layer=1, n_embd=16, n_head=2), ids, ids[:2], {"batch_size": 4}, tmp_path)
    monkeypatch.chdir(tmp_path)
    out = adapter.METHODS["graddot-proj"](w, [2, 1], Clock())
    assert {k: v.shape for k, v in out.items()} == {2: (2, 6), 1: (1, 6)}
    assert list(tmp_path.iterdir()) == [] and not seen["written"].exists()  # written in a temp dir, removed
