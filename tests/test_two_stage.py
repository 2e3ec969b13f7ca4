"""Two stages by default (issue 16, item 3): a budget-bound index's first stage, then an exact
full-space re-rank, against brute-force full-space EK-FAC from dense float64 gradients
(``test_fullspace.Reference``: ``torch.func`` per-example gradients, plain-hook factors).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner
from test_eigen_basis import _reference_ekfac
from test_fullspace import QUERY, Reference

from gradindex.capture import ProjectionSpec
from gradindex.cli import main
from gradindex.data import load_records, tokenize_records
from gradindex.index import IndexConfig, build_indices
from gradindex.manifest import read_manifest
from gradindex.model import load_causal_lm
from gradindex.pipeline import BuildConfig, build_index
from gradindex.precondition.fullspace import budget_bound, stored_share
from gradindex.query import QueryEngine

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


@pytest.fixture(scope="module")
def two_stage(tmp_path_factory, gpt2_dir, text_jsonl):
    """The default build (projection sized by the budget, EK-FAC, int4 codes in its eigenbasis) at a
    budget that projects; it fits full-space EK-FAC for the re-rank itself."""
    out = tmp_path_factory.mktemp("two") / "idx"
    model, tok = load_causal_lm(gpt2_dir, device="cpu")
    data = tokenize_records(load_records(text_jsonl), tok, 64)
    cfg = BuildConfig(projection=ProjectionSpec(), budget=BUDGET, precondition="ekfac", transcode="ekfac",
                      storage="int4", damping=DAMPING, shard_size=16, max_length=64)
    build_index(model, tok, data, out, cfg, model_id=str(gpt2_dir), data_id=str(text_jsonl), progress=False)
    build_indices(out, IndexConfig(), progress=False)
    return out


def test_budget_bound_build_fits_full_space_ekfac(two_stage):
    man = read_manifest(two_stage)
    assert budget_bound(man) and stored_share(man) < 0.2
    assert "ekfac" in man["full_space"] and man["full_space"]["ekfac"]["fit"]["examples"] == 40


def test_first_stage_recall_of_full_space_top10(two_stage, ref):
    """Fails if the default first stage's recall of exhaustive full-space EK-FAC's top 10 at C drops."""
    truth = np.argsort(-_reference_ekfac(ref), kind="stable")[:10]
    with QueryEngine(two_stage, device="cpu") as e:
        r = e.query(QUERY, k=C, method="ekfac", damping=DAMPING, rerank_full=0)
    assert r.stage == "first stage" and r.reranked == 0
    recall = len({h.id for h in r.hits} & set(truth.tolist())) / 10
    assert recall >= FIRST_STAGE_RECALL, recall


def test_default_query_reranks_exactly_to_the_brute_force_top10(two_stage, ref):
    want = _reference_ekfac(ref)
    with QueryEngine(two_stage, device="cpu") as e:
        r = e.query(QUERY, k=10, damping=DAMPING)  # the default: rerank_full=None
    assert r.method == "ekfac" and r.stage == "full-space re-rank of the top 40" and r.reranked == 40
    ids = [h.id for h in r.hits]
    assert ids == np.argsort(-want, kind="stable")[:10].tolist()
    got = np.array([h.full_score for h in r.hits])
    assert np.abs(got - want[ids]).max() < 1e-4 * np.abs(want).max()


def test_cli_says_which_stage_scored(two_stage):
    res = CliRunner().invoke(main, ["query", str(two_stage), "--text", QUERY, "-k", "3", "--damping", str(DAMPING)])
    assert res.exit_code == 0, res.output
    assert "scores: full-space re-rank of the top 40" in res.output
    res = CliRunner().invoke(main, ["query", str(two_stage), "--text", QUERY, "-k", "3", "--rerank-full", "0",
                                    "--json"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout.strip().splitlines()[-1])
    assert {r["stage"] for r in rows} == {"first stage"} and "full_score" not in rows[0]
    res = CliRunner().invoke(main, ["query", str(two_stage), "--text", QUERY, "--rerank-full", "many"])
    assert res.exit_code != 0 and "auto or a number" in res.output


def test_missing_data_falls_back_to_the_first_stage_with_a_note(two_stage, tmp_path):
    with QueryEngine(two_stage, device="cpu", data=tmp_path / "gone.jsonl") as e:
        r = e.query(QUERY, k=5, damping=DAMPING)
        assert r.stage == "first stage" and r.reranked == 0
        note = [n for n in r.notes if n.startswith("first-stage scores")]
        assert note and "training data" in note[0] and "--data" in note[0]
        with pytest.raises(ValueError, match="needs the training data"):  # asked for explicitly: an error
            e.query(QUERY, k=5, rerank_full=10)


def test_missing_full_space_fit_falls_back_with_the_command(two_stage, tmp_path):
    import shutil

    d = tmp_path / "idx"
    shutil.copytree(two_stage, d)
    man = read_manifest(d)
    man.pop("full_space")
    (d / "manifest.json").write_text(json.dumps(man))
    with QueryEngine(d, device="cpu") as e:
        r = e.query(QUERY, k=5, damping=DAMPING)
    assert r.stage == "first stage"
    assert any("--space full" in n for n in r.notes), r.notes


def test_explain_on_a_budget_bound_index_gives_the_exact_full_space_score(two_stage, ref):
    from gradindex.apps.explain import Explainer

    want = _reference_ekfac(ref)
    with QueryEngine(two_stage, device="cpu") as e:
        out = Explainer(e).explain(QUERY, [0, 7], "ekfac", damping=DAMPING)
    for x in out:
        assert x.full_score == pytest.approx(want[x.id], rel=1e-4, abs=1e-4 * np.abs(want).max())
        assert x.score == pytest.approx(sum(x.query.scores), rel=1e-3, abs=1e-6)  # terms split the first stage's
    res = CliRunner().invoke(main, ["explain", str(two_stage), "--query", QUERY, "--id", "7", "--damping",
                                    str(DAMPING)])
    assert res.exit_code == 0 and "full-space score" in res.output, res.output
