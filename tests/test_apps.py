"""Outliers and dedup on a real small GPT-2 index, checked against brute force over the stored rows."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from click.testing import CliRunner

from gradindex.apps.dedup import DedupConfig, _groups, _union, find_duplicates, ivf_neighbors
from gradindex.apps.outliers import detection_curve, rank_outliers
from gradindex.capture import ProjectionSpec
from gradindex.cli import main
from gradindex.data import load_records, tokenize_records
from gradindex.model import load_causal_lm
from gradindex.pipeline import BuildConfig, build_index
from gradindex.precondition import load_preconditioner
from gradindex.store import Store
from tests.conftest import make_texts


@pytest.fixture(scope="module")
def dup_index(tmp_path_factory, gpt2_dir):
    """30 random texts, plus 3 exact copies and 2 copies with a trailing word changed."""
    base = make_texts(30, seed=11, min_words=8, max_words=20)
    texts = base + [base[3], base[3], base[17], base[5][: base[5].rfind(" ")] + " fish",
                    base[9][: base[9].rfind(" ")] + " bread"]
    d = tmp_path_factory.mktemp("dedup")
    data = d / "train.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    model, tok = load_causal_lm(gpt2_dir, device="cpu")
    tokd = tokenize_records(load_records(data), tok, 64)
    out = d / "idx"
    cfg = BuildConfig.raw(projection=ProjectionSpec(k_a=8, k_g=8), shard_size=16, precondition="ekfac")
    build_index(model, tok, tokd, out, cfg, model_id=str(gpt2_dir), data_id=str(data), progress=False)
    return out, texts


def _brute_unit(index_dir, method="graddot", damping=0.1):
    with Store(index_dir) as st:
        rows = st.read_rows(np.arange(len(st)))
        layers = st.layers
    parts = []
    P = load_preconditioner(index_dir, method) if method != "graddot" else None
    for n in layers:
        x = rows[n].astype(np.float64)
        if P is not None:
            import torch

            x = P.apply(n, torch.from_numpy(x), power=-0.5, damping=damping).numpy()
        parts.append(x)
    v = np.concatenate(parts, 1)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def _components(n, pairs):
    parent = list(range(n))

    def find(i):
        while parent[i] != i:
            i = parent[i]
        return i

    for i, j in pairs:
        parent[find(i)] = find(j)
    comps: dict[int, list[int]] = {}
    for i in range(n):
        comps.setdefault(find(i), []).append(i)
    return sorted(sorted(c) for c in comps.values() if len(c) > 1)


@pytest.mark.parametrize("method,sketch,exact_max", [("graddot", 0, 50_000), ("graddot", 64, 50_000),
                                                     ("ekfac", 0, 50_000), ("graddot", 64, 0), ("ekfac", 32, 0)])
def test_dedup_groups_equal_brute_force_components(dup_index, method, sketch, exact_max):
    out, texts = dup_index
    u = _brute_unit(out, method)
    C = u @ u.T
    thr = 0.97
    pairs = [(i, j) for i in range(len(u)) for j in range(i + 1, len(u)) if C[i, j] >= thr]
    # exact_max=0: the IVF self-join (every list probed, so it must find what exact kNN finds)
    cfg = DedupConfig(threshold=thr, method=method, sketch=sketch, neighbors=8, exact_max=exact_max, nprobe=16)
    res = find_duplicates(out, cfg)
    assert [g.ids for g in res.groups] == _components(len(u), pairs)
    # the planted exact copies are grouped and labelled exact; one of each group is kept
    by_first = {g.ids[0]: g for g in res.groups}
    assert by_first[3].ids[:1] == [3] and {30, 31} <= set(by_first[3].ids) and "exact" in by_first[3].kind
    assert 32 in by_first[17].ids
    keep = res.keep_mask()
    assert keep[3] and not keep[30] and not keep[31] and keep.sum() == len(texts) - sum(
        len(g.ids) - 1 for g in res.groups)


@pytest.mark.parametrize("method,sketch", [("graddot", 64), ("ekfac", 0)])
def test_dedup_in_blocks_of_a_few_rows_equals_dedup_in_one_block(dup_index, method, sketch):
    """Rows read in blocks of bytes (issue 33 item 11: an audit's RSS grew with every example): one row, one pair
    at a time gives the same groups, cosines and checked pairs as a block of every row."""
    out, _ = dup_index
    cfg = DedupConfig(threshold=0.97, method=method, sketch=sketch, neighbors=8)
    whole, small = find_duplicates(out, cfg), find_duplicates(out, replace(cfg, block_bytes=1))
    assert [g.to_dict() for g in small.groups] == [g.to_dict() for g in whole.groups] and whole.groups
    assert (small.pairs_proposed, small.pairs_checked, small.pairs_confirmed) == (
        whole.pairs_proposed, whole.pairs_checked, whole.pairs_confirmed)


def _clustered(n=3000, d=32, centers=150, noise=0.15, seed=0):
    rng = np.random.default_rng(seed)
    c = rng.standard_normal((centers, d))
    x = c[rng.integers(centers, size=n)] + noise * rng.standard_normal((n, d))
    x[:40] = x[40:80]  # exact copies
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def test_ivf_neighbors_probing_every_list_equal_exact_knn():
    x, k, floor = _clustered(), 6, 0.8
    sims, ids, lists = ivf_neighbors(x, k, floor, nprobe=32, nlist=32, block=512)
    C = x.astype(np.float64) @ x.T.astype(np.float64)
    np.fill_diagonal(C, -np.inf)
    for i in range(len(x)):
        truth = np.sort(C[i])[::-1][:k]
        truth = truth[truth >= floor]
        got = ids[i][ids[i] >= 0]
        assert i not in got and len(set(got.tolist())) == len(got)
        np.testing.assert_allclose(np.sort(sims[i][ids[i] >= 0])[::-1], truth, atol=1e-5)
        np.testing.assert_allclose(sims[i][ids[i] >= 0], C[i, got], atol=1e-5)
    assert lists.shape == (len(x),) and lists.min() >= 0 and lists.max() < 32


def test_ivf_neighbors_few_probes_find_close_pairs():
    x, k, floor = _clustered(), 6, 0.9
    sims, ids, _ = ivf_neighbors(x, k, floor, nprobe=2, nlist=64, block=512)
    C = x @ x.T
    np.fill_diagonal(C, -np.inf)
    ok = ids >= 0
    np.testing.assert_allclose(sims[ok], C[np.nonzero(ok)[0], ids[ok]], atol=1e-5)
    found = {(min(i, j), max(i, j)) for i, j in zip(np.nonzero(ok)[0].tolist(), ids[ok].tolist(), strict=True)}
    top = np.argsort(-C, axis=1)[:, :k]
    truth = {(min(i, j), max(i, j)) for i in range(len(x)) for j in top[i].tolist() if C[i, j] >= floor}
    assert len(found & truth) >= 0.99 * len(truth)


def test_union_and_groups_equal_brute_force_components():
    rng = np.random.default_rng(3)
    n = 2000
    pairs = np.sort(rng.integers(n, size=(1500, 2)), axis=1)
    pairs = pairs[pairs[:, 0] != pairs[:, 1]]
    hashes = rng.integers(0, 255, size=(n, 16)).astype(np.uint8)
    hashes[rng.integers(n, size=200)] = hashes[rng.integers(n, size=200)]
    parent = np.arange(n)
    for s in range(0, len(pairs), 97):  # in chunks, as the confirmation joins them
        _union(parent, pairs[s:s + 97, 0], pairs[s:s + 97, 1])
    groups = _groups(parent, pairs, np.linspace(0.9, 1.0, len(pairs)), hashes)
    same = [(i, j) for i in range(n) for j in np.nonzero((hashes == hashes[i]).all(1))[0].tolist() if j > i]
    assert [g.ids for g in groups] == _components(n, [*pairs.tolist(), *same])
    dup = np.unique(hashes, axis=0, return_inverse=True, return_counts=True)
    repeated = dup[2][dup[1].ravel()] > 1
    pair_of = {i for p in pairs.tolist() for i in p}
    for g in groups:
        ex, near = bool(repeated[g.ids].any()), bool(pair_of & set(g.ids))
        assert g.kind == {(True, False): "exact", (False, True): "near", (True, True): "exact+near"}[ex, near]
        assert (g.min_cosine is None) == (not near)


def test_dedup_threshold_one_groups_only_identical_tokens(dup_index):
    out, _ = dup_index
    res = find_duplicates(out, DedupConfig(threshold=1.0, sketch=0))
    # identical tokens give bit-identical rows: their cosine is 1 up to rounding, so "exact" or "exact+near"
    assert sorted(g.ids for g in res.groups) == [[3, 30, 31], [17, 32]]
    assert all(g.kind.startswith("exact") for g in res.groups)


def test_outliers_rank_by_brute_force_self_influence(dup_index):
    out, _ = dup_index
    with Store(out) as st:
        rows = st.read_rows(np.arange(len(st)))
        ntok = st.column("num_tokens")
    sq = sum((rows[n].astype(np.float64) ** 2).sum(1) for n in rows)
    r = rank_outliers(out, "graddot")
    np.testing.assert_allclose(r.self_influence, sq, rtol=1e-5)
    np.testing.assert_allclose(r.per_token, sq / ntok, rtol=1e-5)
    assert r.order()[0] == int(np.argmax(sq)) and r.order("per_token")[0] == int(np.argmax(sq / ntok))
    ek = rank_outliers(out, "ekfac")
    P = load_preconditioner(out, "ekfac")
    import torch

    brute = sum((P.apply(n, torch.from_numpy(rows[n].astype(np.float64)), power=-1.0).numpy()
                 * rows[n]).sum(1) for n in rows)
    np.testing.assert_allclose(ek.self_influence, brute, rtol=1e-4)
    with pytest.raises(ValueError, match="self-influence"):
        rank_outliers(out, "cosine")


def test_detection_curve_counts_flagged_in_each_prefix():
    order = np.array([4, 2, 0, 1, 3, 5, 6, 7, 8, 9])
    flagged = np.zeros(10, bool)
    flagged[[4, 0, 9]] = True
    assert detection_curve(order, flagged, [0.1, 0.3, 1.0]) == pytest.approx([1 / 3, 2 / 3, 1.0])


def test_cli_outliers_and_dedup(dup_index, tmp_path):
    out, texts = dup_index
    r = CliRunner().invoke(main, ["outliers", str(out), "--method", "ekfac", "--top", "3", "--json"])
    assert r.exit_code == 0, r.output
    rows = [json.loads(line) for line in r.output.splitlines() if line.startswith("{")]
    assert [x["rank"] for x in rows] == [1, 2, 3]
    assert rows[0]["id"] == int(rank_outliers(out, "ekfac").order()[0])
    assert rows[0]["text"] == texts[rows[0]["id"]]
    r = CliRunner().invoke(main, ["outliers", str(out), "--top", "2"])
    assert r.exit_code == 0 and "self-influence" in r.output
    g = tmp_path / "groups.jsonl"
    r = CliRunner().invoke(main, ["dedup", str(out), "--out", str(g), "--threshold", "0.999", "--quiet"])
    assert r.exit_code == 0, r.output
    groups = [json.loads(line) for line in g.read_text().splitlines()]
    first = next(x for x in groups if x["ids"][0] == 3)
    assert first["keep"] == 3 and set(first["drop"]) >= {30, 31} and first["texts"][0] == texts[3]
    r = CliRunner().invoke(main, ["dedup", str(out), "--out", str(g), "--threshold", "2"])
    assert r.exit_code != 0 and "Error" in r.output and "threshold" in r.output
