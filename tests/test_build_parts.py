"""``gradindex build --parts P`` (gradindex.index.build_parts) writes the sharded index that ``gradindex split`` makes
of the same build: the same store rows, fits and tiers, every query's top 10 equal; in one process and under
torchrun (gloo, 2 CPU ranks); a killed build resumes; bad input is refused naming the fix."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from gradindex.checksum import read_checksums
from gradindex.cli import main
from gradindex.index.sharded import SHARDS_FILE, read_sharded
from gradindex.query.sharded import ShardedQueryEngine
from gradindex.spec.layout import SPLIT_PLAN, UNSPLIT_DIR
from gradindex.spec.manifest import read_manifest
from tests.conftest import make_texts
from tests.test_distributed import torchrun
from tests.test_sharded import _same

QUERIES = make_texts(6, seed=11, max_words=12)


def run(*args, code: int = 0) -> str:
    res = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    assert res.exit_code == code if code == 0 else res.exit_code != 0, res.output
    return res.output


def build_args(gpt2_dir, data) -> list:
    return ["build", gpt2_dir, data, "--shard-size", "16", "--max-length", "48", "--device", "cpu", "--quiet"]


@pytest.fixture(scope="module")
def builds(gpt2_dir, text_jsonl, tmp_path_factory):
    """``(plain build split into 2, the same build with --parts 2)``: 40 examples in 3 store files of 16."""
    d = tmp_path_factory.mktemp("parts")
    run(*build_args(gpt2_dir, text_jsonl), "--out", d / "one")
    run("split", d / "one", "--shards", "2", "--out", d / "split")
    out = run(*build_args(gpt2_dir, text_jsonl), "--out", d / "built", "--parts", "2")
    assert "2 parts: part-00000 rows 0-15, part-00001 rows 16-39" in out, out
    return read_sharded(d / "split"), read_sharded(d / "built"), d


def _stored(part) -> dict:
    """A part's recorded hashes of its store files, fits and basis (the tier's files are its own build's)."""
    return {n: e["blake2b"] for n, e in read_checksums(part).items() if not n.startswith("faiss")}


def test_parts_equal_the_split_of_the_same_build(gpt2_dir, builds):
    split, built, d = builds
    assert [(p.first, p.stop) for p in built.parts] == [(p.first, p.stop) for p in split.parts] == [(0, 16), (16, 40)]
    assert not (d / "built" / UNSPLIT_DIR).exists() and not (d / "built" / SPLIT_PLAN).exists()
    for a, b in zip(split.parts, built.parts, strict=True):
        assert _stored(a.dir) == _stored(b.dir)  # the same store bytes (moved, renumbered), fits and basis
        ma, mb = read_manifest(a.dir), read_manifest(b.dir)
        assert (ma["build"], ma["counts"], ma["shard"]) == (mb["build"], mb["counts"], mb["shard"])
        assert ma["index"]["factories"] == mb["index"]["factories"]
    with ShardedQueryEngine(split.dir, gpt2_dir, device="cpu") as x, \
            ShardedQueryEngine(built.dir, gpt2_dir, device="cpu") as y:
        for method in (None, "ekfac-selfnorm"):
            _same(y.query_batch(QUERIES, k=10, lowest=3, method=method),
                  x.query_batch(QUERIES, k=10, lowest=3, method=method))
    assert "intact" in run("verify", built.dir)
    assert "sharded: 2 parts" in run("info", built.dir)


def test_refusals(gpt2_dir, text_jsonl, builds, tmp_path):
    split, built, d = builds
    args = build_args(gpt2_dir, text_jsonl)
    assert "1 to 40 parts" in run(*args, "--out", tmp_path / "x", "--parts", "41", code=1)
    assert "positive count or 'ranks'" in run(*args, "--out", tmp_path / "x", "--parts", "two", code=1)
    assert "drop --no-index" in run(*args, "--out", tmp_path / "x", "--parts", "2", "--no-index", code=1)
    assert not (tmp_path / "x").exists()
    assert "complete sharded index of 2 parts" in run(*args, "--out", built.dir, "--parts", "2", code=1)
    assert "`gradindex split" in run(*args, "--out", d / "one", "--parts", "2", code=1)
    assert "resumes with its --parts" in run(*args, "--out", built.dir, code=1)  # a plain build over it


def test_killed_split_resumes_and_other_parts_are_refused(gpt2_dir, text_jsonl, builds, tmp_path, monkeypatch):
    """A build killed while it moves the store into the parts finishes with the same command (no model pass); another
    --parts is refused, naming the one to give."""
    import gradindex.index.build_parts as B

    split, _, _ = builds
    out = tmp_path / "killed"
    moved = []

    def dies(src, dst, first):
        if moved:
            raise KeyboardInterrupt
        moved.append(real(src, dst, first))

    real = B.move_shard
    monkeypatch.setattr(B, "move_shard", dies)
    args = [*build_args(gpt2_dir, text_jsonl), "--out", out]
    assert "interrupted" in run(*args, "--parts", "2", code=1)
    monkeypatch.setattr(B, "move_shard", real)
    assert json.loads((out / SPLIT_PLAN).read_text())["parts"] == 2 and not (out / SHARDS_FILE).exists()
    assert "re-run it with --parts 2" in run(*args, "--parts", "3", code=1)
    assert "(0 computed now)" in run(*args, "--parts", "2")
    sh = read_sharded(out)
    for a, b in zip(split.parts, sh.parts, strict=True):
        assert _stored(a.dir) == _stored(b.dir)


