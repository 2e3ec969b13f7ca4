"""The reference score path: every method against dense float64 computations over the whole store."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest
import torch
from click.testing import CliRunner

from gradindex.capture import GradientCapture, ProjectedRows, ProjectionSpec, RowSpace
from gradindex.cli import main
from gradindex.data import load_records, tokenize_records
from gradindex.methods import DEFAULT_DAMPING
from gradindex.model import load_causal_lm
from gradindex.pipeline import BuildConfig, build_index
from gradindex.precondition import self_influence
from gradindex.precondition.files import precond_path
from gradindex.query.scores import score_matrix
from gradindex.spec.manifest import read_manifest
from gradindex.store import Store

N = 40




@pytest.fixture(scope="module")
def index(tmp_path_factory, gpt2_dir, text_jsonl):
    """Projected (6x5) store of every block linear, EK-FAC + K-FAC fitted by `gradindex build`."""
    out = tmp_path_factory.mktemp("scores") / "idx"
    args = [
        "build",
        str(gpt2_dir),
        str(text_jsonl),
        "--out",
        str(out),
        "--projection",
        "6x5",
        "--max-length",
        "48",
        "--shard-size",
        "16",
        "--precondition",
        "ekfac",
        "--transcode",
        "none",
        "--storage",
        "fp32",
        "--device",
        "cpu",
        "--quiet",
    ]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    return out


@pytest.fixture(scope="module")
def dense(index):
    """Stored rows [N, D] per layer, random queries [Q, D] per layer, dense H per method and layer."""
    with Store(index) as s:
        rows = {n: v.astype(np.float64) for n, v in s.read_rows(np.arange(N)).items()}
    g = np.random.default_rng(0)
    queries = {n: g.standard_normal((3, v.shape[1])) for n, v in rows.items()}
    H = {}
    for m in ("kfac", "ekfac"):
        with h5py.File(precond_path(index, m), "r") as f:
            for n in rows:
                L = f["layers"][n]
                Q = np.kron(L["Q_S"][:], L["Q_A"][:])
                lam = L["Lambda"][:].reshape(-1)
                H[m, n] = Q @ np.diag(lam + DEFAULT_DAMPING * lam.mean()) @ Q.T
    return rows, queries, H


def _cat(d: dict) -> np.ndarray:
    return np.concatenate(list(d.values()), axis=1)


def test_graddot_and_cosine_equal_dense_products(index, dense):
    rows, queries, _ = dense
    T, Q = _cat(rows), _cat(queries)
    np.testing.assert_allclose(score_matrix(index, queries, "graddot"), Q @ T.T, rtol=1e-10)
    cos = (Q / np.linalg.norm(Q, axis=1, keepdims=True)) @ (T / np.linalg.norm(T, axis=1, keepdims=True)).T
    np.testing.assert_allclose(score_matrix(index, queries, "cosine"), cos, rtol=1e-10)


@pytest.mark.parametrize("method", ["kfac", "ekfac"])
def test_influence_scores_equal_dense_inverse_products(index, dense, method):
    rows, queries, H = dense
    expect = sum(np.linalg.solve(H[method, n], queries[n].T).T @ rows[n].T for n in rows)
    np.testing.assert_allclose(score_matrix(index, queries, method), expect, rtol=1e-8)


@pytest.mark.parametrize("method", ["graddot", "kfac", "ekfac"])
def test_self_influence_equals_diagonal_of_score_matrix(index, dense, method):
    rows, _, _ = dense
    for damping in (0.1, 0.5):
        diag = np.diag(score_matrix(index, rows, method, damping=damping))
        np.testing.assert_allclose(self_influence(index, method, damping), diag, rtol=1e-8)


def test_selfnorm_divides_by_root_self_influence(index, dense):
    _, queries, _ = dense
    for m in ("graddot", "kfac", "ekfac"):
        expect = score_matrix(index, queries, m) / np.sqrt(self_influence(index, m))[None, :]
        np.testing.assert_allclose(score_matrix(index, queries, m + "-selfnorm"), expect, rtol=1e-10)
    with pytest.raises(ValueError, match="is not one of"):
        score_matrix(index, queries, "cosine-selfnorm")


def test_blocks_and_layer_subsets_change_nothing_but_the_sum(index, dense):
    rows, queries, H = dense
    layers = list(rows)[:3]
    whole = score_matrix(index, queries, "ekfac", layers=layers)
    np.testing.assert_allclose(
        score_matrix(index, queries, "ekfac", layers=layers, block=7), whole, rtol=1e-12
    )
    expect = sum(np.linalg.solve(H["ekfac", n], queries[n].T).T @ rows[n].T for n in layers)
    np.testing.assert_allclose(whole, expect, rtol=1e-8)
    sub = score_matrix(index, {n: queries[n] for n in layers}, "ekfac-selfnorm", layers=layers)
    np.testing.assert_allclose(
        sub, whole / np.sqrt(self_influence(index, "ekfac", layers=layers)), rtol=1e-10
    )
    with pytest.raises(ValueError, match="no rows for layers"):
        score_matrix(index, {n: queries[n] for n in layers}, "graddot")


def test_scores_of_real_query_gradients_rank_the_example_itself_first(index, gpt2_dir, text_jsonl):
    """Queries captured like the build (same projection) score their own training example highest."""
    m = read_manifest(index)
    model, tok = load_causal_lm(gpt2_dir, device="cpu")
    data = tokenize_records(load_records(text_jsonl), tok, 48)
    from gradindex.capture.batch import batch_gradients

    spec = ProjectionSpec(**{k: v for k, v in m["build"]["projection"].items() if k != "stream_version"})
    with GradientCapture(model, list(m["build"]["layers"]), ProjectedRows(RowSpace(spec))) as cap:
        q = batch_gradients(model, cap, data.input_ids[:4], data.labels[:4], tok.pad_token_id).grads
    s = score_matrix(index, q, "ekfac-selfnorm")
    assert (s.argmax(axis=1) == np.arange(4)).all()


def test_scores_are_invariant_to_scaling_the_loss(tmp_path, gpt2_dir, text_jsonl, monkeypatch):
    """Every per-token gradient scales by c: influence scores are unchanged; GradDot scales by c²."""
    small = tmp_path / "small.jsonl"
    small.write_text("".join(json.dumps(r) + "\n" for r in list(load_records(text_jsonl))[:12]))
    model, tok = load_causal_lm(gpt2_dir, device="cpu")
    data = tokenize_records(load_records(small), tok, 48)
    cfg = BuildConfig.raw(
        projection=ProjectionSpec.parse("6x5"), max_length=48, batch_size=4, precondition="ekfac"
    )
    original = GradientCapture.backward
    scores = {}
    for c in (1.0, 1000.0):
        monkeypatch.setattr(GradientCapture, "backward", lambda self, loss, c=c: original(self, loss * c))
        out = tmp_path / f"c{c:g}"
        build_index(model, tok, data, out, cfg, model_id=str(gpt2_dir), data_id=str(small), progress=False)
        with Store(out) as s:
            q = s.read_rows(np.arange(3))
        scores[c] = {m: score_matrix(out, q, m) for m in ("graddot", "kfac", "ekfac", "kfac-selfnorm")}
    for m, expect in (("graddot", 1e6), ("kfac", 1.0), ("ekfac", 1.0), ("kfac-selfnorm", 1.0)):
        np.testing.assert_allclose(scores[1000.0][m], expect * scores[1.0][m], rtol=1e-3, err_msg=m)


def test_gpu_and_cpu_scores_agree(index, dense):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    _, queries, _ = dense
    cpu = score_matrix(index, queries, "ekfac", device="cpu")
    gpu = score_matrix(index, queries, "ekfac", device="cuda")
    np.testing.assert_allclose(gpu, cpu, rtol=1e-4, atol=1e-4 * np.abs(cpu).max())
