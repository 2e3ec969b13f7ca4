"""A sharded index (gradindex.index.sharded) answers as the one index it was split from: in one process, and under
torchrun with one part a rank (gloo, 2 CPU ranks); split then merge gives back the store byte for byte."""

from __future__ import annotations

import filecmp
import json
import shutil

import numpy as np
import pytest
from click.testing import CliRunner

from gradindex.checksum import read_checksums
from gradindex.cli import main
from gradindex.index.sharded import SHARDS_FILE, is_sharded, merge_index, read_sharded, split_index
from gradindex.query import QueryEngine
from gradindex.query.sharded import ShardedQueryEngine
from gradindex.spec.manifest import read_manifest, write_manifest
from tests.conftest import make_texts
from tests.test_distributed import torchrun

QUERIES = make_texts(6, seed=11, max_words=12)


def run(*args) -> str:
    res = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return res.stdout


def test_exact_stage_over_three_parts_equals_the_index(gpt2_dir, default_index, tmp_path):
    """The full-space fit is linked into every part; the exact stage reads candidates' tokens from every part."""
    fx = tmp_path / "fx"
    shutil.copytree(default_index, fx)
    run("precondition", fx, "--method", "ekfac", "--space", "full", "--device", "cpu")
    sh = split_index(fx, tmp_path / "fx3", 3)
    assert (sh.parts[2].dir / "precond" / "ekfac-full.h5").stat().st_ino == (fx / "precond" / "ekfac-full.h5").stat(
    ).st_ino
    with QueryEngine(fx, gpt2_dir, device="cpu") as one, ShardedQueryEngine(sh.dir, gpt2_dir, device="cpu") as many:
        a = many.query_batch(QUERIES[:3], k=5, method="ekfac", rerank_full=8)
        b = one.query_batch(QUERIES[:3], k=5, method="ekfac", rerank_full=8)
    _same(a, b)
    assert [h.full_score for r in a for h in r.hits] == [h.full_score for r in b for h in r.hits]
    assert a[0].stage == "full-space re-rank of the top 8"


def _same(a, b, exact: bool = True) -> None:
    """Two answers to the same queries: ids and texts exactly; scores to the last bits, or to float tolerance."""
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        for hx, hy in ((x.hits, y.hits), (x.lowest, y.lowest)):
            assert [h.id for h in hx] == [h.id for h in hy]
            assert [h.text for h in hx] == [h.text for h in hy]
            sx, sy = [h.score for h in hx], [h.score for h in hy]
            if exact:  # the same sums; a part's smaller matmul may round the last bit differently (CPU-dependent)
                np.testing.assert_allclose(sx, sy, rtol=1e-13, atol=0)
            else:
                np.testing.assert_allclose(sx, sy, rtol=1e-6, atol=1e-9)
        assert (x.method, x.damping, x.layers, x.stage) == (y.method, y.damping, y.layers, y.stage)


@pytest.fixture(scope="module")
def sharded(default_index, tmp_path_factory):
    return split_index(default_index, tmp_path_factory.mktemp("sharded") / "two", 2)


def test_split_parts_and_merge_round_trip_bitwise(default_index, sharded, tmp_path):
    whole = read_manifest(default_index)
    assert is_sharded(sharded.dir) and not is_sharded(default_index)
    assert [(p.first, p.stop) for p in sharded.parts] == [(0, 16), (16, 40)]  # 3 store files of 16: 1 + 2
    part = read_manifest(sharded.parts[1].dir)
    assert part["build"] == whole["build"] and part["counts"]["examples"] == 24
    assert part["shard"] == {"part": 1, "parts": 2, "first": 16, "stop": 40, "examples": 40,
                             "files": [[1, 0, 16, 16], [2, 0, 8, 8]]}  # (whole files: [file, first, stop, rows])
    merged = merge_index(sharded.dir, tmp_path / "merged")
    assert read_manifest(merged) == whole
    names = sorted(p.name for p in (default_index / "store").iterdir())
    assert names and names == sorted(p.name for p in (merged / "store").iterdir())
    for n in names:
        assert filecmp.cmp(default_index / "store" / n, merged / "store" / n, shallow=False), n
    a, b = read_checksums(default_index), read_checksums(merged)
    assert {n: e for n, e in a.items() if n.startswith("store/")} == {n: e for n, e in b.items()
                                                                       if n.startswith("store/")}


