"""Token-level explanations on a real tiny GPT-2 index: the token terms sum to the engine's exact
score (both sides), and each term equals one computed independently from plain autograd hooks."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from gradindex.apps.explain import Explainer
from gradindex.capture import ProjectionSpec
from gradindex.capture.layers import layer_info
from gradindex.capture.projection import projection_matrix
from gradindex.cli import main
from gradindex.data import collate, per_example_loss
from gradindex.methods import DEFAULT_DAMPING
from gradindex.model import load_causal_lm
from gradindex.query import QueryEngine
from tests.test_adam import trained  # noqa: F401  (fixture)

QUERY = ("the cat sat on", " a mat near old town")


@pytest.fixture(scope="module")
def engine(audit_index):
    with QueryEngine(audit_index, device="cpu") as e:
        yield e


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


@pytest.mark.parametrize("method", ["graddot", "kfac", "ekfac"])
def test_token_terms_sum_to_the_engines_exact_score(engine, method):
    r = engine.query(QUERY, k=3, lowest=2, method=method)
    hits = r.hits + r.lowest
    ex = Explainer(engine).explain(QUERY, [h.id for h in hits], method=method)
    for h, e in zip(hits, ex, strict=True):
        assert e.id == h.id and _rel(e.score, h.score) < 1e-9
        assert _rel(e.train.total, h.score) < 1e-5, (e.train.total, h.score)
        assert _rel(e.query.total, h.score) < 1e-5, (e.query.total, h.score)
        for n, v in h.layer_scores.items():
            assert abs(e.train.layer_totals[n] - v) <= 1e-5 * abs(h.score) + 1e-9
        assert len(e.train.tokens) == len(e.train.scores) and h.text.startswith("".join(e.train.tokens))
        assert "".join(e.query.tokens) == QUERY[0] + QUERY[1]
        assert np.ptp(e.train.scores) > 0  # not one value spread evenly
    # prompt tokens are not targets; completion tokens are
    assert not any(ex[0].query.target[:3]) and all(ex[0].query.target[-3:])


def _independent_token_terms(model_dir, spec: ProjectionSpec, layers, ids, labels, vec) -> np.ndarray:
    """Per-token ``Σ_l (P_g g_t)ᵀ V_l (P_a [a_t, 1])`` from plain forward hooks and ``retain_grad``."""
    model, tok = load_causal_lm(model_dir, device="cpu")
    mods = dict(model.named_modules())
    seen = {}

    def hook(name):
        def f(mod, inp, out):
            out.retain_grad()
            seen[name] = (inp[0].detach(), out)
        return f

    handles = [mods[n].register_forward_hook(hook(n)) for n in layers]
    b = collate([ids], [labels], tok.pad_token_id or 0)
    loss, _ = per_example_loss(model(input_ids=b["input_ids"]).logits, b["labels"])
    loss.sum().backward()
    for h in handles:
        h.remove()
    T = len(ids)
    out = np.zeros(T)
    for n in layers:
        a, y = seen[n]
        info = layer_info(mods[n])
        a = a[0].double()
        if info.bias:
            a = torch.cat([a, torch.ones(T, 1, dtype=a.dtype)], 1)
        g = y.grad[0].double()
        Pa = projection_matrix(spec, n, "a", info.n_in_total, torch.device("cpu")).double()
        Pg = projection_matrix(spec, n, "g", info.n_out, torch.device("cpu")).double()
        V = torch.from_numpy(vec[n]).reshape(spec.k_g, spec.k_a)
        out += (((g @ Pg.T) @ V) * (a @ Pa.T)).sum(1).numpy()
    return out


def test_each_token_term_equals_an_independent_computation(engine, gpt2_dir):
    ex = Explainer(engine)
    hit = engine.query(QUERY, k=1, method="ekfac").hits[0]
    e = ex.explain(QUERY, hit.id, method="ekfac")[0]
    spec = engine.space.projection
    # training side: against M q, M q from the engine's own query gradient
    from gradindex.index.space import query_vectors

    tokens = engine.tokenize([QUERY])
    q, _, _ = engine.gradients(tokens)
    m, _, _ = query_vectors(engine.indices.space, engine.pre, "ekfac", DEFAULT_DAMPING, q)
    ids, labels, _ = engine.texts.tokens(np.array([hit.id]))
    ref = _independent_token_terms(gpt2_dir, spec, e.layers, ids[0], labels[0], {n: m[n][0] for n in e.layers})
    np.testing.assert_allclose(e.train.scores, ref, rtol=1e-4, atol=1e-6 * np.abs(ref).max())
    # query side: against M t from the stored row
    rows = engine.store.read_rows(np.array([hit.id]), e.layers)
    mt = {n: engine.pre.apply("ekfac", n, torch.from_numpy(rows[n].astype(np.float64)), -1.0,
                              DEFAULT_DAMPING)[0].numpy() for n in e.layers}
    ref_q = _independent_token_terms(gpt2_dir, spec, e.layers, tokens.input_ids[0], tokens.labels[0], mt)
    np.testing.assert_allclose(e.query.scores, ref_q, rtol=1e-4, atol=1e-6 * np.abs(ref_q).max())


def test_layer_subset_and_cache(engine):
    ex = Explainer(engine, cache=2)
    layer = engine.layer_names[0]
    r = engine.query("dog ran far away", k=4, layers=[layer], method="ekfac")  # (explain's default, not -selfnorm)
    got = ex.explain("dog ran far away", [h.id for h in r.hits], layers=[layer])
    assert len(ex._factors) == 4  # one call keeps what it needs, even past the cache size
    for h, e in zip(r.hits, got, strict=True):
        assert e.layers == [layer] and _rel(e.train.total, h.score) < 1e-5
    ex.explain("dog ran far away", [r.hits[0].id], layers=[layer])
    assert len(ex._factors) == 2


def test_bad_input_is_a_clear_error(engine):
    ex = Explainer(engine)
    with pytest.raises(ValueError, match="graddot, kfac, ekfac"):
        ex.explain("the cat", 0, method="cosine")
    with pytest.raises(ValueError, match="not in the index"):
        ex.explain("the cat sat", engine.n)


def test_cli_explain(audit_index):
    runner = CliRunner()
    res = runner.invoke(main, ["explain", str(audit_index), "--text", "the cat sat on a mat", "--id", "3",
                               "--method", "kfac", "--json", "--device", "cpu"])
    assert res.exit_code == 0, res.output
    d = json.loads(res.output)
    assert d["id"] == 3 and _rel(d["train"]["total"], d["score"]) < 1e-5
    res = runner.invoke(main, ["explain", str(audit_index), "--text", "the cat sat on a mat", "--id", "3",
                               "--device", "cpu"])
    assert res.exit_code == 0, res.output
    assert "training example 3" in res.output and "query tokens" in res.output
    res = runner.invoke(main, ["explain", str(audit_index), "--text", "the cat", "--id", "99999"])
    assert res.exit_code != 0 and "Error: training ids [99999] are not in the index" in res.output


def test_cli_explain_target_splits_the_targeted_querys_score(audit_index):
    """explain had no --target, so a targeted query's score could not be split per token."""
    from gradindex.query import QueryEngine

    args = ["explain", str(audit_index), "--prompt", "the cat sat", "--completion", " on a mat near the river",
            "--target", "mat", "--id", "3", "--method", "kfac", "--json", "--device", "cpu"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    d = json.loads(res.output)
    with QueryEngine(audit_index, device="cpu") as e:
        want = e.scores([{"prompt": "the cat sat", "completion": " on a mat near the river", "target": "mat"}],
                        method="kfac")[0, 3]
        whole = e.scores([("the cat sat", " on a mat near the river")], method="kfac")[0, 3]
    assert _rel(d["score"], want) < 1e-5 and _rel(d["query"]["total"], want) < 1e-5 and _rel(whole, want) > 1e-3
    marked = [t for t, on in zip(d["query"]["tokens"], d["query"]["target"], strict=True) if on]
    assert "mat" in "".join(marked) and "river" not in "".join(marked), marked


def test_adam_index_factored_splits_and_exact_is_refused(tmp_path, trained):  # noqa: F811
    """Adam's per-side scales are folded into the projection, so the split still sums to the score;
    the exact (entrywise) transform has no per-token form and says so."""
    from gradindex.index import IndexConfig
    from tests.test_adam import _build

    out = tmp_path / "adam"
    _build(trained, out, index=IndexConfig(), optimizer_state=str(trained["st"]), adam_mode="factored")
    with QueryEngine(out, device="cpu", use_gpu=False) as eng:
        r = eng.query("the cat sat on a mat", k=3, method="adam")
        got = Explainer(eng).explain("the cat sat on a mat", [h.id for h in r.hits], method="adam")
        for h, e in zip(r.hits, got, strict=True):
            assert _rel(e.train.total, h.score) < 1e-5 and _rel(e.query.total, h.score) < 1e-5
    exact = tmp_path / "exact"
    _build(trained, exact, index=IndexConfig(), optimizer_state=str(trained["st"]), adam_mode="exact")
    with QueryEngine(exact, device="cpu", use_gpu=False) as eng:
        with pytest.raises(ValueError, match="does not split into per-token terms"):
            Explainer(eng).explain("the cat sat on a mat", [0], method="adam")
