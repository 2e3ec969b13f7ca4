"""A full disk (issue 21 item 6), on a real size-limited file system (a tmpfs mounted for the test).

Before any stage the build compares the disk's free space with what the stage writes and refuses with
one line; a disk that fills anyway (another writer) ends the capture, the fit/transcode or the FAISS
stage with one line naming what is kept, never a traceback or a crash; a re-run after freeing space
ends with the index an unbroken build makes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import h5py
import numpy as np
import pytest
from click.testing import CliRunner

from gradindex.cli import main
from gradindex.store import Store

ARGS = ["--max-length", "48", "--quiet", "--device", "cpu", "--shard-size", "16"]
NO_PRECHECK = ("import sys, gradindex.pipeline as p; p._check_disk = lambda *a: None; "
               "p.check_space = lambda *a, **k: None; from gradindex.cli import main; sys.argv[0] = 'gradindex'; "
               "main()")
"""The CLI with the free-space checks off: the disk then fills while a stage writes (as when another
process fills it)."""


@pytest.fixture
def small_fs(tmp_path):
    """Mount a tmpfs of a given size (resizable); unmounted at the end. Skipped where mounting is not allowed."""
    mounts = []

    def mount(size: int) -> Path:
        d = tmp_path / f"fs-{uuid.uuid4().hex[:6]}"
        d.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(d)], capture_output=True)
        if r.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
        mounts.append(d)
        return d

    yield mount
    for d in mounts:
        subprocess.run(["umount", "-l", str(d)], capture_output=True)


def resize(d: Path, size: int) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size}", str(d)], check=True)


def cli(args: list[str], precheck: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "gradindex.cli"] if precheck else [sys.executable, "-c", NO_PRECHECK]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run(cmd + args, capture_output=True, text=True, env=env, timeout=600)


def plan_bytes(gpt2_dir, text_jsonl) -> dict:
    import json

    opts = [a for a in ARGS if a != "--quiet"]
    r = CliRunner().invoke(main, ["plan", str(gpt2_dir), str(text_jsonl), "--json", "--batches", "0", *opts])
    assert r.exit_code == 0, r.output
    return json.loads(r.output.strip().splitlines()[-1])["bytes"]


def one_error_line(r: subprocess.CompletedProcess) -> str:
    """The run ended with exit 2 and exactly one ``Error:`` line, no traceback, no crash."""
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    assert "Traceback" not in r.stderr and "Exception ignored" not in r.stderr, r.stderr[-3000:]
    errors = [x for x in r.stderr.splitlines() if x.startswith("Error:")]
    assert len(errors) == 1, r.stderr
    return errors[0]


def rows_and_si(d: Path) -> tuple[dict, np.ndarray]:
    with Store(d) as st:
        rows = {n: st.read_rows(np.arange(len(st)), [n])[n] for n in st.layers}
    with h5py.File(d / "precond" / "ekfac.h5", "r") as f:
        return rows, f["self_influence_layers"][:]


@pytest.fixture(scope="module")
def reference(gpt2_dir, text_jsonl, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "idx"
    r = CliRunner().invoke(main, ["build", str(gpt2_dir), str(text_jsonl), "--out", str(out)] + ARGS)
    assert r.exit_code == 0, r.output
    return rows_and_si(out)


def same_index(d: Path, reference) -> None:
    rows, si = rows_and_si(d)
    for n, v in reference[0].items():
        np.testing.assert_array_equal(rows[n], v)
    np.testing.assert_array_equal(si, reference[1])
    assert (d / "faiss").is_dir()


def test_a_disk_too_small_for_the_plan_is_refused_before_any_work(gpt2_dir, text_jsonl, small_fs):
    b = plan_bytes(gpt2_dir, text_jsonl)
    fs = small_fs(b["peak"] // 2)
    line = one_error_line(cli(["build", str(gpt2_dir), str(text_jsonl), "--out", str(fs / "idx")] + ARGS))
    assert "not enough disk space for the build" in line and "free" in line and "re-run" in line, line
    assert not (fs / "idx" / "store").exists() or not any((fs / "idx" / "store").iterdir())


@pytest.mark.parametrize("stage", ["capture", "fit and transcode"])
def test_a_disk_that_fills_during_a_stage_ends_in_one_line_and_resumes(gpt2_dir, text_jsonl, small_fs, reference,
                                                                       stage):
    b = plan_bytes(gpt2_dir, text_jsonl)
    size = b["capture"] // 2 if stage == "capture" else b["capture"] + b["precond"] + b["store"] // 3
    fs = small_fs(size)
    args = ["build", str(gpt2_dir), str(text_jsonl), "--out", str(fs / "idx")] + ARGS
    line = one_error_line(cli(args, precheck=False))
    assert "is full" in line and f"during the {stage}" in line and "kept" in line and "re-run" in line, line
    resize(fs, 4 * b["peak"])
    r = cli(args)
    assert r.returncode == 0, r.stderr[-3000:]
    same_index(fs / "idx", reference)


def test_a_disk_that_fills_before_the_faiss_stage_ends_in_one_line_and_resumes(gpt2_dir, text_jsonl, small_fs,
                                                                               reference, monkeypatch):
    from gradindex import pipeline

    b = plan_bytes(gpt2_dir, text_jsonl)
    fs = small_fs(2 * b["peak"])
    filler = fs / "other-process.bin"
    real = pipeline.build_indices

    def fill_then_index(*a, **k):  # another process fills the disk right before the FAISS stage writes
        with open(filler, "wb") as f:
            try:
                while True:
                    f.write(b"\0" * (1 << 16))
                    f.flush()
            except OSError:
                pass
        return real(*a, **k)

    monkeypatch.setattr(pipeline, "build_indices", fill_then_index)
    args = ["build", str(gpt2_dir), str(text_jsonl), "--out", str(fs / "idx")] + ARGS
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2, r.output
    assert "during the FAISS stage" in r.output and "complete and kept" in r.output, r.output
    monkeypatch.undo()
    filler.unlink()
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    same_index(fs / "idx", reference)