def test_cli_merge_reads_the_sharded_index_once(sharded, tmp_path, monkeypatch):
    """``gradindex merge`` reads ``shards.json`` and checks every part's manifest once (it used to twice: once for
    the count it prints)."""
    import gradindex.index.sharded as S

    calls = []
    monkeypatch.setattr(S, "read_sharded", lambda d: calls.append(d) or read_sharded(d))
    assert "merged 2 parts" in run("merge", sharded.dir, "--out", tmp_path / "back")
    assert len(calls) == 1 and read_manifest(tmp_path / "back") == sharded.manifest


def test_sharded_engine_in_one_process_equals_the_index(gpt2_dir, default_index, sharded):
    with QueryEngine(default_index, gpt2_dir, device="cpu") as one, \
            ShardedQueryEngine(sharded.dir, gpt2_dir, device="cpu") as many:
        assert many.n == one.n == 40
        for method in (None, "ekfac-selfnorm"):  # (selfnorm: each part's cut of the fit's self-influence)
            _same(many.query_batch(QUERIES, k=10, lowest=3, method=method),
                  one.query_batch(QUERIES, k=10, lowest=3, method=method))
        np.testing.assert_allclose(many.scores(QUERIES), one.scores(QUERIES), rtol=1e-13, atol=0)


def test_sketch_tier_parts_equal_the_index(gpt2_dir, default_index, tmp_path):
    from gradindex.index import IndexConfig, build_indices

    sk = tmp_path / "sketch"
    shutil.copytree(default_index, sk)
    build_indices(sk, IndexConfig(factory="sketch"), progress=False, force=True)
    sh = split_index(sk, tmp_path / "sk2", 3)
    assert read_manifest(sh.parts[2].dir)["index"]["kind"] == "sketch"
    with QueryEngine(sk, gpt2_dir, device="cpu") as one, ShardedQueryEngine(sh.dir, gpt2_dir, device="cpu") as many:
        _same(many.query_batch(QUERIES, k=10), one.query_batch(QUERIES, k=10), exact=False)


def test_sketch_parts_rerank_their_share_of_the_candidates(gpt2_dir, default_index, tmp_path, monkeypatch):
    """Each part of a sketch index hands its share of the whole index's C to the exact re-rank (its rows' share plus
    3 standard deviations of a binomial widened for runs of similar rows, at least k, at most its rows);
    share_candidates=False: C each, as before."""
    from gradindex.index import IndexConfig, build_indices
    from gradindex.index.tiers.sketch import SketchTier
    from gradindex.query.sharded import part_candidates

    assert [part_candidates(500, n, 2 * n, 10) for n in (50000, 150000)] == [385, 385]  # (docs/scaling.md)
    assert part_candidates(500, 75000, 300000, 10) == 242
    assert part_candidates(500, 10, 40, 10) == 10 and part_candidates(20, 30, 40, 25) == 30
    assert part_candidates(4, 30000, 40000, 200) == 200
    sk = tmp_path / "sketch"
    shutil.copytree(default_index, sk)
    build_indices(sk, IndexConfig(factory="sketch"), progress=False, force=True)
    sh = split_index(sk, tmp_path / "sk2", 2)
    asked, real = [], SketchTier.candidates

    def spy(self, req):
        got = real(self, req)
        asked.append((self.source.n, req.candidates, {len(c) for c in got.ids}))
        return got

    monkeypatch.setattr(SketchTier, "candidates", spy)
    with ShardedQueryEngine(sh.dir, gpt2_dir, device="cpu") as many:
        many.query_batch(QUERIES[:2], k=3, candidates=8)  # (so few that the margin takes most of a part)
        rows = [p.stop - p.first for p in sh.parts]
        share = [part_candidates(8, n, 40, 3) for n in rows]
        assert rows == [16, 24] and share == [16, 22] and asked == [(n, c, {c}) for n, c in zip(rows, share)]
        asked.clear()
        many.share_candidates = False
        many.query_batch(QUERIES[:2], k=3, candidates=8)
        assert asked == [(n, 8, {8}) for n in rows]


