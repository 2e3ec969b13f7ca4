"""Damaged files are found, named with their repair, refused, and repaired; one writer per index."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest
from click.testing import CliRunner

from gradindex.capture import ProjectionSpec
from gradindex.checksum import CHECKSUMS, DamagedIndexError
from gradindex.cli import main
from gradindex.data import load_records, tokenize_records
from gradindex.index import IndexConfig, IndexSpace, build_indices, layer_file
from gradindex.lock import IndexBusyError, index_lock
from gradindex.methods import DEFAULT_DAMPING
from gradindex.model import load_causal_lm
from gradindex.pipeline import BuildConfig, build_index
from gradindex.precondition import FitConfig, fit_preconditioner, load_preconditioner
from gradindex.query import QueryEngine
from gradindex.store import Store


@pytest.fixture(scope="module")
def built(tmp_path_factory, gpt2_dir, text_jsonl):
    """40 examples in 3 int8 shards, K-FAC fitted, flat indices."""
    model, tok = load_causal_lm(gpt2_dir, device="cpu")
    data = tokenize_records(load_records(text_jsonl), tok, 512)
    out = tmp_path_factory.mktemp("integrity") / "index"
    cfg = BuildConfig.raw(projection=ProjectionSpec(k_a=4, k_g=4, seed=1), shard_size=16, precondition="kfac",
                      storage="int8")
    build_index(model, tok, data, out, cfg, index=IndexConfig(factory="Flat"), model_id=str(gpt2_dir),
                data_id=str(text_jsonl), progress=False)
    return out


@pytest.fixture
def index(built, tmp_path):
    d = tmp_path / "index"
    shutil.copytree(built, d)
    return d


def _cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def _verify(d) -> dict:
    r = _cli("verify", d, "--json")
    report = json.loads(r.output)
    assert r.exit_code == (1 if report["damaged"] else 0), r.output
    return report


def _flip(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


def _run_repair(command: str) -> None:
    args = shlex.split(command)
    assert args[0] == "gradindex"
    r = _cli(*args[1:], "--quiet")
    assert r.exit_code == 0, r.output


def _rows(d):
    with Store(d) as s:
        return s.read_rows(np.arange(len(s)))


def test_intact_index_verifies(index):
    r = _cli("verify", index)
    assert r.exit_code == 0, r.output
    assert "intact" in r.output
    files = json.loads((index / CHECKSUMS).read_text())["files"]
    assert {"store/shard-00000.h5", "store/shard-00002.h5", "precond/kfac.h5", "precond/graddot.h5",
            "faiss/norms.npy"} <= set(files)
    assert sum(n.startswith("faiss/") and n.endswith(".index") for n in files) == 8


def test_verify_of_an_unfinished_build_says_so_with_the_command_that_finishes_it(index):
    """verify said only "intact" on a build killed during its fit, where info and query say it is unfinished."""
    from gradindex.spec.manifest import read_manifest, write_manifest

    m = read_manifest(index)
    m["status"] = "building"
    write_manifest(index, m)
    r = _cli("verify", index)
    assert r.exit_code == 0 and "intact" in r.output, r.output
    assert "note: the build is not complete (status 'building'); `gradindex build " in r.output, r.output
    assert "finishes it (it resumes)" in r.output
    assert "the build is not complete" in json.loads(_cli("verify", index, "--json").output)["unfinished"]


def test_a_flipped_byte_in_a_shard_is_named_refused_and_repaired(index):
    before = _rows(index)
    shard = index / "store" / "shard-00001.h5"
    with h5py.File(shard, "r") as f:
        off = f["grads"]["transformer.h.1.mlp.c_fc"].id.get_chunk_info(0).byte_offset
    _flip(shard, off + 3)
    report = _verify(index)
    assert [x["file"] for x in report["damaged"]] == ["store/shard-00001.h5"]
    repair = report["damaged"][0]["repair"]
    assert repair.startswith("gradindex build ") and repair.endswith(" --repair") and ",int8 " in repair
    r = _cli("verify", index)
    assert r.exit_code == 1 and "DAMAGED store/shard-00001.h5" in r.output
    with pytest.raises(DamagedIndexError, match=r"shard-00001\.h5 \(content differs.*gradindex build .*--repair"):
        fit_preconditioner(index, FitConfig("kfac"))
    with pytest.raises(DamagedIndexError, match=r"shard-00001\.h5.*--repair"):
        build_indices(index, IndexConfig(factory="Flat"), progress=False, force=True)
    r = _cli("index", index, "--index-type", "Flat", "--force", "--quiet")
    assert r.exit_code != 0 and "Error: damaged files" in r.output and "shard-00001.h5" in r.output
    # the plain re-run's cheap check does not read every byte; --repair does
    _run_repair(repair)
    assert _verify(index)["damaged"] == []
    kept = list((index / "damaged").rglob("shard-00001.h5"))
    assert len(kept) == 1
    after = _rows(index)
    for n in before:
        np.testing.assert_array_equal(after[n], before[n])
    fit_preconditioner(index, FitConfig("kfac"))


def test_a_truncated_shard_is_recomputed_by_a_plain_rerun(index, built):
    shard = index / "store" / "shard-00002.h5"
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(DamagedIndexError, match=r"shard-00002\.h5 \(\d+ bytes, \d+ were written"):
        QueryEngine(index, load_model=False)
    command = _verify(index)["damaged"][0]["repair"].removesuffix(" --repair")
    _run_repair(command)
    assert _verify(index)["damaged"] == []
    for n, v in _rows(built).items():
        np.testing.assert_array_equal(_rows(index)[n], v)


def test_a_flipped_byte_in_a_faiss_file_is_named_refused_and_repaired(index):
    f = layer_file(index, "transformer.h.0.attn.c_proj")
    _flip(f, f.stat().st_size // 2)
    report = _verify(index)
    assert [x["file"] for x in report["damaged"]] == [f"faiss/{f.name}"]
    assert report["damaged"][0]["repair"] == f"gradindex index {index} --index-type Flat"
    with QueryEngine(index, load_model=False) as e:  # exact scores need no FAISS file: read at the first search
        with pytest.raises(DamagedIndexError, match=rf"{f.name} \(content differs.*`gradindex index .* Flat`"):
            _ = e.indices
    _run_repair(report["damaged"][0]["repair"])  # rebuilds only the damaged layer
    assert _verify(index)["damaged"] == []
    with QueryEngine(index, load_model=False) as e:
        assert len(e.indices.layers) == 8


def test_a_flipped_byte_in_a_precond_file_is_named_refused_and_repaired(index):
    p = index / "precond" / "kfac.h5"
    with h5py.File(p, "r") as f:
        off = f["self_influence"].id.get_offset()
    _flip(p, off + 2)
    report = _verify(index)
    assert [x["file"] for x in report["damaged"]] == ["precond/kfac.h5"]
    repair = report["damaged"][0]["repair"]
    assert repair == f"gradindex precondition {index} --method kfac --damping {DEFAULT_DAMPING}"
    with pytest.raises(DamagedIndexError, match=r"precond/kfac\.h5.*gradindex precondition .* --method kfac"):
        load_preconditioner(index, "kfac")
    with pytest.raises(DamagedIndexError, match=r"precond/kfac\.h5"):
        build_indices(index, IndexConfig(space=IndexSpace(whiten="kfac")), progress=False)
    _run_repair(repair)
    assert _verify(index)["damaged"] == []
    load_preconditioner(index, "kfac")


_HOLD = """
import sys, time
from gradindex.lock import index_lock
with index_lock(sys.argv[1], "test holder"):
    print("locked", flush=True)
    time.sleep(600)
