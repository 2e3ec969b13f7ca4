"""Bad input to the sharded-index commands (`split`, `merge`, `build` into a part): one ``Error:`` line, exit 2,
nothing half-written, and no part overwritten with the wrong rows."""

from __future__ import annotations

import errno
import json
import pathlib
import shutil
import subprocess
import sys

import pytest
from click.testing import CliRunner

from gradindex.checksum import read_checksums
from gradindex.cli import main
from gradindex.index.sharded import split_index
from gradindex.spec.manifest import read_manifest
from tests.conftest import refused


def cli(*args) -> tuple[int, str]:
    res = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    return res.exit_code, res.output


@pytest.fixture(scope="module")
def sharded(default_index, tmp_path_factory):
    return split_index(default_index, tmp_path_factory.mktemp("bad-input") / "three", 3)


def test_a_build_into_a_part_is_refused_and_a_damaged_part_names_the_whole_rebuild(gpt2_dir, text_jsonl, sharded,
                                                                                   tmp_path):
    """`build --repair` into a part (what a damaged part's error used to name) stored the data set's first rows as
    the part's and recorded their hashes: verify said intact, queries answered with the wrong rows."""
    bad = tmp_path / "bad"
    shutil.copytree(sharded.dir, bad)
    part = bad / "part-00001"
    shard = part / "store" / "shard-00000.h5"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    before = read_checksums(part)
    code, out = cli("query", bad, "--text", "the cat", "--device", "cpu")
    line = refused(code, out, None, "damaged files", f"--out {bad} ", "--parts 3 --overwrite")
    assert f"--out {part}" not in line
    args = ["build", gpt2_dir, text_jsonl, "--out", part, "--shard-size", "16", "--max-length", "48", "--device",
            "cpu", "--quiet"]
    for extra in (["--repair"], ["--overwrite"], ["--parts", "2"]):
        code, out = cli(*args, *extra)
        refused(code, out, None, "is part 1 of the sharded index", "rows 16-31", "--parts 3 --overwrite")
        assert read_checksums(part) == before and shard.stat().st_size < before["store/shard-00000.h5"]["bytes"]


def test_out_inside_the_source_and_a_split_of_a_part_are_refused(default_index, sharded, tmp_path):
    code, out = cli("split", default_index, "--shards", "2", "--out", default_index / "inner")
    refused(code, out, None, "is inside", "outside it")
    code, out = cli("merge", sharded.dir, "--out", sharded.dir / "back")
    refused(code, out, None, "is inside", "outside it")
    assert not (default_index / "inner").exists() and not (sharded.dir / "back").exists()
    code, out = cli("split", sharded.parts[1].dir, "--shards", "2", "--out", tmp_path / "x")
    refused(code, out, tmp_path / "x", "is part 1 of the sharded index", f"gradindex merge {sharded.dir} --out")


