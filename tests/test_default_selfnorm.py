"""A query given no method answers with ``ekfac-selfnorm`` where the index answers ``ekfac`` (issue 31): EK-FAC
influence divided by ``sqrt`` of the training example's self-influence, checked against a dense float64 computation
from the stored rows and the fitted factors; where the self-influence cannot be had, plain ``ekfac`` with a note.
The commands built on the method itself (explain, outliers, the audit report) keep ``ekfac``."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
from click.testing import CliRunner

from gradindex.apps.explain import Explainer
from gradindex.cli import main
from gradindex.index import OpenIndex
from gradindex.methods import DEFAULT_DAMPING, default_method
from gradindex.precondition.files import precond_path
from gradindex.query import QueryEngine
from gradindex.query.defaults import default_query_method, query_method
from gradindex.query.scores import score_matrix
from gradindex.store import Store
from gradindex.store.rows import RowReader

Q = [("the quick brown", " fox jumps over"), "a cat sat on the mat and looked at the dog"]


@pytest.fixture(scope="module")
def raw_index(tmp_path_factory, gpt2_dir, text_jsonl):
    """Raw float32 rows (projected 6x5), EK-FAC fitted: the rows and the fit a dense reference reads."""
    out = tmp_path_factory.mktemp("selfnorm") / "idx"
    res = CliRunner().invoke(main, ["build", str(gpt2_dir), str(text_jsonl), "--out", str(out), "--projection",
                                    "6x5", "--max-length", "48", "--shard-size", "16", "--precondition", "ekfac",
                                    "--transcode", "none", "--storage", "fp32", "--device", "cpu", "--quiet"])
    assert res.exit_code == 0, res.output
    return out


def _dense_ekfac(index, grads: dict) -> tuple[np.ndarray, np.ndarray]:
    """``(plain [Q, N], self-influence [N])``: ``⟨(H + δI)⁻¹ q, t⟩`` and ``⟨(H + δI)⁻¹ t, t⟩`` from the stored rows
    and the fit's ``Q_S``, ``Q_A``, ``Λ`` as dense float64 matrices, ``δ = damping × mean(Λ)`` per layer."""
    with Store(index) as s:
        n = sum(s.sizes)
        rows = {k: v.astype(np.float64) for k, v in s.read_rows(np.arange(n)).items()}
    plain, si = 0.0, 0.0
    with h5py.File(precond_path(index, "ekfac"), "r") as f:
        for name, t in rows.items():
            L = f["layers"][name]
            V = np.kron(L["Q_S"][:], L["Q_A"][:])
            lam = L["Lambda"][:].reshape(-1).astype(np.float64)
            Hinv = V @ np.diag(1.0 / (lam + DEFAULT_DAMPING * lam.mean())) @ V.T
            q = np.asarray(grads[name], np.float64)
            plain = plain + q @ Hinv @ t.T
            si = si + np.einsum("nd,de,ne->n", t, Hinv, t)
    return plain, si


def test_the_default_is_ekfac_selfnorm_and_equals_ekfac_over_sqrt_self_influence(raw_index):
    with QueryEngine(raw_index, device="cpu") as e:
        assert default_method(e.manifest, raw_index) == "ekfac"  # the base default, as before
        assert e.resolve_method() == default_query_method(e.manifest, raw_index) == "ekfac-selfnorm"
        assert e.base_method() == "ekfac" and e.resolve_method("ekfac") == "ekfac"
        grads, _, _ = e.gradients(e.tokenize(Q))
        plain, si = _dense_ekfac(raw_index, grads)
        assert (si > 0).all()
        want = plain / np.sqrt(si)[None, :]
        np.testing.assert_allclose(e.scores(Q, method="ekfac"), plain, rtol=1e-6, atol=1e-9)
        np.testing.assert_allclose(e.scores(Q), want, rtol=1e-6, atol=1e-9)
        np.testing.assert_allclose(score_matrix(raw_index, grads, device="cpu"), want, rtol=1e-6, atol=1e-9)
        results = e.query_batch(Q, k=5)
        for j, r in enumerate(results):
            assert r.method == "ekfac-selfnorm", r.method  # the result says which method answered
            assert not any("self-influence" in n for n in r.notes), r.notes
            top = np.argsort(-want[j], kind="stable")[:5]
            assert [h.id for h in r.hits] == top.tolist()
            np.testing.assert_allclose([h.score for h in r.hits], want[j, top], rtol=1e-5)
        # the commands built on the method itself keep plain ekfac
        ex = Explainer(e).explain(Q[0], results[0].hits[0].id)[0]
        assert ex.method == "ekfac" and np.isclose(ex.score, plain[0, results[0].hits[0].id], rtol=1e-4)


