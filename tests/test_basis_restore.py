"""A transcoded index's deleted or damaged ``basis.h5`` is rewritten from its EK-FAC fit (issue 33 item 9)."""

from __future__ import annotations

import json
import shlex
import shutil

import pytest
from click.testing import CliRunner

from gradindex.cli import main
from gradindex.store.basis import unrestorable

QUERY = ["--text", "the cat sat on a mat", "-k", "5", "--json", "--device", "cpu"]


def _run(*args: str):
    return CliRunner().invoke(main, list(args))


def _advised(index) -> str:
    """The repair command ``gradindex verify`` prints for ``basis.h5``."""
    res = _run("verify", str(index))
    assert res.exit_code == 1, res.output
    line = next(x for x in res.output.splitlines() if x.startswith("DAMAGED basis.h5"))
    return line.split("; repair: ", 1)[1]


def _hits(output: str) -> list[tuple[int, float]]:
    return [(h["id"], h["score"]) for h in json.loads(output.splitlines()[0])]


def test_a_deleted_basis_is_rewritten_bitwise_by_the_advised_command(default_index, tmp_path):
    idx = tmp_path / "idx"
    shutil.copytree(default_index, idx)
    before, answer = (idx / "basis.h5").read_bytes(), _run("query", str(idx), *QUERY)
    assert answer.exit_code == 0, answer.output
    shards = {p.name: p.stat().st_mtime_ns for p in (idx / "store").glob("shard-*.h5")}
    (idx / "basis.h5").unlink()
    refused = _run("query", str(idx), *QUERY)
    assert refused.exit_code == 2 and "--repair" in refused.output and "--overwrite" not in refused.output
    cmd = _advised(idx)
    assert cmd.endswith(" --repair") and "--overwrite" not in cmd, cmd
    res = _run(*shlex.split(cmd)[1:], "--quiet", "--device", "cpu")
    assert res.exit_code == 0, res.output
    assert "(0 computed now)" in res.output  # no example captured again
    assert (idx / "basis.h5").read_bytes() == before
    assert {p.name: p.stat().st_mtime_ns for p in (idx / "store").glob("shard-*.h5")} == shards
    assert _run("verify", str(idx)).exit_code == 0
    again = _run("query", str(idx), *QUERY)
    assert again.exit_code == 0 and _hits(again.output) == _hits(answer.output)


def test_a_basis_its_fit_cannot_give_back_names_the_rebuild(default_index, tmp_path):
    """Both the basis and the fit it is made from damaged: one line naming both and the ``--overwrite`` rebuild."""
    idx = tmp_path / "idx"
    shutil.copytree(default_index, idx)
    (idx / "basis.h5").unlink()
    with open(idx / "precond" / "ekfac.h5", "r+b") as f:
        f.seek(4000)
        b = f.read(1)
        f.seek(4000)
        f.write(bytes([b[0] ^ 0xFF]))
    cmd = _advised(idx)
    res = _run(*shlex.split(cmd)[1:], "--quiet", "--device", "cpu")
    err = [x for x in res.output.splitlines() if x.startswith("Error")]
    assert res.exit_code == 2 and len(err) == 1, res.output
    assert "basis.h5" in err[0] and "precond/ekfac.h5" in err[0] and "--overwrite" in err[0], err[0]
    assert "Traceback" not in res.output and not (idx / "basis.h5").exists()


def test_which_bases_the_fit_files_hold():
    fit = {"preconditioners": {"ekfac": {}}}
    assert unrestorable({**fit, "build": {"basis": {"kind": "ekfac", "from": {"kind": "raw"}}}}) == ""
    assert "kfac pre-projection maps" in unrestorable({**fit, "build": {"basis": {"kind": "ekfac",
                                                                                   "from": {"kind": "kfac"}}}})
    assert "model pass" in unrestorable({**fit, "build": {"basis": {"kind": "ekfac", "space": "full-eigen"}}})
    assert "no EK-FAC fit" in unrestorable({"build": {"basis": {"kind": "ekfac", "from": {"kind": "raw"}}}})


BUILD = ["--max-length", "48", "--shard-size", "16", "--no-index", "--quiet", "--device", "cpu"]


def _store(idx) -> dict:
    return {p.name: p.read_bytes() for p in (idx / "store").glob("shard-*.h5")}


@pytest.mark.parametrize("rows", [["--projection-basis", "kfac", "--projection", "8", "--precondition", "none"],
                                  ["--projection-basis", "eigen", "--budget", "4096"]], ids=["kfac", "eigen"])