def test_killed_tier_stage_and_staging_build_resume(gpt2_dir, text_jsonl, builds, tmp_path, monkeypatch):
    """A build killed while it builds the parts' tiers finishes with the same command (the built tier kept); a
    complete staging build (as a kill after the capture leaves it) is split without a capture."""
    import gradindex.index.build_parts as B

    split, _, _ = builds
    out, real = tmp_path / "tiers", B._build_tier

    def dies(d, whole, base):
        if d.name == "part-00001":
            raise KeyboardInterrupt
        real(d, whole, base)

    monkeypatch.setattr(B, "_build_tier", dies)
    args = build_args(gpt2_dir, text_jsonl)
    assert "interrupted" in run(*args, "--out", out, "--parts", "2", code=1)
    monkeypatch.setattr(B, "_build_tier", real)
    built0 = read_manifest(out / "part-00000")["index"]
    assert "(0 computed now)" in run(*args, "--out", out, "--parts", "2")
    assert read_manifest(out / "part-00000")["index"] == built0
    staged = tmp_path / "staged"
    run(*args, "--out", staged / UNSPLIT_DIR, "--no-index")
    assert "(0 computed now)" in run(*args, "--out", staged, "--parts", "2")
    for o in (out, staged):
        sh = read_sharded(o)
        assert sh.manifest["index"]["bytes"] == sum(read_manifest(p.dir)["index"]["bytes"] for p in sh.parts)
        for a, b in zip(split.parts, sh.parts, strict=True):
            assert _stored(a.dir) == _stored(b.dir)
        with ShardedQueryEngine(split.dir, gpt2_dir, device="cpu") as x, \
                ShardedQueryEngine(sh.dir, gpt2_dir, device="cpu") as y:
            _same(y.query_batch(QUERIES, k=10), x.query_batch(QUERIES, k=10))


def test_a_tier_error_keeps_its_type(gpt2_dir, text_jsonl, tmp_path, monkeypatch):
    """A part's tier that fails on bad input is one ``Error:`` line naming it, as in a plain build (it was wrapped in
    a ``RuntimeError``: a traceback)."""
    import gradindex.index.build_parts as B
    from tests.conftest import refused

    def bad(d, whole, base):
        raise ValueError(f"the tier of {d.name} cannot be built; give --index-type store")

    monkeypatch.setattr(B, "_build_tier", bad)
    res = CliRunner().invoke(main, [str(a) for a in build_args(gpt2_dir, text_jsonl)] + ["--out", str(tmp_path / "t"),
                                                                                         "--parts", "2"])
    refused(res.exit_code, res.output, None, "part-00000 cannot be built", "--index-type store",
            skip=("plan:", "warning:"))


def test_more_parts_than_files(gpt2_dir, text_jsonl, builds, tmp_path, caplog):
    """--parts 4 over 3 store files cuts them where the split cuts them (those rows copied, not moved)."""
    split, _, d = builds
    run("split", d / "one", "--shards", "4", "--out", tmp_path / "split4")
    run(*build_args(gpt2_dir, text_jsonl), "--out", tmp_path / "b4", "--parts", "4")
    assert "--shard-size 10 or less moves every file" in caplog.text
    a, b = read_sharded(tmp_path / "split4"), read_sharded(tmp_path / "b4")
    assert [(p.first, p.stop) for p in a.parts] == [(p.first, p.stop) for p in b.parts] == [
        (0, 10), (10, 20), (20, 30), (30, 40)]
    for x, y in zip(a.parts, b.parts, strict=True):
        assert _stored(x.dir) == _stored(y.dir)
    with ShardedQueryEngine(a.dir, gpt2_dir, device="cpu") as x, ShardedQueryEngine(b.dir, gpt2_dir,
                                                                                     device="cpu") as y:
        _same(y.query_batch(QUERIES, k=10), x.query_batch(QUERIES, k=10))


@pytest.mark.slow
def test_torchrun_build_parts_queries_as_the_one_process_index(gpt2_dir, text_jsonl, builds, tmp_path):
    """2 gloo ranks build --parts ranks (each captures its share, each builds its part's tier); the query, under
    torchrun and in one process, prints what the one-process unsplit index prints."""
    _, _, d = builds
    out = tmp_path / "tr"
    printed = torchrun("-m", "gradindex", *map(str, build_args(gpt2_dir, text_jsonl)), "--out", str(out),
                       "--parts", "ranks")
    assert printed.count("2 parts: part-00000 rows 0-15, part-00001 rows 16-39") == 1, printed
    assert read_sharded(out).manifest["counts"]["ranks"] == 2
    q = [a for t in QUERIES[:4] for a in ("--text", t)] + ["-k", "10", "--lowest", "2", "--device", "cpu"]
    one = run("query", d / "one", *q)
    assert run("query", out, *q) == one
    assert torchrun("-m", "gradindex", "query", str(out), *q) == one