def test_default_index_answers_ekfac_selfnorm_from_its_whitened_rows(default_index):
    """On the default build (int4 rows in the EK-FAC whitened eigenbasis) EK-FAC influence is the rows' inner
    product, and the self-influence each decoded row's squared norm."""
    with QueryEngine(default_index, device="cpu") as e, OpenIndex(default_index) as ix:
        assert e.resolve_method() == "ekfac-selfnorm"
        rows = RowReader(ix.store, ix.layers).read(np.arange(ix.n))
        sq = sum(np.square(np.asarray(rows[n], np.float64)).sum(1) for n in ix.layers)
        plain = e.scores(Q, method="ekfac")
        got = e.scores(Q)
        np.testing.assert_allclose(got, plain / np.sqrt(sq)[None, :], rtol=1e-3, atol=1e-9)
        r = e.query(Q[1], k=3)
        assert r.method == "ekfac-selfnorm"
        assert [h.id for h in r.hits] == np.argsort(-got[1], kind="stable")[:3].tolist()


def test_no_self_influence_falls_back_to_plain_ekfac_with_a_note(raw_index, monkeypatch, caplog):
    def unavailable(self, base, damping, layers):
        raise ValueError("no self-influence in this index")

    with QueryEngine(raw_index, device="cpu") as e:
        plain = e.query(Q[0], k=4, method="ekfac")
        grads, _, _ = e.gradients(e.tokenize(Q[:1]))
        want = e.scores(Q[:1], method="ekfac")
        monkeypatch.setattr(OpenIndex, "self_influence", unavailable)  # (the engine keeps no copy of its own)
        with caplog.at_level("WARNING", logger="gradindex"):
            r = e.query(Q[0], k=4)
        assert "plain ekfac" not in caplog.text  # (said once, as the result's note: the CLI printed it twice)
        assert r.method == "ekfac" and [h.id for h in r.hits] == [h.id for h in plain.hits]
        assert any("default method ekfac-selfnorm" in n and "plain ekfac" in n for n in r.notes), r.notes
        with caplog.at_level("WARNING", logger="gradindex"):
            np.testing.assert_allclose(e.scores(Q[:1]), want)
            np.testing.assert_allclose(score_matrix(e.index, grads, device="cpu"), want)
        assert "plain ekfac" in caplog.text
        with pytest.raises(ValueError, match="no self-influence"):  # asked for by name: no silent replacement
            e.query(Q[0], k=4, method="ekfac-selfnorm")


def test_cli_query_says_which_method_answered(raw_index):
    res = CliRunner().invoke(main, ["query", str(raw_index), "--text", "the quick brown fox", "-k", "2",
                                    "--device", "cpu"])
    assert res.exit_code == 0, res.output
    assert "method ekfac-selfnorm" in res.output
    res = CliRunner().invoke(main, ["query", str(raw_index), "--text", "the quick brown fox", "-k", "2",
                                    "--device", "cpu", "--method", "ekfac"])
    assert res.exit_code == 0 and "method ekfac " in res.output, res.output


def test_query_method_of_each_base():
    assert query_method("ekfac") == "ekfac-selfnorm"
    assert [query_method(m) for m in ("kfac", "graddot", "adam", "cosine", "tracin")] == \
        ["kfac", "graddot", "adam", "cosine", "tracin"]
