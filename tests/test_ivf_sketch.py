"""The ``ivf-sketch`` tier: the sketch's codes in inverted lists. Over a few thousand real rows its candidates hold the
build's recall target of the exhaustive sketch's and the store scan's top 10, with every list probed they are the
exhaustive sketch's, it is built and queried through the CLI and ``QueryEngine``, costed by the plan and chosen by
``auto`` only beyond the exhaustive sketch's range (indices built before open unchanged)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import make_texts

from gradindex.capture import ProjectionSpec
from gradindex.cli import main
from gradindex.data import records_from_texts, tokenize_records
from gradindex.index import IndexConfig, build_indices
from gradindex.index.sketch import SKETCH_BYTES
from gradindex.index.tiers import CandidateRequest, RowShape, choose_kind, lookup_cost, make_tier, tier_class
from gradindex.index.tiers import ivf_sketch as ivf
from gradindex.model import load_causal_lm
from gradindex.pipeline import BuildConfig, build_index
from gradindex.query import QueryEngine
from gradindex.spec.manifest import index_args, read_manifest

N = 3000
SKETCH = 132  # 128 int8 numbers of rows of 8 x 72
QUERIES = make_texts(24, seed=11)


@pytest.fixture(scope="module")
def rows_index(tmp_path_factory, gpt2_dir):
    """3,000 real captured rows of the tiny GPT-2 (8 layers of 9x8, float32), no index yet."""
    model, tok = load_causal_lm(gpt2_dir, device="cpu")
    data = tokenize_records(records_from_texts(make_texts(N, seed=5)), tok, 32)
    out = tmp_path_factory.mktemp("ivf") / "index"
    cfg = BuildConfig.raw(projection=ProjectionSpec(k_a=9, k_g=8, seed=3), shard_size=1024, max_length=32)
    build_index(model, tok, data, out, cfg, model_id=str(gpt2_dir), progress=False)
    return out


def _copy(src, dst):
    shutil.copytree(src, dst)
    shutil.rmtree(dst / "faiss", ignore_errors=True)
    return dst


QUERY_RECALL = 0.95
"""The recall of the tests' queries (texts of another seed) the build's default target gives."""


@pytest.fixture(scope="module")
def built(rows_index, tmp_path_factory):
    """The same rows indexed by the exhaustive sketch, the IVF sketch and the store scan."""
    base = tmp_path_factory.mktemp("tiers")
    out = {}
    for name, factory in (("sketch", "sketch"), ("ivf", "ivf-sketch"), ("store", "store")):
        out[name] = _copy(rows_index, base / name)
        build_indices(out[name], IndexConfig(factory=factory, sketch_bytes=SKETCH), progress=False)
    with QueryEngine(out["ivf"], device="cpu") as e:
        grads, _, _ = e.gradients(e.tokenize(QUERIES))
    out["grads"] = {n: v.numpy() for n, v in grads.items()}
    return out


def _first(d, grads, c, **kw):
    with QueryEngine(d, device="cpu") as e:
        req = CandidateRequest(list(e.layers), grads, {}, 10, candidates=c, **kw)
        return e.indices.tier.first_stage(req, c), e.indices


def _top(d, grads, **kw):
    with QueryEngine(d, device="cpu") as e:
        return [[h.id for h in r.hits] for r in e.search(grads, k=10, texts=False, **kw)]


def _recall(got, want) -> float:
    return float(np.mean([len(set(g) & set(w)) / len(w) for g, w in zip(got, want, strict=True)]))


def test_the_build_measures_its_recall_and_the_queries_meet_it(built):
    meta = json.loads((built["ivf"] / "faiss" / "index.json").read_text())
    rec = meta["ivf"]
    assert meta["kind"] == "ivf-sketch" and rec["nlist"] == ivf.default_nlist(N) == 219
    assert rec["target"] == ivf.RECALL_TARGET and rec["sample_target"] == ivf.RECALL_TARGET + ivf.SAMPLE_MARGIN
    assert rec["recall"] >= rec["sample_target"] and 1 <= rec["nprobe"] < rec["nlist"]
    curve = [rec["recall_by_nprobe"][p] for p in sorted(rec["recall_by_nprobe"], key=int)]
    assert rec["queries"] == ivf.PROBE_QUERIES and curve == sorted(curve)
    assert (built["ivf"] / "faiss" / ivf.LISTS).exists() and (built["ivf"] / "faiss" / ivf.CENTROIDS).exists()
    g = built["grads"]
    # first stage, 10 candidates: the IVF tier's top 10 of the sketch estimates against the exhaustive sketch's
    mine, idx = _first(built["ivf"], g, 10)
    theirs, _ = _first(built["sketch"], g, 10)
    assert _recall(mine, theirs) >= QUERY_RECALL
    scanned = [len(idx.tier.sketch.probe(y, rec["nprobe"], 10)) for y in idx.tier.sketch.sketch.apply(g)]
    assert max(scanned) < 0.6 * N  # a share of the rows scored, not all (0.34-0.49 here)
    # end to end (default C, exact re-rank): the store scan's top 10, the exhaustive sketch's
    store, sketch, mine = _top(built["store"], g), _top(built["sketch"], g), _top(built["ivf"], g)
    # (unseen queries get less than the build's sample rows: 0.96 here; on the benchmark's real rows 0.95 of the
    # sketch tier's top 10 for a 0.97 target, benchmarks/results/lookup-ivf.json)
    assert _recall(mine, store) >= QUERY_RECALL and _recall(mine, sketch) >= QUERY_RECALL
    small = _top(built["ivf"], g, candidates=20)
    assert _recall(small, _top(built["sketch"], g, candidates=20)) >= 0.9


def test_the_build_calibrates_on_the_rankings_the_search_uses(built):
    """The chosen lists hold the sample target of each held-out sample row's top :data:`ivf.TRUTH_K` under both the
    raw sketch product and the direction (the default ``-selfnorm`` ranking: score / row norm), the row itself
    not counted, brute force here; the raw top 10 alone (the calibration before) chose fewer lists than that."""
    folder = built["ivf"] / "faiss"
    meta = json.loads((folder / "index.json").read_text())
    rec = meta["ivf"]
    assert rec["truth"] == {"top": ivf.TRUTH_K, "rankings": ["raw", "direction"]}
    codes = ivf._Codes(folder, meta)
    probe, _ = ivf._samples(N, rec["nlist"], 0, 0, codes.m)
    y, every = codes.read(probe), codes.block(0, N)
    lists, means = np.load(folder / ivf.LISTS), np.load(folder / ivf.CENTROIDS)
    rank = np.argsort(np.argsort(-(y @ means.T), axis=1, kind="stable"), axis=1)  # [P, nlist] each list's rank
    norm = np.sqrt(np.load(folder / "norms.npy").sum(axis=1, dtype=np.float64))
    held = {}
    for name, f in (("raw", 1.0), ("direction", 1 / norm)):
        s = (y @ every.T) * f
        s[np.arange(len(probe)), probe] = -np.inf  # not itself
        for k in (10, ivf.TRUTH_K):
            top = np.argsort(-s, axis=1, kind="stable")[:, :k]
            assert not (top == probe[:, None]).any()
            held[name, k] = np.take_along_axis(rank, lists[top], 1)  # [P, k] the rank of each one's list
    for name in ("raw", "direction"):
        assert np.mean(held[name, ivf.TRUTH_K] < rec["nprobe"]) >= rec["sample_target"]
    before = np.sort(held["raw", 10].ravel())[int(np.ceil(0.97 * held["raw", 10].size)) - 1] + 1
    assert before < rec["nprobe"]


def test_choose_nprobe_serves_every_ranking():
    lists = np.arange(6)  # row i in list i
    scores = -np.arange(6.0)[None, :].repeat(2, 0)  # lists ranked 0, 1, ... for both queries
    a = np.array([[0, 1], [0, 1]])  # ranking a: its rows in lists 0-1
    b = np.array([[0, 4], [1, 5]])  # ranking b: lists up to 5
    assert ivf.choose_nprobe(scores, lists, a, 1.0)[:2] == (2, 1.0)
    assert ivf.choose_nprobe(scores, lists, np.stack([a, b]), 1.0)[:2] == (6, 1.0)
    nprobe, recall, curve = ivf.choose_nprobe(scores, lists, np.stack([a, b]), 0.75)
    assert (nprobe, recall) == (5, 0.75) and curve["4"] == 0.5  # the least of the two rankings' recalls
    f = ivf.rankings(np.array([4.0, 0.0, 1.0]), normalized=False)
    np.testing.assert_allclose(f, [[1, 1, 1], [0.5, 0, 1]])
    np.testing.assert_allclose(ivf.rankings(np.array([4.0, 1.0]), normalized=True), [[2, 1], [1, 1]])


def test_every_list_probed_gives_the_exhaustive_sketch_candidates(built):
    g = built["grads"]
    nlist = json.loads((built["ivf"] / "faiss" / "index.json").read_text())["ivf"]["nlist"]
    for c, kw in ((40, {}), (25, {"lowest": 5}), (30, {"cosine": True})):
        mine, idx = _first(built["ivf"], g, c, nprobe=nlist, **kw)
        theirs, _ = _first(built["sketch"], g, c, **kw)
        assert [m.tolist() for m in mine] == [t.tolist() for t in theirs], kw
    sk = idx.tier.sketch
    y = sk.sketch.apply(g)
    with QueryEngine(built["sketch"], device="cpu") as e:
        np.testing.assert_array_equal(sk.scores(y), e.indices.sketch.scores(y))  # the same numbers, example order
    assert sorted(sk.order.tolist()) == list(range(N))
    assert _top(built["ivf"], g, nprobe=nlist, candidates=60) == _top(built["sketch"], g, candidates=60)


def test_factory_strings_cli_and_plan(rows_index, built, gpt2_dir, tmp_path):
    from gradindex.pipeline import BuildConfig as PlanConfig
    from gradindex.plan import plan_build

    assert tier_class("ivf-sketch") is tier_class("IVF64,sketch") is ivf.IvfSketchTier
    assert tier_class("IVF64,Flat").name == "faiss" and tier_class("sketch").name == "sketch"
    d = _copy(rows_index, tmp_path / "cli")
    r = CliRunner()
    res = r.invoke(main, ["index", str(d), "--index-type", "IVF64,sketch", "--sketch-bytes", str(SKETCH), "--quiet"])
    assert res.exit_code == 0, res.output
    assert "in 64 inverted lists" in res.output
    assert index_args(read_manifest(d))[:2] == ["--index-type", "ivf64,sketch"]  # the build command a repair prints
    res = r.invoke(main, ["query", str(d), "--text", QUERIES[0], "-k", "3", "--json", "--device", "cpu"])
    assert res.exit_code == 0, res.output
    assert len(json.loads(next(x for x in res.output.splitlines() if x.startswith("[")))) == 3
    res = r.invoke(main, ["index", str(d), "--index-type", f"IVF{N + 1},sketch", "--quiet"])
    assert res.exit_code != 0 and "more than the 3000 examples" in res.output
    model, _ = load_causal_lm(gpt2_dir, device="cpu")
    plan = plan_build(model, PlanConfig(shard_size=16, max_length=48), 10**7, factory="ivf-sketch")
    ex = lookup_cost(10**7, sum(lp.numbers for lp in plan.layers), plan.storage, "sketch")
    assert plan.lookup.kind == "ivf-sketch" and plan.lookup.seconds < 0.7 * ex.seconds
    assert plan.index_bytes > 10**7 * (SKETCH_BYTES + 4)  # the sketch, its list ids, the centroids, the norms


def test_auto_picks_it_only_beyond_the_exhaustive_sketch(rows_index, tmp_path):
    assert choose_kind(1_000_000, 400_000, "int4", ram_bytes=16 << 30) == "sketch"  # today's choices stand
    assert choose_kind(100_000, 25_000, "int4", ram_bytes=16 << 30) == "sketch"
    assert choose_kind(10_000, 25_000, "int4", ram_bytes=16 << 30) == "store"
    assert choose_kind(2_000_000, 25_000, "int4", ram_bytes=16 << 30) == "ivf-sketch"
    assert choose_kind(10**7, 25_000, "int4", ram_bytes=64 << 30) == "ivf-sketch"
    assert choose_kind(10**7, 25_000, "int4", ram_bytes=16 << 30) == "sketch"  # its codes miss half the RAM
    # the estimate scans 0.6 of the rows (what the benchmark's builds chose), the exact re-rank's C the same
    ivf_cost, sketch_cost = (lookup_cost(10**7, 25_000, "int4", k, layers=8) for k in ("ivf-sketch", "sketch"))
    assert ivf_cost.seconds < 0.7 * sketch_cost.seconds and ivf_cost.scanned_bytes < 0.7 * sketch_cost.scanned_bytes
    rows = RowShape(10**7, 25_000, "int4")
    assert make_tier(IndexConfig(sketch_bytes=516), rows, ram_bytes=64 << 30).name == "ivf-sketch"
    d = _copy(rows_index, tmp_path / "old")
    build_indices(d, IndexConfig(factory="sketch", sketch_bytes=SKETCH), progress=False)  # an index built before
    before = (d / "faiss" / "index.json").read_text()
    assert build_indices(d, IndexConfig(factory="sketch", sketch_bytes=SKETCH), progress=False).up_to_date
    with QueryEngine(d, device="cpu") as e:
        assert e.indices.kind == "sketch"
    assert (d / "faiss" / "index.json").read_text() == before
