"""Issue 21 (hardening), items without a better home: what a new user hits on the default index."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from gradindex.cli import main
from gradindex.methods import methods_of
from gradindex.query import QueryEngine


def test_graddot_refusal_on_the_default_index_lists_every_method_it_answers(default_index):
    """Item 15: the refusal said ``['ekfac']``; the index also answers ``ekfac-selfnorm``."""
    with QueryEngine(default_index, device="cpu") as e:
        answers = methods_of(e.manifest, default_index, selfnorm=True)
        assert answers == ["ekfac", "ekfac-selfnorm"]
        with pytest.raises(ValueError, match="use one of ekfac, ekfac-selfnorm ") as err:
            e.query("the cat sat on a mat", method="graddot")
    assert "does not apply to this index" in str(err.value)
    res = CliRunner().invoke(main, ["query", str(default_index), "--text", "the cat sat", "--method", "graddot",
                                    "--device", "cpu"])
    assert res.exit_code == 2 and "use one of ekfac, ekfac-selfnorm" in res.output, res.output


def test_explain_prints_the_residual_between_the_score_and_its_token_terms_and_its_cause(default_index):
    """Item 5: on an int4 index the training tokens' terms do not sum to the score; say by how much and why."""
    import json

    from gradindex.apps.explain import Explainer

    with QueryEngine(default_index, device="cpu") as e:
        ids = [h.id for h in e.query("the cat sat on a mat", k=2).hits]
        exps = Explainer(e).explain("the cat sat on a mat", ids)
    args = ["explain", str(default_index), "--query", "the cat sat on a mat", "--device", "cpu"]
    for i in ids:
        args += ["--id", str(i)]
    text = CliRunner().invoke(main, args)
    js = CliRunner().invoke(main, args + ["--json"])
    assert text.exit_code == 0 and js.exit_code == 0, text.output + js.output
    for x, line in zip(exps, js.stdout.splitlines(), strict=True):
        d = json.loads(line)
        assert d["residual"] == pytest.approx(d["score"] - sum(d["train"]["scores"]), rel=1e-9, abs=1e-12)
        assert d["residual"] != 0 and "int4-coded" in d["residual_cause"]  # the rows are int4 codes
        assert sum(d["query"]["scores"]) == pytest.approx(d["score"], rel=1e-5)  # against the coded row
        assert f"residual {x.residual:+.6g}" in text.stdout
    assert text.stdout.count("the score minus the training tokens' sum; the stored row is int4-coded") == len(ids)
