"""The capture benchmark runs end to end at tiny sizes and writes the figures it promises."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_capture_benchmark_quick_mode_writes_every_figure(tmp_path):
    out = tmp_path / "capture.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "capture.py"), "--quick", "--sequences", "16",
           "--seq-len", "16", "--sweep-lengths", "8,32", "--sweep-projections", "4x4", "--sweep-tokens", "64",
           "--out", str(out)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    c = res["compare"]
    assert set(c["sequences_per_s"]) == {"floor", "build", "capture", "naive_torch_func"}
    assert all(v > 0 for v in c["sequences_per_s"].values())
    assert c["ratio_to_floor"]["floor"] == pytest.approx(1.0)
    assert c["two_threads"]["speedup"]["build"] > 0
    assert [r["seq_len"] for r in res["sweep"]] == [8, 32]
    for r in res["sweep"]:
        assert set(r["capture_seq_per_s"]) == {"auto", "factorized", "materialized"}
        assert sum(r["routes_chosen"].values()) > 0
        assert r["auto_over_best"] >= 1.0
    assert "floor" in proc.stdout and "routing sweep" in proc.stdout