def test_a_lost_projection_basis_is_made_again_by_the_resume(gpt2_dir, text_jsonl, tmp_path, rows):
    """Issue 33's leftover: a ``kfac``/``eigen`` projection basis comes from the build's own factor pass, which no
    file keeps; a lost ``basis.h5`` needed ``--overwrite``. The advised ``--repair`` (and a killed build's plain
    re-run) makes it again, bitwise (its digest is checked), and keeps every row; where the factor pass now gives
    other maps, one line refuses, naming the fixes that keep the rows."""
    ref = tmp_path / "ref"
    build = ["build", str(gpt2_dir), str(text_jsonl), *rows, *BUILD]
    assert _run(*build, "--out", str(ref)).exit_code == 0
    basis, store = (ref / "basis.h5").read_bytes(), _store(ref)

    idx = tmp_path / "lost"  # a complete index: the advised repair
    shutil.copytree(ref, idx)
    (idx / "basis.h5").unlink()
    cmd = _advised(idx)
    assert cmd.endswith(" --repair") and "--overwrite" not in cmd, cmd
    res = _run(*shlex.split(cmd)[1:], "--no-index", "--quiet", "--device", "cpu")
    assert res.exit_code == 0 and "(0 computed now)" in res.output, res.output
    assert (idx / "basis.h5").read_bytes() == basis and _store(idx) == store
    assert _run("verify", str(idx)).exit_code == 0

    killed = tmp_path / "killed"  # a killed build: status building, its last shard not written, the basis lost
    shutil.copytree(ref, killed)
    m = json.loads((killed / "manifest.json").read_text())
    m["status"] = "building"
    (killed / "manifest.json").write_text(json.dumps(m))
    sorted((killed / "store").glob("shard-*.h5"))[-1].unlink()
    (killed / "basis.h5").unlink()
    res = _run(*build, "--out", str(killed))
    assert res.exit_code == 0 and "(8 computed now)" in res.output, res.output
    assert (killed / "basis.h5").read_bytes() == basis and _store(killed) == store

    other = tmp_path / "other"  # the factor pass gives other maps now (as on another device): refused, rows kept
    shutil.copytree(ref, other)
    m = json.loads((other / "manifest.json").read_text())
    m["build"]["basis"]["digest"] = "0" * 32
    (other / "manifest.json").write_text(json.dumps(m))
    (other / "basis.h5").unlink()
    res = _run(*build, "--out", str(other))
    err = [x for x in res.output.splitlines() if x.startswith("Error")]
    assert res.exit_code == 2 and len(err) == 1 and "Traceback" not in res.output, res.output
    assert "basis.h5" in err[0] and "put back a copy" in err[0] and "another --out" in err[0], err[0]
    assert _store(other) == store and not (other / "basis.h5").exists()


def test_a_killed_builds_damaged_projection_basis_is_made_again_not_reused(gpt2_dir, text_jsonl, tmp_path):
    """A killed ``kfac``-basis build whose ``basis.h5`` is damaged (a flipped byte in its maps): the plain re-run
    (what ``verify`` advises is the same build, ``--repair``) moves it aside and its factor pass makes it again,
    bitwise, keeping every row; it reused the damaged maps before, and refused the resume as another index's
    (digest differs), naming ``--overwrite``."""
    import h5py

    ref = tmp_path / "ref"
    build = ["build", str(gpt2_dir), str(text_jsonl), "--projection-basis", "kfac", "--projection", "8",
             "--precondition", "none", *BUILD]
    assert _run(*build, "--out", str(ref)).exit_code == 0
    basis, store = (ref / "basis.h5").read_bytes(), _store(ref)
    with h5py.File(ref / "basis.h5") as f:
        names = []
        f.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) and n.endswith("/W_a") else None)
        offset = f[names[0]].id.get_offset()

    killed = tmp_path / "killed"
    shutil.copytree(ref, killed)
    m = json.loads((killed / "manifest.json").read_text())
    m["status"] = "building"
    (killed / "manifest.json").write_text(json.dumps(m))
    damaged = bytearray(basis)
    damaged[offset + 8] ^= 0xFF
    (killed / "basis.h5").write_bytes(bytes(damaged))
    assert _run("verify", str(killed)).exit_code == 1
    res = _run(*build, "--out", str(killed))
    assert res.exit_code == 0 and "(0 computed now)" in res.output, res.output
    assert (killed / "basis.h5").read_bytes() == basis and _store(killed) == store
    assert list((killed / "damaged").glob("*/basis.h5"))  # (the damaged copy kept)
    assert _run("verify", str(killed)).exit_code == 0


def test_a_damaged_projection_basis_keeps_its_hash_so_a_copy_put_back_is_checked(gpt2_dir, text_jsonl, tmp_path):
    """A complete ``kfac``-basis index whose ``basis.h5`` is damaged, where the factor pass now gives other maps: the
    build refuses (rows kept) and advises putting back a copy. The damaged file is moved aside with its recorded
    hash kept (as a lost one's is), so a copy put back is checked against it: the original is taken (verify intact,
    a query answers), a wrong one refused by the query. The hash was forgotten before: the original counted as
    unrecorded (verify: damaged) and a wrong copy was read by queries unchecked."""
    import h5py

    ref = tmp_path / "ref"
    build = ["build", str(gpt2_dir), str(text_jsonl), "--projection-basis", "kfac", "--projection", "8",
             "--precondition", "none", *BUILD]
    assert _run(*build, "--out", str(ref)).exit_code == 0 and _run("index", str(ref)).exit_code == 0
    basis = (ref / "basis.h5").read_bytes()
    with h5py.File(ref / "basis.h5") as f:
        offset = f["transformer.h.0.attn.c_attn/W_a"].id.get_offset()
    wrong = bytearray(basis)
    wrong[offset + 8] ^= 0xFF

    idx = tmp_path / "idx"
    shutil.copytree(ref, idx)
    m = json.loads((idx / "manifest.json").read_text())
    m["build"]["basis"]["digest"] = "0" * 32  # (the factor pass gives other maps now, as on another device)
    (idx / "manifest.json").write_text(json.dumps(m))
    (idx / "basis.h5").write_bytes(bytes(wrong))
    res = _run(*build, "--out", str(idx))
    assert res.exit_code == 2 and "put back a copy" in res.output, res.output
    assert not (idx / "basis.h5").exists()
    (idx / "manifest.json").write_text((ref / "manifest.json").read_text())  # (the digest hack served its turn)

    (idx / "basis.h5").write_bytes(bytes(wrong))  # a wrong copy put back: a query refuses it
    res = _run("query", str(idx), *QUERY)
    assert res.exit_code == 2 and "basis.h5" in res.output, res.output
    (idx / "basis.h5").write_bytes(basis)  # the original: taken as it was
    assert _run("verify", str(idx)).exit_code == 0
    assert _run("query", str(idx), *QUERY).exit_code == 0