def test_refusals(default_index, sharded, tmp_path):
    with pytest.raises(ValueError, match="splits into 1 to 40 parts, not 41"):
        split_index(default_index, tmp_path / "many", 41)
    with pytest.raises(FileExistsError, match="not an empty directory"):
        split_index(default_index, sharded.dir, 2)
    with pytest.raises(ValueError, match="already a sharded index"):
        split_index(sharded.dir, tmp_path / "again", 2)
    with pytest.raises(FileNotFoundError, match="not a sharded index"):
        merge_index(default_index, tmp_path / "m")
    with pytest.raises(ValueError, match="run at most 2 ranks"):
        sharded.owned(0, 3)
    assert (sharded.owned(0, 1), sharded.owned(1, 2)) == ([0, 1], [1])
    # a part of another build (another generation) is refused, naming it
    bad = tmp_path / "bad"
    shutil.copytree(sharded.dir, bad)
    m = read_manifest(bad / "part-00001")
    m["generation"] = "another"
    write_manifest(bad / "part-00001", m)
    with pytest.raises(Exception, match="part-00001.*another build"):
        read_sharded(bad)
    doc = json.loads((bad / SHARDS_FILE).read_text())
    doc["parts"][1]["first"] = 15
    (bad / SHARDS_FILE).write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=r"part 1 holds rows \[15, 40\), expected them to start at 16"):
        read_sharded(bad)


@pytest.mark.slow
def test_cli_split_merge_and_torchrun_query_print_as_one_index(gpt2_dir, default_index, tmp_path):
    out = run("split", default_index, "--shards", "2", "--out", tmp_path / "sh")
    assert "into 2 parts" in out and "part-00001 rows 16-39" in out, out
    assert "merged 2 parts" in run("merge", tmp_path / "sh", "--out", tmp_path / "back")
    q = [a for t in QUERIES[:4] for a in ("--text", t)] + ["-k", "10", "--lowest", "2", "--device", "cpu"]
    one = run("query", default_index, *q)
    assert "most negative" in one
    assert run("query", tmp_path / "back", *q) == one
    assert run("query", tmp_path / "sh", *q) == one  # one process, every part in turn
    assert torchrun("-m", "gradindex", "query", str(tmp_path / "sh"), *q) == one  # 2 ranks (gloo), rank 0 prints


def test_cli_refined_query_over_parts_prints_as_one_index(default_index, sharded):
    """`query SHARDED --refine cg` failed with "not enough values to unpack" (the routed call was given the raw
    --refine options)."""
    q = ["--text", QUERIES[0], "-k", "5", "--device", "cpu", "--method", "ekfac", "--refine", "cg",
         "--refine-steps", "2"]
    one = run("query", default_index, *q)
    assert one != run("query", default_index, *q[:-4])  # (the refinement moves the scores)
    assert run("query", sharded.dir, *q) == one


@pytest.mark.parametrize("cmd", [["explain", "--text", "a cat", "--id", "3"], ["outliers"], ["dedup", "--out"]])
def test_commands_that_take_one_index_name_the_sharded_index_and_the_merge(sharded, cmd, tmp_path):
    """They said "not a gradindex index (no manifest.json); build one"."""
    more = [str(tmp_path / "d.jsonl")] if cmd[-1] == "--out" else []
    r = CliRunner().invoke(main, [cmd[0], str(sharded.dir), *cmd[1:], *more])
    assert r.exit_code != 0 and "is a sharded index" in r.output and "gradindex merge" in r.output, r.output
