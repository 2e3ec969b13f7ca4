"""The store's writer holds no rows in memory: the anonymous RSS a build's writes add stays flat in N.

HDF5's default chunk cache (1 MiB per dataset per open file) kept every row written so far: 1.1 GB after
1,000 SmolLM2-width rows (the real-model build's RSS grew with N, issue 30)."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest

from gradindex.store.shards import ShardWriter


def anon_mb() -> float:
    try:
        lines = Path("/proc/self/status").read_text().splitlines()
    except OSError:
        pytest.skip("needs /proc/self/status (Linux) to read the process's anonymous RSS")
    return int(next(x for x in lines if x.startswith("RssAnon")).split()[1]) / 1024


DIMS = {f"layer{i}": 3000 for i in range(40)}  # 40 layers, 6 KB a row each in float16


def test_shard_writer_holds_no_rows(tmp_path):
    rng = np.random.default_rng(0)
    g = {n: rng.standard_normal((8, d)).astype(np.float32) for n, d in DIMS.items()}
    w = ShardWriter(tmp_path / "shard.h5", 0, 400, DIMS, "fp", storage="fp16")
    w.open()
    w.append(np.arange(8), g)
    before = anon_mb()
    for b in range(1, 50):  # 392 rows more: 94 MB written
        w.append(np.arange(8 * b, 8 * b + 8), g)
    grew = anon_mb() - before
    w.finish()
    assert grew < 24, f"writing 94 MB of rows grew the anonymous RSS by {grew:.0f} MB"
    with h5py.File(w.final, "r") as f:
        np.testing.assert_array_equal(f["grads/layer3"][392:400], g["layer3"].astype(np.float16))

