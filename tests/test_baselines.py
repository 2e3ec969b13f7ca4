"""The benchmarks' attribution baselines against hand computations."""

from __future__ import annotations

import math

import numpy as np

from benchmarks.baselines import bm25_scores, trackstar_scores


def _lucene_bm25(docs, query, k1=1.5, b=0.75):
    N, avgdl = len(docs), sum(map(len, docs)) / len(docs)
    out = []
    for d in docs:
        s = 0.0
        for t in set(query):
            df = sum(t in x for x in docs)
            tf = d.count(t)
            if df and tf:
                idf = math.log(1 + (N - df + 0.5) / (df + 0.5))
                s += idf * tf / (tf + k1 * (1 - b + b * len(d) / avgdl))
        out.append(s)
    return out


def test_bm25_on_token_ids_is_lucene_okapi_over_the_query_targets():
    train = [[1, 2, 2, 5], [3, 1], [4, 4, 4], [2, 3, 6, 7, 1]]
    query, labels = [9, 2, 1, 8], [-100, 2, 1, -100]  # only the target tokens count
    got = bm25_scores(train, [query], [labels])[0]
    np.testing.assert_allclose(got, _lucene_bm25(train, [2, 1]), rtol=1e-5)
    assert got[2] == 0.0


def test_trackstar_is_the_cosine_of_second_moment_normalised_projected_gradients():
    rng = np.random.default_rng(0)
    G = {"l": rng.standard_normal((5, 6, 4))}
    v = {"l": rng.random((6, 4)) + 0.1}
    s = trackstar_scores(G, G, v, k=8)  # k larger than both sides: an exact (rotated) map, so cosines are exact
    X = (G["l"] / np.sqrt(v["l"])).reshape(5, -1)
    X /= np.linalg.norm(X, axis=1, keepdims=True)
    assert np.allclose(np.diag(s), 1.0)
    # a random Gaussian map of full rank is not orthogonal: cosines are preserved in expectation only
    assert np.corrcoef(s[np.triu_indices(5, 1)], (X @ X.T)[np.triu_indices(5, 1)])[0, 1] > 0.5
