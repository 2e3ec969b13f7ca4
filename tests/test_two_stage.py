"""Two stages (issue 16, item 3; issue 30, items 2 and 6): the default query is a budget-bound index's
first stage; the exact full-space stage runs on request (``rerank_full=C``) once the full-space fit is
there (``gradindex precondition --space full``, or ``gradindex build --rerank-fit``), against brute-force
full-space EK-FAC from dense float64 gradients (``test_fullspace.Reference``: ``torch.func`` per-example
gradients, plain-hook factors).
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from click.testing import CliRunner
from test_eigen_basis import _reference_ekfac
from test_fullspace import QUERY, Reference

from gradindex.capture import ProjectionSpec
from gradindex.cli import main
from gradindex.data import load_records, tokenize_records
from gradindex.index import IndexConfig, build_indices
from gradindex.model import load_causal_lm
from gradindex.pipeline import BuildConfig, build_index
from gradindex.precondition.fullspace import budget_bound, stored_share
from gradindex.query import QueryEngine
from gradindex.query.full import DEFAULT_RERANK, EXACT_STAGE_C
from gradindex.spec.manifest import read_manifest

DAMPING = 0.1  # the Reference's
BUDGET = "1/64"
"""Bytes per example as a fraction of the float32 gradient: int4 codes of about 1/8 of its numbers."""
C = 20
FIRST_STAGE_RECALL = 0.9
"""Measured share of brute-force full-space EK-FAC's top 10 inside this first stage's top ``C``: 1.0
(the 40-example fixture, budget 1/64, damping 0.1); the guard leaves room for round-off only."""


@pytest.fixture(scope="module")
def ref(gpt2_dir, text_jsonl):
    return Reference(gpt2_dir, text_jsonl)


def _build(out, gpt2_dir, text_jsonl, **kw):
    model, tok = load_causal_lm(gpt2_dir, device="cpu")
    data = tokenize_records(load_records(text_jsonl), tok, 64)
    cfg = BuildConfig(**{"projection": ProjectionSpec(), "budget": BUDGET, "precondition": "ekfac",
                         "transcode": "ekfac", "storage": "int4", "damping": DAMPING, "shard_size": 16,
                         "max_length": 64, **kw})
    build_index(model, tok, data, out, cfg, model_id=str(gpt2_dir), data_id=str(text_jsonl), progress=False)
    build_indices(out, IndexConfig(), progress=False)
    return out


@pytest.fixture(scope="module")
def two_stage(tmp_path_factory, gpt2_dir, text_jsonl):
    """The default build (projection sized by the budget, EK-FAC, int4 codes in its eigenbasis) at a
    budget that projects: no full-space fit."""
    return _build(tmp_path_factory.mktemp("two") / "idx", gpt2_dir, text_jsonl)


@pytest.fixture(scope="module")
def fitted(tmp_path_factory, two_stage):
    """The default build, then ``gradindex precondition IDX --method ekfac --space full``: the exact stage's fit."""
    d = tmp_path_factory.mktemp("fitted") / "idx"
    shutil.copytree(two_stage, d)
    res = CliRunner().invoke(main, ["precondition", str(d), "--method", "ekfac", "--space", "full", "--damping",
                                    str(DAMPING), "--quiet"])
    assert res.exit_code == 0, res.output
    return d


def test_default_build_makes_no_full_space_fit(two_stage, fitted):
    man = read_manifest(two_stage)
    assert budget_bound(man) and stored_share(man) < 0.2
    assert "full_space" not in man and not list((two_stage / "precond").glob("*-full*"))
    assert read_manifest(fitted)["full_space"]["ekfac"]["fit"]["examples"] == 40


def test_first_stage_recall_of_full_space_top10(two_stage, ref):
    """Fails if the default first stage's recall of exhaustive full-space EK-FAC's top 10 at C drops."""
    truth = np.argsort(-_reference_ekfac(ref), kind="stable")[:10]
    with QueryEngine(two_stage, device="cpu") as e:
        r = e.query(QUERY, k=C, method="ekfac", damping=DAMPING)  # the default: the first stage
    assert r.stage == "first stage" and r.reranked == 0 and DEFAULT_RERANK == 0
    recall = len({h.id for h in r.hits} & set(truth.tolist())) / 10
    assert recall >= FIRST_STAGE_RECALL, recall


def test_default_query_is_the_first_stage_with_a_note_on_the_exact_stage(fitted, two_stage):
    for d, needs in ((fitted, "the training data"), (two_stage, "--space full")):
        with QueryEngine(d, device="cpu") as e:
            r = e.query(QUERY, k=10, damping=DAMPING)  # rerank_full=None
            off = e.query(QUERY, k=10, damping=DAMPING, rerank_full=0)
        assert r.method == "ekfac-selfnorm" and r.stage == "first stage" and r.reranked == 0  # (the default)
        assert "rerank_full" not in r.seconds and all(h.full_score is None for h in r.hits)
        assert [(h.id, h.score) for h in r.hits] == [(h.id, h.score) for h in off.hits]
        note = [n for n in r.notes if n.startswith("first-stage scores")]
        assert len(note) == 1 and f"--rerank-full {EXACT_STAGE_C}" in note[0] and needs in note[0], r.notes
        assert "s a query here" in note[0] and not off.notes  # (its cost; asked for 0: no note)


