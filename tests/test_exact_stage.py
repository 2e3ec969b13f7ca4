"""The exact stage over a batch of queries (issue 30, item 3): the union of the queries' candidates is
recomputed once, one forward + backward per batch of it, every candidate scored against every query's
full-space matrix; the scores and order equal those of one query at a time (GPT-2 and Llama from configs)."""

from __future__ import annotations

import numpy as np
import pytest

import gradindex.query.full as F
from gradindex.capture import ProjectionSpec
from gradindex.data import load_records, tokenize_records
from gradindex.index import IndexConfig, build_indices
from gradindex.model import load_causal_lm
from gradindex.pipeline import BuildConfig, build_index
from gradindex.precondition import load_full_preconditioner
from gradindex.query import QueryEngine

DAMPING = 0.1
C = 20
QUERIES = ["the cat sat on a mat", "a dog ran in the park and the cat sat", "on the mat sat a small dog"]


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def built(request, tmp_path_factory, text_jsonl):
    """A budget-bound index (1/64 of the gradient, EK-FAC, int4 in its eigenbasis) with the exact stage's
    full-space fit made by the build (``rerank_fit``), and the model it was built from."""
    model_dir = request.getfixturevalue(f"{request.param}_dir")
    out = tmp_path_factory.mktemp(request.param) / "idx"
    model, tok = load_causal_lm(model_dir, device="cpu")
    data = tokenize_records(load_records(text_jsonl), tok, 64)
    cfg = BuildConfig(projection=ProjectionSpec(), budget="1/64", precondition="ekfac", damping=DAMPING,
                      shard_size=64, max_length=64, rerank_fit=True)
    build_index(model, tok, data, out, cfg, model_id=str(model_dir), data_id=str(text_jsonl), progress=False)
    build_indices(out, IndexConfig(), progress=False)
    return out, model, tok, data


def count_examples(monkeypatch) -> list[int]:
    """Examples per forward + backward of :mod:`gradindex.query.full` from now on (queries' and candidates')."""
    calls: list[int] = []
    real = F.batch_gradients

    def counting(model, cap, ids, *a, **k):
        calls.append(len(ids))
        return real(model, cap, ids, *a, **k)

    monkeypatch.setattr(F, "batch_gradients", counting)
    return calls


def _close(a: float, b: float, scale: float) -> bool:
    return abs(a - b) <= 1e-5 * max(abs(b), 1e-3 * scale)


@pytest.mark.parametrize("method", ["ekfac", "ekfac-selfnorm"])
def test_batch_equals_one_query_at_a_time_with_the_union_computed_once(built, method, monkeypatch):
    idx = built[0]
    calls = count_examples(monkeypatch)
    with QueryEngine(idx, device="cpu") as e:
        one = [e.query(q, k=C, method=method, damping=DAMPING, rerank_full=C) for q in QUERIES]
        alone = sum(calls)
        calls.clear()
        batch = e.query_batch(QUERIES, k=C, method=method, damping=DAMPING, rerank_full=C)
    heads = [{h.id for h in r.hits} for r in one]
    union = set().union(*heads)
    assert alone == len(QUERIES) * (1 + C) and sum(calls) == len(QUERIES) + len(union) < alone
    scale = max(abs(h.full_score) for r in one for h in r.hits)
    for a, b in zip(batch, one, strict=True):
        assert [h.id for h in a.hits] == [h.id for h in b.hits]  # same order
        assert all(_close(x.full_score, y.full_score, scale) for x, y in zip(a.hits, b.hits, strict=True))
        assert np.allclose([h.score for h in a.hits], [h.score for h in b.hits], rtol=1e-5)  # (padded query batch)
        assert a.stage == b.stage == f"full-space re-rank of the top {C}"
        assert any(f"exact stage: {len(union)} candidates re-scored in full space in" in n for n in a.notes)


def test_queries_in_chunks_give_the_same_scores(built, monkeypatch):
    """Past :data:`QUERY_CHUNK_BYTES` of query matrices the queries go in chunks, a pass over each chunk's union."""
    idx = built[0]
    with QueryEngine(idx, device="cpu") as e:
        whole = e.query_batch(QUERIES, k=C, damping=DAMPING, rerank_full=C)
        calls = count_examples(monkeypatch)
        monkeypatch.setattr(F, "QUERY_CHUNK_BYTES", 1)  # one query a chunk
        chunked = e.query_batch(QUERIES, k=C, damping=DAMPING, rerank_full=C)
    assert sum(calls) == len(QUERIES) * (1 + C)
    for a, b in zip(chunked, whole, strict=True):
        assert [h.id for h in a.hits] == [h.id for h in b.hits]
        assert np.allclose([h.full_score for h in a.hits], [h.full_score for h in b.hits], rtol=1e-5, atol=0)


