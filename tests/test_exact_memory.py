"""The exact stage's memory (issue 30 item 3): the full-space curvature streamed from its file a layer at a time
under a byte budget, ``M`` formed a layer at a time in the query's backward hook, no stacked copy; the same scores
as every layer resident (the old path: ``G_q`` whole, ``M = (H + δI)⁻¹ G_q``, dense candidate gradients), and the
curvature held at once measured within the budget in a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import gradindex.query.full as F
from fixtures.tiny import save_model_dir, tiny_gpt2
from gradindex.capture import ProjectionSpec
from gradindex.data import load_records, tokenize_records
from gradindex.model import load_causal_lm
from gradindex.pipeline import BuildConfig, build_index
from gradindex.precondition import load_full_preconditioner
from gradindex.precondition.apply import damped
from gradindex.precondition.preconditioner import Preconditioner
from gradindex.query import QueryEngine

ROOT = Path(__file__).resolve().parents[1]
DAMPING = 0.1


def _build(model_dir: Path, text_jsonl: Path, out: Path) -> Path:
    """A budget-bound index (1/64, EK-FAC) with the exact stage's full-space fit (``rerank_fit``)."""
    model, tok = load_causal_lm(model_dir, device="cpu")
    data = tokenize_records(load_records(text_jsonl), tok, 64)
    cfg = BuildConfig(projection=ProjectionSpec(), budget="1/64", precondition="ekfac", damping=DAMPING,
                      shard_size=64, max_length=64, rerank_fit=True)
    build_index(model, tok, data, out, cfg, model_id=str(model_dir), data_id=str(text_jsonl), progress=False)
    from gradindex.index import build_indices

    build_indices(out, progress=False)
    return out


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def built(request, tmp_path_factory, text_jsonl):
    model_dir = request.getfixturevalue(f"{request.param}_dir")
    out = _build(model_dir, text_jsonl, tmp_path_factory.mktemp(request.param) / "idx")
    model, tok = load_causal_lm(model_dir, device="cpu")
    model.requires_grad_(False)
    return out, model, tok, tokenize_records(load_records(text_jsonl), tok, 64)


def curvature_bytes(pre: Preconditioner) -> tuple[int, int]:
    """``(every layer's, the largest layer's)`` float32 bytes of ``Q_S``, ``Q_A``, ``Λ``."""
    sizes = [4 * (r * r + c * c + r * c) for r, c in pre.shapes.values()]
    return sum(sizes), max(sizes)


def resident_scores(model, layers, query, train, pad_id, method: str, pre: Preconditioner) -> np.ndarray:
    """The old all-resident path, written out: the whole ``G_q``, ``M = (H + δI)⁻¹ G_q`` per layer, each
    candidate's dense gradient dotted with it; ``-selfnorm``: ``Σ (Q_Sᵀ G Q_A)² / (Λ + δ)``."""
    base, selfnorm = method.split("-")[0], method.endswith("-selfnorm")
    Gq = F.full_query_gradient(model, layers, query, pad_id)
    fitted = base in ("kfac", "ekfac")
    M = {n: pre.apply(n, G.reshape(1, -1), -1.0, DAMPING).reshape(G.shape) if fitted else G for n, G in Gq.items()}
    out = []
    for ids, labels in zip(*train, strict=True):
        Gt = F.full_query_gradient(model, layers, (ids, labels), pad_id)
        dot = sum(float((M[n].double() * Gt[n].double()).sum()) for n in layers)
        if selfnorm:
            sq = 0.0
            for n in layers:
                Q_S, Q_A, Lam = (torch.as_tensor(pre.curvature[n][k]).double() for k in ("Q_S", "Q_A", "Lambda"))
                sq += float(((Q_S.T @ Gt[n].double() @ Q_A).square() * damped(Lam, pre.delta(n, DAMPING), -1)).sum())
            dot = dot / np.sqrt(sq) if sq > 0 else 0.0
        out.append(dot)
    return np.array(out)


