"""Builds on several processes (torchrun, gloo, 2 CPU ranks) equal the single-process build, row by row."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from gradindex.spec.manifest import read_manifest, write_manifest
from gradindex.store import STORE_DIR, shard_name
from tests.conftest import make_texts
from tests.test_integrations import _rows, assert_rows_close

ROOT = Path(__file__).resolve().parents[1]
N = 24
pytestmark = pytest.mark.slow


def torchrun(*args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *args]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def cli(*args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "gradindex", *args], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("dist")
    p = d / "train.jsonl"
    p.write_text("".join(json.dumps({"text": t}) + "\n" for t in make_texts(N, seed=7, max_words=16)))
    return d, p


def test_torchrun_build_equals_one_process_and_a_lost_shard_resumes(gpt2_dir, data):
    d, train = data
    common = [str(gpt2_dir), str(train), "--shard-size", "4", "--device", "cpu", "--quiet"]
    cli("build", *common, "--out", str(d / "one"))  # the default: EK-FAC, eigenbasis int4, indices
    out = torchrun("-m", "gradindex", "build", *common, "--out", str(d / "two"))
    assert out.count("examples x 8 layers") == 1  # rank 0 reports
    one, two = read_manifest(d / "one"), read_manifest(d / "two")
    assert one["build"] == two["build"] and two["counts"]["ranks"] == 2
    ids1, r1 = _rows(d / "one")
    ids2, r2 = _rows(d / "two")
    assert (ids1 == ids2).all()
    for n in r1:
        np.testing.assert_array_equal(r1[n], r2[n])
    # raw rows: lose a shard of rank 1's, as a rank that died mid-run leaves it; the same command redoes it alone
    raw = [*common, "--out", str(d / "raw"), "--transcode", "none", "--precondition", "none", "--storage", "fp32",
           "--no-index"]
    torchrun("-m", "gradindex", "build", *raw)
    ref = _rows(d / "raw")[1]
    (d / "raw" / STORE_DIR / shard_name(3)).unlink()
    m = read_manifest(d / "raw")
    m["status"] = "building"
    write_manifest(d / "raw", m)
    out = torchrun("-m", "gradindex", "build", *raw, "--repair")
    assert "(4 computed now)" in out, out
    ids, again = _rows(d / "raw")
    assert (ids == np.arange(N)).all()
    for n in ref:
        np.testing.assert_array_equal(ref[n], again[n])
    assert "intact; 12 files verified" in cli("verify", str(d / "raw"))  # 6 shards and their row hashes


@pytest.mark.parametrize("wrap", ["ddp", "fsdp", "trainer"])
def test_in_loop_capture_under_ddp_and_fsdp_equals_the_offline_build(gpt2_dir, data, wrap):
    """builders/torchrun_loop.py with DDP and FSDP2, and builders/hf_trainer.py (the Trainer's own DDP)."""
    d, train = data
    common = ["--model", str(gpt2_dir), "--data", str(train), "--projection", "8", "--device", "cpu"]
    if not (d / "offline").exists():
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
        subprocess.run([sys.executable, "builders/offline.py", *common, "--out", str(d / "offline"), "--no-index"],
                       cwd=ROOT, env=env, check=True, capture_output=True, timeout=300)
    if wrap == "trainer":
        out = torchrun("builders/hf_trainer.py", *common, "--out", str(d / wrap), "--lr", "0", "--batch-size", "4")
        assert f"captured {N} examples over 3 steps" in out, out
    else:
        out = torchrun("builders/torchrun_loop.py", *common, "--out", str(d / wrap), "--lr", "0", "--batch-size",
                       "4", "--wrap", wrap)
        assert f"captured {N} examples over 3 steps on 2 ranks ({wrap})" in out, out
    ids, live = _rows(d / wrap)
    assert (ids == np.arange(N)).all()
    assert_rows_close(live, _rows(d / "offline")[1], 1e-4)
    m, off = read_manifest(d / wrap), read_manifest(d / "offline")
    assert m["build"]["model_fingerprint"] == off["build"]["model_fingerprint"]  # FSDP2 shards are gathered
    assert m["training"]["ranks"] == 2


@pytest.mark.slow
def test_torchrun_max_restarts_resumes_a_build_whose_rank_was_killed(gpt2_dir, tmp_path):
    """kill -9 of rank 1 mid-capture under `torchrun --max-restarts 1`: the restarted run resumes the build (the
    shards written before the kill are kept) and its rows equal one process's build."""
    from tests.test_sharded_apps import _worker_pid

    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"text": t}) + "\n" for t in make_texts(160, seed=3, max_words=40)))
    common = [str(gpt2_dir), str(train), "--shard-size", "4", "--device", "cpu", "--quiet", "--transcode", "none",
              "--precondition", "none", "--storage", "fp32", "--no-index"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    out = tmp_path / "two"
    agent = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                              "--max-restarts", "1", "--monitor-interval", "1", "-m", "gradindex", "build", *common,
                              "--out", str(out)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    rank1 = _worker_pid(agent, 1)
    deadline = time.monotonic() + 120
    while len(list((out / STORE_DIR).glob("*"))) < 4 and time.monotonic() < deadline and agent.poll() is None:
        time.sleep(0.05)
    os.kill(rank1, signal.SIGKILL)
    printed, _ = agent.communicate(timeout=600)
    assert agent.returncode == 0, printed
    assert "failed (exitcode: -9) local_rank: 1" in printed, printed  # (torchrun's log: the kill landed mid-build)
    # rank 0 names the lost rank in one line when a collective finds it gone first; torchrun's SIGTERM can end rank 0
    # before that (mid-capture), and then nothing is printed: never a traceback
    lost = [x for x in printed.splitlines() if x.startswith("Error:")]
    assert "Traceback" not in printed and len(lost) <= 1, printed
    assert all(x.startswith("Error: rank 0: another rank of the build died") and "run the same command again" in x
               for x in lost), printed
    done = re.search(r"built .* in [0-9.]+ s \(([0-9]+) computed now\)", printed)
    assert done and 0 < int(done.group(1)) < 160, printed  # the restart kept what the first attempt wrote
    cli("build", *common, "--out", str(tmp_path / "one"))
    ids, rows = _rows(out)
    assert (ids == np.arange(160)).all()
    for n, r in _rows(tmp_path / "one")[1].items():
        np.testing.assert_array_equal(r, rows[n])