@pytest.mark.parametrize("method", ["graddot", "cosine", "graddot-selfnorm", "ekfac", "ekfac-selfnorm", "kfac"])
def test_full_scores_batch_equals_full_gradient_scores_per_query(built, method):
    """Each query's own candidates (overlapping, in any order) against one union: the scores of a pass per query."""
    idx, model, tok, data = built
    base = method.split("-")[0]
    pre = load_full_preconditioner(idx, base)
    layers = list(pre.layers)
    queries = [data.input_ids[i] for i in (3, 11, 29)]
    queries = [(x, list(x)) for x in queries]
    rng = np.random.default_rng(0)
    wanted = [rng.choice(40, size=12, replace=False) for _ in queries]
    model.requires_grad_(False)
    got = F.full_scores_batch(model, layers, queries, (data.input_ids, data.labels), wanted, tok.pad_token_id,
                              method, 8, pre, DAMPING)
    for q, w, g in zip(queries, wanted, got, strict=True):
        train = ([data.input_ids[i] for i in w], [data.labels[i] for i in w])
        want = F.full_gradient_scores(model, layers, q, train, tok.pad_token_id, method, 8, pre, DAMPING)
        assert g.shape == want.shape
        np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_refined_queries_batch_as_one_at_a_time(built):
    """``refine``: each query's refined full-space matrix scores the union (the same as one query at a time)."""
    from gradindex.query.refine import RefineConfig

    idx = built[0]
    cfg = RefineConfig(steps=1, sample=8)
    with QueryEngine(idx, device="cpu") as e:
        one = [e.query(q, k=5, damping=DAMPING, rerank_full=5, refine=cfg) for q in QUERIES[:2]]
        batch = e.query_batch(QUERIES[:2], k=5, damping=DAMPING, rerank_full=5, refine=cfg)
    for a, b in zip(batch, one, strict=True):
        assert [h.id for h in a.hits] == [h.id for h in b.hits]
        assert np.allclose([h.full_score for h in a.hits], [h.full_score for h in b.hits], rtol=1e-4)


def test_exact_steps_after_the_first_stage_equal_the_exact_query_and_free_the_model_between_steps(built):
    """``exact_steps`` (what ``serve`` runs between requests) on first-stage results gives the hits and scores of
    ``query_batch(rerank_full=C)``; between its steps the model carries no hooks, so a first-stage query run in
    between answers as it does alone."""
    idx = built[0]
    with QueryEngine(idx, device="cpu") as e:
        want = e.query_batch(QUERIES[:2], k=5, method="ekfac-selfnorm", rerank_full=C)
        alone = e.query(QUERIES[2], k=5, method="ekfac-selfnorm")
        first = e.query_batch(QUERIES[:2], k=C, method="ekfac-selfnorm", rerank_full=0)
        steps = e.exact_steps(first, QUERIES[:2], C)
        progress, between = [], None
        while True:
            try:
                progress.append(next(steps))
            except StopIteration as done:
                got = done.value
                break
            if between is None:
                assert all(not m._forward_hooks and not m._backward_hooks for m in e.model.modules())
                between = e.query(QUERIES[2], k=5, method="ekfac-selfnorm")
    assert len(progress) > 2 and progress[-1][0] == progress[-1][1]
    assert [h.id for h in between.hits] == [h.id for h in alone.hits]
    for w, g in zip(want, got, strict=True):
        assert [h.id for h in g.hits[:5]] == [h.id for h in w.hits]
        np.testing.assert_allclose([h.full_score for h in g.hits[:5]], [h.full_score for h in w.hits], rtol=1e-5)
        assert g.stage == w.stage == f"full-space re-rank of the top {C}"
    with QueryEngine(idx, device="cpu") as e, pytest.raises(ValueError, match="k >= 30"):
        next(e.exact_steps(e.query_batch(QUERIES[:1], k=5, rerank_full=0), QUERIES[:1], 30))
