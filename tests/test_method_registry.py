"""Methods are one registry: a method registered in this test file alone (no other module touched)
is a CLI choice, is listed by every "which methods does this index answer" path, and scores as
its declared operation — checked against a brute-force inner product of the stored rows."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from gradindex import methods as M
from gradindex.cli import main


@pytest.fixture
def toy_method():
    """``dot``: the plain inner product of raw rows, by another name (one ``register`` call)."""
    toy = M.register(M.Method("dot", row_bases={"raw": "graddot"}, apps=frozenset({"query", "outliers"}),
                              summary="a toy: ⟨g_q, g_t⟩ under another name"))
    yield toy
    del M.REGISTRY[toy.name]


def test_a_registered_method_is_answered_everywhere(toy_method, audit_index):
    from gradindex.index import OpenIndex
    from gradindex.precondition import available_methods
    from gradindex.query import QueryEngine
    from gradindex.spec.manifest import read_manifest
    from gradindex.store import Store

    assert "dot" in M.all_methods("query") and "dot-selfnorm" in M.all_methods("query")
    assert "dot" in M.all_methods("outliers") and "dot" not in M.all_methods("dedup")
    assert M.parse_method("dot-selfnorm") == ("dot", True)
    m = read_manifest(audit_index)
    assert "dot" in M.methods_of(m, audit_index) and "dot-selfnorm" in available_methods(audit_index, selfnorm=True)
    with OpenIndex(audit_index) as ix:
        assert "dot" in ix.methods()

    texts = ["the cat sat on a mat", "red sun over green hills"]
    with QueryEngine(audit_index, device="cpu", use_gpu=False) as e:
        grads, _, _ = e.gradients(e.tokenize(texts))
        got = e.scores(texts, method="dot")
        hits = e.search(grads, k=5, method="dot")
    with Store(audit_index) as st:  # brute force: Σ_layers ⟨q, t⟩ over the stored float32 rows
        want = sum(grads[n].double().numpy() @ np.concatenate([b[n] for _, b in st.iter_blocks([n])]).T.astype(
            np.float64) for n in st.layers)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-8)
    for h, row in zip(hits, want, strict=True):
        assert [x.id for x in h.hits] == list(np.argsort(-row, kind="stable")[:5])

    res = CliRunner().invoke(main, ["query", str(audit_index), "--text", texts[0], "-k", "3", "--method", "dot",
                                    "--json", "--device", "cpu"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert [r["id"] for r in json.loads(res.stdout) if r["kind"] == "top"] == list(np.argsort(-want[0])[:3])
    res = CliRunner().invoke(main, ["dedup", str(audit_index), "--out", "x.jsonl", "--method", "dot"])
    assert res.exit_code == 2 and "'dot' is not one of" in res.output  # not a dedup method: not a choice


def test_unknown_methods_name_the_registered_ones():
    with pytest.raises(ValueError, match=r"is not one of \['graddot', 'cosine', 'kfac', 'ekfac', 'adam'"):
        M.parse_method("ekfca")
    with pytest.raises(ValueError, match="not one of"):
        M.parse_method("cosine-selfnorm")  # cosine's self-influence is 1: no -selfnorm variant
    with pytest.raises(ValueError, match=r"answers on a trajectory index only \(`gradindex trajectory.*an index "
                                         r"answers one of \['graddot'"):
        M.parse_method("tracin")  # answered by trajectory indices only (gradindex query routes it)


def test_the_built_in_vocabulary_is_the_registrys():
    assert M.names("indexed") == ("graddot", "cosine", "kfac", "ekfac", "adam")
    assert M.names("fitted") == ("kfac", "ekfac") and M.names("identity") == ("graddot", "cosine", "adam")
    assert M.PREFERRED == ("ekfac", "kfac", "adam", "graddot")
    assert M.row_methods() == {"raw": {m: m for m in M.names("indexed")}, "kfac": {"kfac": "graddot", "ekfac": "ekfac"},
                               "ekfac": {"ekfac": "graddot"}}
    assert set(M.all_methods("query", selfnorm=False)) == {*M.names("indexed"), "tracin"}