def test_exact_stage_after_precondition_space_full_is_brute_force_full_space_ekfac(fitted, ref):
    want = _reference_ekfac(ref)
    said = []
    with QueryEngine(fitted, device="cpu") as e:
        e.announce = said.append
        r = e.query(QUERY, k=10, damping=DAMPING, rerank_full=40, method="ekfac")
    assert r.method == "ekfac" and r.stage == "full-space re-rank of the top 40" and r.reranked == 40
    ids = [h.id for h in r.hits]
    assert ids == np.argsort(-want, kind="stable")[:10].tolist()
    got = np.array([h.full_score for h in r.hits])
    assert np.abs(got - want[ids]).max() < 1e-4 * np.abs(want).max()
    assert said and said[0].startswith("exact stage: 40 candidates re-scored in full space, about")  # (before)
    took = [n for n in r.notes if n.startswith("exact stage: 40 candidates re-scored in full space in")]
    assert took and r.seconds["rerank_full"] > 0


def test_precondition_space_full_gives_the_old_default_build_s_exact_stage(tmp_path, gpt2_dir, text_jsonl, fitted):
    """Issue 30: a default build given ``precondition --space full`` answers ``--rerank-full C`` with the scores
    of the build that fitted it itself (``--rerank-fit``, what the default build did before)."""
    old = _build(tmp_path / "old", gpt2_dir, text_jsonl, rerank_fit=True, shard_size=64)
    assert read_manifest(old)["full_space"]["ekfac"]["fit"]["source"] == "build pass + model pass"
    out = []
    for d in (old, fitted):
        with QueryEngine(d, device="cpu") as e:
            out.append(e.query(QUERY, k=C, damping=DAMPING, rerank_full=C))
    a, b = ({h.id: h.full_score for h in r.hits} for r in out)
    assert set(a) == set(b)
    x, y = np.array([a[i] for i in sorted(a)]), np.array([b[i] for i in sorted(a)])
    assert np.abs(x - y).max() <= 1e-4 * np.abs(y).max()


def test_cli_says_which_stage_scored(fitted):
    res = CliRunner().invoke(main, ["query", str(fitted), "--text", QUERY, "-k", "3", "--damping", str(DAMPING)])
    assert res.exit_code == 0, res.output
    assert "scores: first stage" in res.output and f"--rerank-full {EXACT_STAGE_C}" in res.output
    res = CliRunner().invoke(main, ["query", str(fitted), "--text", QUERY, "-k", "3", "--damping", str(DAMPING),
                                    "--rerank-full", "40"])
    assert res.exit_code == 0, res.output
    assert "scores: full-space re-rank of the top 40" in res.output
    assert "note: exact stage: 40 candidates re-scored in full space, about" in res.output  # the estimate
    assert "re-scored in full space in" in res.output  # and what it took
    res = CliRunner().invoke(main, ["query", str(fitted), "--text", QUERY, "-k", "3", "--json"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout.strip().splitlines()[-1])
    assert {r["stage"] for r in rows} == {"first stage"} and "full_score" not in rows[0]
    res = CliRunner().invoke(main, ["query", str(fitted), "--text", QUERY, "--rerank-full", "many"])
    assert res.exit_code != 0 and "auto or a number" in res.output


def test_missing_data_is_named_in_the_note_and_refused_when_asked(fitted, tmp_path):
    with QueryEngine(fitted, device="cpu", data=tmp_path / "gone.jsonl") as e:
        r = e.query(QUERY, k=5, damping=DAMPING)
        assert r.stage == "first stage" and r.reranked == 0
        note = [n for n in r.notes if n.startswith("first-stage scores")]
        assert note and "training data" in note[0] and "--data" in note[0]
        with pytest.raises(ValueError, match="needs the training data"):  # asked for explicitly: an error
            e.query(QUERY, k=5, rerank_full=10)


def test_exact_stage_without_the_full_space_fit_is_refused_with_the_command(two_stage):
    with QueryEngine(two_stage, device="cpu") as e:
        with pytest.raises(FileNotFoundError, match="--space full"):
            e.query(QUERY, k=5, damping=DAMPING, rerank_full=10)


def test_explain_gives_the_exact_full_space_score_on_request(fitted, ref):
    from gradindex.apps.explain import Explainer

    want = _reference_ekfac(ref)
    with QueryEngine(fitted, device="cpu") as e:
        plain = Explainer(e).explain(QUERY, [0, 7], "ekfac", damping=DAMPING)
        out = Explainer(e).explain(QUERY, [0, 7], "ekfac", damping=DAMPING, full_space=True)
    assert all(x.full_score is None for x in plain)  # (the default: the first stage's only)
    for x in out:
        assert x.full_score == pytest.approx(want[x.id], rel=1e-4, abs=1e-4 * np.abs(want).max())
        assert x.score == pytest.approx(sum(x.query.scores), rel=1e-3, abs=1e-6)  # terms split the first stage's
    args = ["explain", str(fitted), "--query", QUERY, "--id", "7", "--damping", str(DAMPING)]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0 and "full-space score" not in res.output, res.output
    res = CliRunner().invoke(main, [*args, "--full-space"])
    assert res.exit_code == 0 and "full-space score" in res.output, res.output