@pytest.mark.parametrize("method", ["ekfac", "ekfac-selfnorm", "kfac-selfnorm", "graddot"])
def test_streamed_scores_equal_the_all_resident_path(built, method):
    """A budget of a third of the layers' curvature: never more than the budget held, layers read again on every
    candidate pass of ``-selfnorm`` (not every layer kept), and the scores of every layer resident, to float32
    round-off."""
    idx, model, tok, data = built
    base = method.split("-")[0]
    resident = load_full_preconditioner(idx, base, cache_bytes=None)
    resident = Preconditioner(base, resident.shapes, {n: resident.curvature[n] for n in resident.layers}
                              if not resident.is_identity else None)
    layers = resident.layers
    total, largest = curvature_bytes(resident)
    budget = max(largest, total // 3)
    streamed = load_full_preconditioner(idx, base, cache_bytes=budget)
    query = (data.input_ids[5], data.labels[5])
    rows = np.array([0, 3, 7, 11, 19, 23, 31, 37])
    train = ([data.input_ids[i] for i in rows], [data.labels[i] for i in rows])
    got = F.full_scores_batch(model, layers, [query], (data.input_ids, data.labels), [rows], tok.pad_token_id,
                              method, 3, streamed, DAMPING)[0]
    want = resident_scores(model, layers, query, train, tok.pad_token_id, method, resident)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
    if base != "graddot":
        assert streamed.cache.peak <= budget < total and streamed.cache.held <= budget
        if method.endswith("-selfnorm"):  # (the candidates' norms read layers again on every pass)
            assert streamed.cache.made > len(layers)
        else:  # (only the query's M: each layer read once)
            assert streamed.cache.made == len(layers)


def test_engine_budget_gives_the_same_hits(built):
    """``QueryEngine.curvature_cache_bytes``: a budget of one layer answers what every layer kept answers."""
    idx = built[0]
    with QueryEngine(idx, device="cpu") as e:
        e.curvature_cache_bytes = None
        whole = e.query("the cat sat on a mat", k=8, method="ekfac-selfnorm", damping=DAMPING, rerank_full=8)
        e.curvature_cache_bytes = 1
        small = e.query("the cat sat on a mat", k=8, method="ekfac-selfnorm", damping=DAMPING, rerank_full=8)
        assert e.full_preconditioner("ekfac").cache.held == 0
    assert [h.id for h in small.hits] == [h.id for h in whole.hits]
    np.testing.assert_allclose([h.full_score for h in small.hits], [h.full_score for h in whole.hits], rtol=1e-5)


CHILD = """
import json, sys, tracemalloc
import numpy as np, torch
torch.set_num_threads(1)
import gradindex.query.full as F
from gradindex.data import load_records, tokenize_records
from gradindex.model import load_causal_lm
from gradindex.precondition import load_full_preconditioner

idx, model_dir, data_path, budget = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
model, tok = load_causal_lm(model_dir, device="cpu")
model.requires_grad_(False)
data = tokenize_records(load_records(data_path), tok, 64)
pre = load_full_preconditioner(idx, "ekfac", cache_bytes=budget or None)
rows = np.arange(12)
tracemalloc.start()
base = tracemalloc.get_traced_memory()[0]
F.full_scores_batch(model, pre.layers, [(data.input_ids[2], data.labels[2])], (data.input_ids, data.labels), [rows],
                    tok.pad_token_id, "ekfac-selfnorm", 4, pre, 0.1)
peak = tracemalloc.get_traced_memory()[1] - base
print(json.dumps({"peak": peak, "cache_peak": pre.cache.peak, "made": pre.cache.made}))
"""


def _traced(idx: Path, model_dir: Path, data: Path, budget: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}
    res = subprocess.run([sys.executable, "-c", CHILD, str(idx), str(model_dir), str(data), str(budget)],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_curvature_held_at_once_stays_within_the_budget(tmp_path, tokenizer, text_jsonl):
    """A wider GPT-2 (2 blocks of width 128: 7.6 MB of full-space curvature), an ``ekfac-selfnorm`` exact stage in
    a fresh process under tracemalloc (the curvature is read into numpy arrays, which it traces; the model's and
    the hooks' torch tensors it does not): every layer resident, the peak holds all of it; under a budget of
    3 MB, at most the budget plus 1 MB of Python's own allocations."""
    torch.manual_seed(0)
    model_dir = save_model_dir(tiny_gpt2(vocab_size=len(tokenizer), n_layer=2, n_embd=128, n_head=4), tokenizer,
                               tmp_path / "model")
    idx = _build(model_dir, text_jsonl, tmp_path / "idx")
    total, largest = curvature_bytes(load_full_preconditioner(idx, "ekfac"))
    budget = 3 << 20
    assert largest < budget < total / 2
    every, streamed = _traced(idx, model_dir, text_jsonl, 0), _traced(idx, model_dir, text_jsonl, budget)
    print(f"curvature {total} B (largest layer {largest}); traced peak: all resident {every}, budget {budget}: "
          f"{streamed}")
    assert every["peak"] >= total and every["cache_peak"] == total
    assert streamed["cache_peak"] <= budget and streamed["peak"] <= budget + (1 << 20)


def test_the_plans_exact_stage_flops_are_what_torch_counts(built):
    """``gradindex plan``'s exact-stage time is :func:`gradindex.estimate.exact_stage_flops` at a rate: its count
    within 15% of torch's FlopCounterMode over a real self-normalized exact stage (one query, candidates of their
    own lengths, one a batch so that nothing is padded)."""
    from torch.utils.flop_counter import FlopCounterMode

    from gradindex.estimate import exact_stage_flops
    from gradindex.plan import hooked_layers

    idx, model, tok, data = built
    pre = load_full_preconditioner(idx, "ekfac")
    query = (data.input_ids[5], data.labels[5])
    rows = np.array([0, 3, 7, 11])
    with FlopCounterMode(display=False) as counter:
        F.full_scores_batch(model, pre.layers, [query], (data.input_ids, data.labels), [rows], tok.pad_token_id,
                            "ekfac-selfnorm", 1, pre, DAMPING)
    cfg = BuildConfig(max_length=64, layers=tuple(pre.layers))
    plan_layers = [lp for lp in hooked_layers(model, cfg) if lp.name in pre.layers]
    assert len(plan_layers) == len(pre.layers)
    t_q = len(query[0])
    want = sum(exact_stage_flops(model, cfg, plan_layers, t_q, [len(data.input_ids[i]) for i in rows]).values())
    assert 0.85 < want / counter.get_total_flops() < 1.15, (want, counter.get_total_flops())