def test_a_failed_merge_leaves_no_half_written_output(sharded, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(sharded.dir, bad)
    shard = bad / "part-00002" / "store" / "shard-00000.h5"
    raw = bytearray(shard.read_bytes())
    raw[-100] ^= 0xFF
    shard.write_bytes(bytes(raw))
    (tmp_path / "empty").mkdir()
    for out in (tmp_path / "new", tmp_path / "empty"):
        code, text = cli("merge", bad, "--out", out)
        refused(code, text, out, "damaged files", "part-00002", "--parts 3 --overwrite")
    assert not (tmp_path / "new").exists() and (tmp_path / "empty").is_dir()
    assert not any((tmp_path / "empty").iterdir())


def test_a_read_only_output_is_one_line(default_index, sharded, tmp_path, monkeypatch):
    mkdir = pathlib.Path.mkdir

    def read_only(self, *a, **k):
        if self.name == "ro":
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return mkdir(self, *a, **k)

    monkeypatch.setattr(pathlib.Path, "mkdir", read_only)
    for args in (["split", default_index, "--shards", "2"], ["merge", sharded.dir]):
        code, out = cli(*args, "--out", tmp_path / "ro")
        refused(code, out, None, "read-only", "--out")
    assert read_manifest(sharded.parts[0].dir)["shard"]["part"] == 0


def test_a_part_given_as_an_index_is_refused(sharded, tmp_path):
    """A part's ids are its own (row 16 of the whole index is its 0) and its texts are not beside it: query, serve,
    audit, explain, outliers and dedup on a part name the sharded index instead of answering with the wrong ids."""
    part = sharded.parts[1].dir
    (tmp_path / "q.jsonl").write_text('{"text": "the cat"}\n')
    for args in (["query", part, "--text", "the cat", "--device", "cpu"],
                 ["explain", part, "--text", "the cat", "--id", "0", "--device", "cpu"],
                 ["audit", part, "--queries", tmp_path / "q.jsonl", "--out", tmp_path / "report"],
                 ["outliers", part], ["dedup", part, "--out", tmp_path / "d.json"]):
        code, out = cli(*args)
        refused(code, out, None, "is part 1 of the sharded index", "rows 16-31", f"give the sharded index "
                f"'{sharded.dir}'")
    assert not (tmp_path / "report").exists() and not (tmp_path / "d.json").exists()
    served = subprocess.run([sys.executable, "-m", "gradindex", "serve", str(part), "--port", "0"],
                            capture_output=True, text=True, timeout=120)  # (a regression would serve: timed out)
    refused(served.returncode, served.stderr, None, "is part 1 of the sharded index")
    elsewhere = tmp_path / "copied" / "part-00001"  # a part copied out of its sharded index: its folder not named
    shutil.copytree(part, elsewhere)
    code, out = cli("query", elsewhere, "--text", "the cat", "--device", "cpu")
    refused(code, out, None, "is part 1 of a sharded index")
    assert str(elsewhere.parent) + "'" not in out


def test_verify_of_a_damaged_sharded_index_names_both_repairs(sharded, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(sharded.dir, bad)
    shard = bad / "part-00000" / "store" / "shard-00000.h5"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    code, out = cli("verify", bad, "--json")
    damaged = json.loads(out)["damaged"]
    assert code != 0 and damaged and all("gradindex split INDEX --shards 3" in d["repair"] and f"--out {bad} " in
                                         d["repair"] and "--parts 3 --overwrite" in d["repair"] for d in damaged)


KILLED = """
import os, sys
import gradindex.index.sharded as S
real = S._write_part
def dies(ix, part, j, *a):
    if j == 1:
        os._exit(9)  # (no cleanup runs: as kill -9 leaves it)
    real(ix, part, j, *a)
S._write_part = dies
S.split_index(sys.argv[1], sys.argv[2], 3)
"""


def test_a_killed_split_or_merge_is_redone_by_the_same_command(default_index, sharded, tmp_path):
    """A split killed outright leaves its ``--out`` half-written and marked; the same command clears it and splits
    again (it was refused: "exists and is not an empty directory"); another source's is still refused."""
    out = tmp_path / "killed"
    proc = subprocess.run([sys.executable, "-c", KILLED, str(default_index), str(out)], capture_output=True)
    assert proc.returncode == 9 and (out / "part-00000").is_dir() and not (out / "shards.json").exists()
    code, text = cli("merge", sharded.dir, "--out", out)
    refused(code, text, None, "not an empty directory (an unfinished split of another source)")
    code, text = cli("split", default_index, "--shards", "3", "--out", out)
    assert code == 0, text
    assert not (out / ".unfinished.json").exists()
    for a, b in zip(sharded.parts, split_index(default_index, tmp_path / "fresh", 3).parts, strict=True):
        assert read_checksums(a.dir) == read_checksums(out / a.dir.name) == read_checksums(b.dir)
    merged = tmp_path / "merged"
    merged.mkdir()
    (merged / ".unfinished.json").write_text(json.dumps({"op": "merge", "src": str(out.resolve())}))
    (merged / "store").mkdir()  # (a merge killed after its first file)
    code, text = cli("merge", out, "--out", merged)
    assert code == 0 and not (merged / ".unfinished.json").exists(), text


HOLD = """
import sys, time
from gradindex.lock import index_lock
with index_lock(sys.argv[1], "gradindex split"):
    print("held", flush=True)
    time.sleep(60)
"""


def test_a_running_split_is_not_cleared_by_a_second(default_index, tmp_path):
    """The unfinished mark is cleared only when no process holds ``--out``: a second run of the same split while the
    first lives is refused (it would have emptied the first's output under it)."""
    out = tmp_path / "busy"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        (out / ".unfinished.json").write_text(json.dumps({"op": "split", "src": str(default_index.resolve())}))
        (out / "part-00000").mkdir()
        code, text = cli("split", default_index, "--shards", "3", "--out", out)
        refused(code, text, None, "is being written by another process", "gradindex split")
        assert (out / "part-00000").is_dir() and (out / ".unfinished.json").exists()
    finally:
        holder.kill()
        holder.wait()


def test_overwrite_of_a_folder_holding_no_index_is_refused(gpt2_dir, text_jsonl, tmp_path):
    """`build --parts P --overwrite` cleared whatever the folder held (a plain build refuses a folder with no index)."""
    out = tmp_path / "notes"
    (out / "docs").mkdir(parents=True)
    (out / "notes.txt").write_text("mine")
    code, text = cli("build", gpt2_dir, text_jsonl, "--out", out, "--parts", "2", "--overwrite", "--device", "cpu",
                     "--max-length", "48", "--quiet")
    refused(code, text, None, "holds no gradindex index", skip=("plan:", "warning:"))
    assert (out / "notes.txt").read_text() == "mine" and (out / "docs").is_dir()


def test_a_part_is_not_refitted_compacted_into_or_repaired_alone(sharded):
    """A part's basis repair names the whole rebuild (it named a compact into the part, which replaced the part by a
    whole index); a compact into a part and a fit of one part alone are refused."""
    from gradindex.precondition.compact import _prepare
    from gradindex.store.basis import basis_repair

    part = sharded.parts[1].dir
    fix = basis_repair(part, read_manifest(part))
    assert f"--out {sharded.dir} " in fix and "--parts 3 --overwrite" in fix and "compact" not in fix
    with pytest.raises(FileExistsError, match="a compact into it would replace the part"):
        _prepare(part, read_manifest(sharded.parts[0].dir), True)
    before = read_checksums(part)
    code, out = cli("precondition", part, "--method", "kfac")
    refused(code, out, None, "is part 1 of the sharded index", "its parts share one fit")
    assert read_checksums(part) == before


def test_info_and_verify_on_a_sharded_index_with_a_missing_part(sharded, tmp_path):
    """A part's folder not here is "not in this folder", not damage to repair by a new split: a host that runs only
    some torchrun ranks holds only their parts, and `verify --here` checks those."""
    bad = tmp_path / "bad"
    shutil.copytree(sharded.dir, bad)
    shutil.rmtree(bad / "part-00000")
    code, out = cli("info", bad)
    assert code == 0, out
    assert "sharded: 3 parts" in out and "40 examples" in out, out
    assert "part-00000  rows 0-15: not in this folder" in out and "UNREADABLE" not in out, out
    assert "part-00001  rows 16-31 (16 examples, complete)" in out and "part-00002  rows 32-39" in out, out
    code, out = cli("info", bad, "--json")
    s = json.loads(out)
    assert [p["status"] for p in s["parts"]] == ["absent", "complete", "complete"] and s["model"]["fingerprint"]
    for args in (("query", bad, "--text", "the cat", "--device", "cpu"), ("merge", bad, "--out", tmp_path / "m")):
        code, out = cli(*args)
        refused(code, out, None, "part-00000', a part of the sharded index", "is not in this folder",
                f"`gradindex verify {bad} --here`")
    code, out = cli("verify", bad)
    assert code == 1 and out.count("DAMAGED") == 1 and "DAMAGED part-00000/: not in this folder" in out, out
    assert f"gradindex verify {bad} --here" in out and "split the index again" not in out, out
    code, out = cli("verify", bad, "--here")
    assert code == 0 and "DAMAGED" not in out and "part-00000  rows 0-15: not here" in out, out
    assert out.strip().endswith("intact; 12 files verified in the 2 of 3 parts here"), out
    (bad / "part-00002" / "store" / "shard-00000.h5").write_bytes(b"x")  # (damage in a part here is still damage)
    code, out = cli("verify", bad, "--here")
    assert code == 1 and "DAMAGED part-00002/store/shard-00000.h5" in out, out
    for part in ("part-00001", "part-00002"):
        shutil.rmtree(bad / part)
    code, out = cli("info", bad)
    refused(code, out, None, "no part of the sharded index", "is not in this folder")
    code, out = cli("verify", bad, "--here")
    refused(code, out, None, "none of the 3 parts", "is here")
    (bad / "part-00000").mkdir()  # (a part's folder without its manifest: damage, named once)
    code, out = cli("query", bad, "--text", "the cat", "--device", "cpu")
    refused(code, out, None, "part-00000', a part of the sharded index", "has no manifest.json",
            "copy the part again from where the index was split or built, or split the index again")
    code, out = cli("verify", bad, "--here")
    assert code == 1 and out.count("has no manifest.json") == 1 and "part-00000  rows 0-15: 1 damaged" in out, out
    code, out = cli("verify", bad, "--json")
    assert json.loads(out)["absent"] == ["part-00001", "part-00002"], out
    code, out = cli("verify", sharded.dir, "--here")
    assert code == 0 and "in the 3 of 3 parts here" not in out and "in 3 parts" in out, out
    code, out = cli("verify", sharded.parts[0].dir, "--here")
    refused(code, out, None, "is not a sharded index: --here")


def test_a_shards_json_of_another_split_is_named_as_such(default_index, sharded, tmp_path):
    """The parts of a split into 2 under the shards.json of a split into 3 (copied from another host): one error
    naming the other split, not a missing part 2 and two mismatched parts."""
    two = split_index(default_index, tmp_path / "two", 2)
    mix = tmp_path / "mix"
    shutil.copytree(two.dir, mix)
    shutil.copy(sharded.dir / "shards.json", mix)
    code, out = cli("query", mix, "--text", "the cat", "--device", "cpu")
    refused(code, out, None, "shards.json' is another split's than the parts here", "names 3 parts",
            "part-00000' is part 0 of 2 (rows 0-15)", "put back the shards.json written with these parts")
    code, out = cli("verify", mix)
    assert code == 1 and out.count("DAMAGED") == 1 and "is another split's" in out, out
    assert "repair: put back the shards.json" in out and "not in this folder" not in out, out
    assert "part-00002  rows 32-39: not here" in out and "--overwrite" not in out, out
    assert json.loads(cli("verify", mix, "--json")[1])["absent"] == ["part-00002"]
    for bad, swap in (("foreign", False), ("swapped", True)):  # (shards.json right, a part wrong: that part named)
        d = tmp_path / bad
        shutil.copytree(sharded.dir, d)
        if swap:
            (d / "part-00000").rename(d / "x")
            (d / "part-00001").rename(d / "part-00000")
            (d / "x").rename(d / "part-00001")
        else:
            shutil.rmtree(d / "part-00001")
            shutil.copytree(two.dir / "part-00001", d / "part-00001")
        code, out = cli("query", d, "--text", "the cat", "--device", "cpu")
        refused(code, out, None, "is not part", "of this sharded index")
        assert "another split" not in out, out


def test_rerank_full_on_a_sharded_index_without_its_fit_names_the_whole_fit(sharded):
    """Every part shares one full-space fit: the fix is a fit over the whole index, split again, not part 0's."""
    code, out = cli("query", sharded.dir, "--text", "the cat", "--rerank-full", "10", "--device", "cpu")
    line = refused(code, out, None, f"the sharded index '{sharded.dir}' has no full-space ekfac curvature",
                   f"`gradindex merge {sharded.dir} --out ONE`", "`gradindex precondition ONE --method ekfac --space "
                   "full`", "`gradindex split ONE --shards 3 --out NEW`")
    assert "part-00000 --method" not in line
    from gradindex.index.parts import OpenParts
    from gradindex.precondition.fullspace import load_full_preconditioner

    with OpenParts(sharded) as whole, pytest.raises(FileNotFoundError, match="--shards 3 --out NEW"):
        load_full_preconditioner(whole, "ekfac")
