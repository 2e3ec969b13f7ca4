"""The library's ``method=None`` is the index's default method, as on the command line.

On an index built with the defaults (rows stored in the EK-FAC eigenbasis) a ``graddot`` default
used to make ``QueryEngine.query_batch``, ``search``, ``scores``, ``explain``, ``score_matrix``,
``find_duplicates`` and ``build_report`` refuse their own defaults.
"""

from __future__ import annotations

import numpy as np

from gradindex.apps.dedup import DedupConfig, find_duplicates
from gradindex.apps.explain import Explainer
from gradindex.manifest import read_manifest, row_basis
from gradindex.query import QueryEngine
from gradindex.query.scores import score_matrix

Q = ("the quick brown", " fox jumps")


def test_method_none_is_the_index_default(default_index):
    assert row_basis(read_manifest(default_index)) == "ekfac"
    with QueryEngine(default_index, device="cpu") as e:
        assert e.resolve_method() == "ekfac" and e.resolve_method("graddot") == "graddot"
        got = e.query(Q, k=3)
        want = e.query(Q, k=3, method="ekfac")
        assert got.method == "ekfac" and [h.id for h in got.hits] == [h.id for h in want.hits]
        grads = e.gradients(e.tokenize([Q]))[0]
        np.testing.assert_allclose(e.scores([Q]), e.scores([Q], method="ekfac"))
        np.testing.assert_allclose(score_matrix(default_index, grads, device="cpu"),
                                   score_matrix(default_index, grads, "ekfac", device="cpu"))
        assert [h.id for h in e.search(grads, k=3)[0].hits] == [h.id for h in want.hits]
        ex = Explainer(e).explain(Q, got.hits[0].id)[0]
        assert ex.method == "ekfac" and np.isclose(ex.score, got.hits[0].score, rtol=1e-4)
    res = find_duplicates(default_index, DedupConfig())
    ref = find_duplicates(default_index, DedupConfig(method="ekfac"))
    assert [g.ids for g in res.groups] == [g.ids for g in ref.groups]
