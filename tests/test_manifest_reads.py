"""``manifest.json`` is read once per process per index: each command reads the file once, a build
that writes it reads it no more, and an open index (the query engine) reads it no more after opening.

Each command runs in this process (CliRunner) after :func:`forget_manifests`, as a fresh process
would; :func:`manifest_reads` counts file reads (and, with ``calls=True``, calls of read_manifest).
These numbers fail when a stage re-reads the file by path (e.g. a write that did not refresh the
kept copy, or a reader that bypasses :func:`read_manifest`).
"""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from gradindex.cli import main
from gradindex.spec.layout import IndexLayout
from gradindex.spec.manifest import Manifest, forget_manifests, manifest_reads, read_manifest, write_manifest


def reads(*args) -> int:
    """File reads of ``manifest.json`` by one CLI command run as a fresh process would."""
    forget_manifests()
    before = manifest_reads()
    res = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return manifest_reads() - before


@pytest.fixture(scope="module")
def raw_index(tmp_path_factory, gpt2_dir, text_jsonl):
    out = tmp_path_factory.mktemp("reads") / "raw"
    assert reads("build", gpt2_dir, text_jsonl, "--out", out, "--projection", "4", "--precondition", "none",
                 "--transcode", "none", "--no-index", "--device", "cpu", "--quiet") == 0  # it wrote it: no read
    return out


def test_every_command_reads_the_manifest_once(default_index, raw_index, tmp_path):
    assert reads("info", default_index) == 1
    assert reads("verify", default_index) == 1
    assert reads("query", default_index, "--text", "the cat sat", "-k", "3", "--device", "cpu") == 1
    assert reads("explain", default_index, "--text", "the cat sat", "--id", "0", "--device", "cpu") == 1
    assert reads("outliers", default_index) == 1
    assert reads("precondition", raw_index, "--method", "ekfac") == 1  # reads, fits, writes: one read
    assert reads("compact", raw_index, "--out", tmp_path / "compact") == 1
    copy = tmp_path / "copy"
    shutil.copytree(default_index, copy)
    assert reads("index", copy) == 1


def test_the_default_build_reads_no_manifest_it_wrote(gpt2_dir, text_jsonl, tmp_path):
    """Build, fit, transcode and FAISS stages each used to re-read what the previous one wrote."""
    forget_manifests()
    calls = manifest_reads(calls=True)
    assert reads("build", gpt2_dir, text_jsonl, "--out", tmp_path / "idx", "--device", "cpu", "--quiet") == 0
    assert manifest_reads(calls=True) > calls  # the stages do ask for it: the kept copy answers


def test_an_open_index_reads_nothing_more(default_index):
    from gradindex.query import QueryEngine

    forget_manifests()
    before = manifest_reads()
    with QueryEngine(default_index, device="cpu", use_gpu=False) as e:
        assert manifest_reads() - before == 1
        calls = manifest_reads(calls=True)
        e.query_batch(["the cat sat on a mat", "red sun"], k=3)
        e.query("a dog ran", k=2, method="ekfac-selfnorm")
        e.scores(["the cat sat on a mat"])
        assert manifest_reads(calls=True) == calls  # not even from the kept copy
    assert manifest_reads() - before == 1


def test_a_changed_file_is_read_again_and_a_write_is_kept(tmp_path, default_index):
    d = tmp_path / "idx"
    d.mkdir()
    m = read_manifest(default_index)
    write_manifest(d, m)
    forget_manifests()
    n = manifest_reads()
    assert read_manifest(d) == json.loads(IndexLayout(d).manifest.read_text()) and manifest_reads() == n + 1
    read_manifest(d)["status"] = "mutated"  # a copy: the kept one is not changed
    assert read_manifest(d)["status"] == m["status"] and manifest_reads() == n + 1
    text = IndexLayout(d).manifest.read_text().replace('"status": "complete"', '"status": "other"')
    IndexLayout(d).manifest.write_text(text)  # another process rewrote it
    assert read_manifest(d)["status"] == "other" and manifest_reads() == n + 2


def test_typed_view_round_trips_an_old_manifest_and_refuses_a_malformed_write(tmp_path, default_index):
    m = read_manifest(default_index)
    typed = Manifest.from_dict(m)
    assert typed.to_dict() == m  # an old manifest opens as it is
    assert list(typed.layers) == list(m["build"]["layers"]) and typed.complete
    assert {n: s.dim for n, s in typed.layers.items()} == {n: v["rows"] * v["cols"]
                                                           for n, v in m["build"]["layers"].items()}
    assert typed.basis_kind == m["build"]["basis"]["kind"] == "ekfac"
    assert set(typed.identity()) <= set(m["build"]) and "layers" in typed.identity()
    with pytest.raises(ValueError, match="build.layers"):
        write_manifest(tmp_path, {"build": {}})
    assert not IndexLayout(tmp_path).manifest.exists()


def test_the_apps_on_an_open_store_ask_for_no_manifest(default_index):
    """Dedup and outliers take the store-level opened directory: after it is open, not even a call of
    read_manifest (the kept copy) is made; they used to re-read the manifest by path 2-3 times each."""
    from gradindex.apps.dedup import DedupConfig, find_duplicates
    from gradindex.apps.outliers import rank_outliers
    from gradindex.store.opened import OpenStore

    forget_manifests()
    before = manifest_reads()
    with OpenStore(default_index) as ix:
        assert manifest_reads() - before == 1
        calls = manifest_reads(calls=True)
        dup = find_duplicates(ix, DedupConfig())
        out = rank_outliers(ix, "ekfac")
        assert manifest_reads(calls=True) == calls
    assert dup.n == out.self_influence.shape[0] == ix.n > 0
    assert [g.ids for g in dup.groups] == [g.ids for g in find_duplicates(default_index, DedupConfig()).groups]
