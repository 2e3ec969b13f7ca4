"""A torchrun build's stages after the capture shared by its ranks (issue 34): each rank sums the EK-FAC
correction over its own store files, transcodes them and takes their rows' norms for the tier; the index equals
the one-process build's byte for byte (store files, fits, basis), every query's top 10 with it; a rank failing
mid-transcode fails the build on every rank, and the same command resumes it to the same bytes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import h5py
import numpy as np
import pytest

from gradindex.checksum import read_checksums
from gradindex.precondition.files import precond_path
from gradindex.spec.manifest import read_manifest
from tests.conftest import make_texts
from tests.test_distributed import ROOT, torchrun

pytestmark = pytest.mark.slow
QUERIES = make_texts(5, seed=11, max_words=12)
DIES = """import sys
from gradindex import distributed
from gradindex.precondition import compact
real = compact._compact_shard
def dies(store, k, *a, **kw):
    if distributed.rank() == 1 and k == 3:  # (rank 1's second store file; 0-2 are coded)
        raise RuntimeError("rank 1 killed mid-transcode")
    return real(store, k, *a, **kw)
compact._compact_shard = dies
from gradindex.cli import main
main(prog_name="gradindex")
"""


def _cli(*args: str, code: int = 0) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "gradindex", *args], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == code, r.stdout + r.stderr
    return r.stdout


def _stored(d) -> dict:
    """The recorded hashes of the store files, fits and basis (the tier's files: the queries compare them)."""
    return {n: e["blake2b"] for n, e in read_checksums(d).items() if not n.startswith("faiss")}


def _fit(d, method: str) -> dict:
    with h5py.File(precond_path(d, method), "r") as f:
        return {"si": f["self_influence_layers"][:], **{n: g["Lambda"][:] for n, g in f["layers"].items()}}


@pytest.fixture(scope="module")
def built(gpt2_dir, text_jsonl, tmp_path_factory):
    d = tmp_path_factory.mktemp("stages")
    common = [str(gpt2_dir), str(text_jsonl), "--shard-size", "4", "--max-length", "48", "--device", "cpu",
              "--quiet"]
    _cli("build", *common, "--out", str(d / "one"))  # the default: EK-FAC, int4 eigenbasis rows, the tier
    return d, common


def test_two_ranks_share_the_correction_and_transcode_to_the_same_bytes(gpt2_dir, built):
    d, common = built
    out = torchrun("-m", "gradindex", "build", *common, "--out", str(d / "two"))
    assert out.count("examples x 8 layers") == 1, out
    assert read_manifest(d / "two")["counts"]["ranks"] == 2
    one, two = _stored(d / "one"), _stored(d / "two")
    assert sum(n.startswith("store/shard-") and n.endswith(".h5") for n in one) == 10  # 5 store files a rank
    assert one == two  # the same store bytes (int4 codes), fits (Λ* summed file by file in file order) and basis
    for method in ("ekfac", "kfac"):
        a, b = _fit(d / "one", method), _fit(d / "two", method)
        for n in a:
            np.testing.assert_array_equal(a[n], b[n])
    np.testing.assert_array_equal(np.load(d / "two" / "faiss" / "norms.npy"),  # the tier's norms, also shared
                                  np.load(d / "one" / "faiss" / "norms.npy"))
    q = [a for t in QUERIES for a in ("--text", t)] + ["-k", "10", "--device", "cpu"]
    assert _cli("query", str(d / "two"), *q) == _cli("query", str(d / "one"), *q)


def test_a_rank_failing_mid_transcode_fails_the_build_and_it_resumes(gpt2_dir, built, tmp_path):
    d, common = built
    script = tmp_path / "dies.py"
    script.write_text(DIES)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script),
           "build", *common, "--out", str(tmp_path / "two")]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "rank 1 killed mid-transcode" in r.stderr, r.stdout + r.stderr
    staged = tmp_path / "two" / "eigenbasis.partial" / "store"
    assert sorted(p.name for p in staged.glob("shard-*.h5")) == [f"shard-0000{k}.h5" for k in range(3)]
    torchrun("-m", "gradindex", "build", *common, "--out", str(tmp_path / "two"))  # the same command resumes
    assert _stored(tmp_path / "two") == _stored(d / "one")


COUNTS = """import os, sys
from gradindex import distributed
from gradindex.index.tiers import sketch_files
real = sketch_files.encode_sketch
def counted(y):
    with open(os.path.join(os.environ["COUNT_DIR"], f"rank-{distributed.rank()}"), "a") as f:
        f.write(f"{len(y)}\\n")
    return real(y)
sketch_files.encode_sketch = counted
from gradindex.cli import main
main(prog_name="gradindex")
"""