"""


def test_a_second_writer_is_refused_with_the_holders_pid_and_a_dead_holder_does_not_block(
        index, gpt2_dir, text_jsonl):
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(index)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        t = time.perf_counter()
        r = _cli("build", gpt2_dir, text_jsonl, "--out", index, "--projection", "4x4", "--seed", "1",
                 "--shard-size", "16", "--storage", "int8", "--quiet")
        assert r.exit_code != 0 and time.perf_counter() - t < 30
        assert f"being written by another process (pid {holder.pid}: test holder)" in r.output
        for fn in (lambda: fit_preconditioner(index, FitConfig("kfac")),
                   lambda: build_indices(index, progress=False, force=True)):
            with pytest.raises(IndexBusyError, match=f"pid {holder.pid}"):
                fn()
    finally:
        holder.kill()
        holder.wait()
    with index_lock(index, "after"):  # released by the kernel when the holder died
        assert (index / ".lock").read_text() == f"pid {__import__('os').getpid()}: after\n"
    r = _cli("verify", index)
    assert r.exit_code == 0, r.output


def test_verify_with_checksums_deleted_is_damage_with_its_repair(index):
    """Issue 21, item 8: it said "intact; 0 files verified", exit 0, blaming an older gradindex."""
    (index / CHECKSUMS).unlink()
    r = _cli("verify", index)
    assert r.exit_code == 1, r.output
    assert f"DAMAGED {CHECKSUMS}: missing: the manifest names gradindex" in r.output and "older" not in r.output
    report = json.loads(_cli("verify", index, "--json").output)
    (x,) = report["damaged"]
    assert x["file"] == CHECKSUMS and x["repair"].startswith("gradindex build ") and "--overwrite" in x["repair"]
    assert f"gradindex verify {index} --record" in x["repair"]
    assert len(report["unrecorded"]) >= 8  # shards, preconditioners, FAISS files
    r = _cli("verify", index, "--record")
    assert r.exit_code == 0 and "intact" in r.output, r.output
    assert _verify(index)["unrecorded"] == []
    shard = index / "store" / "shard-00000.h5"  # the recorded hashes protect the files again
    _flip(shard, shard.stat().st_size // 2)
    assert [x["file"] for x in _verify(index)["damaged"]] == ["store/shard-00000.h5"]


def _sampled(size: int) -> list[tuple[int, int]]:
    """The byte ranges the cheap sampled check reads (gradindex.checksum.sample_digest)."""
    edge, block = 1 << 16, 1 << 12
    return [(0, edge), (max(0, size - edge), size)] + [(size * i // 17, size * i // 17 + block) for i in range(1, 17)]


def test_a_flipped_block_outside_the_sampled_ones_is_refused_when_a_query_reads_its_row(gpt2_dir, text_jsonl,
                                                                                         tmp_path):
    """Issue 21, item 3: a flipped 64-byte block the sampled check does not read changed a score (7433.4 →
    7361.2, exit 0); the row hashes recorded at write time refuse it as the query reads the row."""
    model, tok = load_causal_lm(gpt2_dir, device="cpu")
    data = tokenize_records(load_records(text_jsonl), tok, 64)
    out = tmp_path / "index"
    cfg = BuildConfig.raw(projection=ProjectionSpec.parse("none"), shard_size=16, storage="fp32", max_length=64)
    build_index(model, tok, data, out, cfg, index=IndexConfig(factory="Flat"), model_id=str(gpt2_dir),
                data_id=str(text_jsonl), progress=False)
    shard = out / "store" / "shard-00001.h5"
    layer = "transformer.h.1.mlp.c_fc"
    with h5py.File(shard, "r") as f:
        ds = f["grads"][layer]
        row_bytes = ds.shape[1] * 4
        start = ds.id.get_chunk_info(0).byte_offset
        rows_in_chunk = ds.chunks[0]
    size = shard.stat().st_size
    off = next(o for o in range(start, start + rows_in_chunk * row_bytes - 64, 64)
               if not any(a < o + 64 and o < b for a, b in _sampled(size)))
    row = 16 + (off - start) // row_bytes  # the example whose codes the block lies in
    with open(shard, "r+b") as fh:
        fh.seek(off)
        fh.write(bytes(64 * [0x5A]))
    with QueryEngine(out, model=model, tokenizer=tok) as e:  # the cheap checks at open pass
        with pytest.raises(DamagedIndexError, match=rf"shard-00001\.h5 \(rows \[{row - 16}\] of layer "
                                                    rf"'{layer}' differ from the hashes recorded.*--repair"):
            e.query(data.input_ids[row], k=len(data))  # every row is re-ranked exactly, this one too
        ok = e.store.read_rows(np.array([0, 1, 39]))  # rows elsewhere still read
        assert all(np.isfinite(v).all() for v in ok.values())
    r = _cli("query", out, "--text", "the cat sat on a mat", "-k", "40", "--device", "cpu")
    assert r.exit_code == 2 and "differ from the hashes recorded" in r.output, r.output
    assert _verify(out)["damaged"][0]["file"] == "store/shard-00001.h5"