def test_two_ranks_encode_the_sketch_tier_to_the_same_bytes(built, tmp_path):
    """The sketch tier's codes, once rank 0's alone (issue 34: "spreading the rest of rank 0's work"): each rank
    encodes its own store files, rank 0 writes them; the files equal one process's byte for byte."""
    d, common = built
    sketch = [*common, "--index-type", "sketch"]
    _cli("build", *sketch, "--out", str(tmp_path / "one"))
    script = tmp_path / "counts.py"
    script.write_text(COUNTS)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "COUNT_DIR": str(tmp_path)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script),
           "build", *sketch, "--out", str(tmp_path / "two")]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = {k: sum(map(int, (tmp_path / f"rank-{k}").read_text().split())) for k in (0, 1)}
    assert rows == {0: 20, 1: 20}, rows  # (10 store files of 4 rows: 5 a rank)
    for f in ("sketch.codes.npy", "sketch.scales.npy"):
        np.testing.assert_array_equal(np.load(tmp_path / "two" / "faiss" / f), np.load(tmp_path / "one" / "faiss" / f))
    q = [a for t in QUERIES for a in ("--text", t)] + ["-k", "10", "--device", "cpu"]
    assert _cli("query", str(tmp_path / "two"), *q) == _cli("query", str(tmp_path / "one"), *q)


IVF_BLOCKS = """import os, sys
from gradindex import distributed
from gradindex.index.tiers import ivf_sketch
real_assign, real_block = ivf_sketch.assign, ivf_sketch._Codes.block
def small(codes, centroids, probe, factors, block_bytes, use_gpu, team=ivf_sketch.SOLO):
    return real_assign(codes, centroids, probe, factors, 4 * codes.m * 6, use_gpu, team)  # blocks of 6 rows
def counted(self, s, e):
    with open(os.path.join(os.environ["COUNT_DIR"], f"rank-{distributed.rank()}"), "a") as f:
        f.write(f"{e - s}\\n")
    return real_block(self, s, e)
ivf_sketch.assign, ivf_sketch._Codes.block = small, counted
from gradindex.cli import main
main(prog_name="gradindex")
"""


def test_two_ranks_assign_the_ivf_lists_to_the_same_bytes(built, tmp_path):
    """The ivf-sketch tier's pass over every sketch (each one's nearest list, the probe rows' exhaustive tops), once
    rank 0's alone: each rank takes every other block, the lead adds the lists' sums in block order; the lists, the
    lists' mean sketches, the chosen nprobe and every query's answer equal one process's, byte for byte."""
    d, common = built
    ivf = [*common, "--index-type", "ivf-sketch"]
    script = tmp_path / "blocks.py"
    script.write_text(IVF_BLOCKS)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    ranks = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    runs = {"one": [sys.executable, str(script)], "two": [*ranks, str(script)]}
    for name, cmd in runs.items():
        (tmp_path / name).mkdir()
        r = subprocess.run([*cmd, "build", *ivf, "--out", str(tmp_path / name / "idx")], cwd=ROOT, capture_output=True,
                           env={**env, "COUNT_DIR": str(tmp_path / name)}, text=True, timeout=600)
        assert r.returncode == 0, r.stdout + r.stderr
    blocks = {k: (tmp_path / "two" / f"rank-{k}").read_text().split() for k in (0, 1)}
    mine = {k: sum(map(int, v)) for k, v in blocks.items()}
    n = read_manifest(tmp_path / "two" / "idx")["counts"]["examples"]
    assert mine[1] > 0 and mine[0] == (n - mine[1]) + n, (blocks, n)  # rank 0: its share, then every row for the sums
    a, b = tmp_path / "one" / "idx" / "faiss", tmp_path / "two" / "idx" / "faiss"
    for f in ("ivf.lists.npy", "ivf.centroids.npy"):
        assert (a / f).read_bytes() == (b / f).read_bytes(), f
    ma, mb = (json.loads((x / "index.json").read_text())["ivf"] for x in (a, b))
    assert ma == mb and ma["nlist"] > 1
    q = [a for t in QUERIES for a in ("--text", t)] + ["-k", "10", "--device", "cpu"]
    assert _cli("query", str(tmp_path / "two" / "idx"), *q) == _cli("query", str(tmp_path / "one" / "idx"), *q)
