"""Issue 33 (build and CLI hardening): each case gave a traceback, a misleading line or silently other
numbers before; each is now one ``Error:`` line naming the problem and the fix, exit 2, nothing lost."""

from __future__ import annotations

import errno

import pytest
from click.testing import CliRunner

from gradindex.cli import main


def _run(*args) -> tuple[int, str]:
    r = CliRunner().invoke(main, [str(a) for a in args])
    return r.exit_code, r.output


def _error_line(code: int, output: str) -> str:
    assert code == 2 and "Traceback" not in output, output
    errors = [ln for ln in output.splitlines() if ln.startswith("Error:")]
    assert len(errors) == 1, output
    return errors[0]


@pytest.mark.parametrize("option", ["--damping", "--basis-damping"])
@pytest.mark.parametrize("value", ["1e300", "1e39", "1e-45", "0", "-1", "inf", "nan"])
def test_a_damping_outside_float32s_positive_range_is_refused_by_build(gpt2_dir, text_jsonl, tmp_path, option, value):
    """Item 8: ``--damping 1e300`` ended in ``RuntimeError ... overflow`` (float32 rotations)."""
    out = tmp_path / "idx"
    line = _error_line(*_run("build", gpt2_dir, text_jsonl, "--out", out, option, value, "--quiet"))
    assert option in line and "valid range 1.2e-38 to 3.4e+38" in line, line
    assert not out.exists()


@pytest.mark.parametrize("option", ["--damping", "--refine-damping"])
def test_a_damping_outside_float32s_positive_range_is_refused_by_query(tmp_path, option):
    line = _error_line(*_run("query", tmp_path, "--prompt", "a", option, "1e300"))
    assert option in line and "valid range" in line, line


@pytest.mark.parametrize("value, taken", [("3.4028235e38", True), ("3.4028234663852886e38", True),
                                          ("3.4028236e38", False), ("1.1754944e-38", True), ("1.1754942e-38", False)])
def test_float32s_printed_limits_are_taken_and_anything_beyond_refused(tmp_path, value, taken):
    """One ``FLOAT32_MAX`` (float32's exact max): the CLI compares a damping after rounding it to float32, so the
    printed literal ``3.4028235e38`` (a little above the max as a Python float) is taken, the next digit up is not."""
    from gradindex.methods import FLOAT32_MAX, FLOAT32_TINY, in_float32_range

    assert (FLOAT32_MAX, FLOAT32_TINY) == (3.4028234663852886e38, 1.1754943508222875e-38)
    assert in_float32_range(float(value)) is taken
    line = _error_line(*_run("query", tmp_path / "missing", "--prompt", "a", "--damping", value))
    assert ("valid range" in line) is not taken, line


def test_a_damping_whose_absolute_value_overflows_float32_is_refused():
    """A relative damping inside float32's range can still overflow once scaled, δ = d·mean(Λ): refused with the
    largest damping that layer takes, not applied as an infinite δ (every score zero)."""
    import numpy as np

    from gradindex.methods import FLOAT32_MAX, absolute_damping

    assert absolute_damping(3e38, np.array([0.25, 0.75])) == pytest.approx(1.5e38)
    with pytest.raises(ValueError, match=r"beyond float32's range .* use a damping below 3\.4e\+37"):
        absolute_damping(3e38, np.array([5.0, 15.0]))
    assert np.isfinite(np.float32(absolute_damping(FLOAT32_MAX / 10 * 0.999, np.array([10.0]))))


def test_the_float32_range_is_accepted(gpt2_dir, text_jsonl, tmp_path):
    code, out = _run("build", gpt2_dir, text_jsonl, "--out", tmp_path / "idx", "--damping", "1e30", "--storage", "fp32",
                     "--transcode", "none", "--device", "cpu", "--quiet", "--max-length", "16", "--no-index")
    assert code == 0, out


BUILD = ["--max-length", "32", "--shard-size", "16", "--device", "cpu", "--quiet"]


def _no_space(*a, **k):
    raise OSError(errno.ENOSPC, "No space left on device")


def _full_disk_line(code: int, output: str, stage: str) -> str:
    line = _error_line(code, output)
    assert "is full" in line and f"during the {stage}" in line and "re-run the same command" in line, line
    return line


def test_a_full_disk_during_the_capture_names_the_stage_and_the_space_needed_and_resumes(gpt2_dir, text_jsonl,
                                                                                         tmp_path, monkeypatch):
    """Item 7: the capture's line named no space needed."""
    from gradindex.store import shards

    real, calls = shards.ShardWriter.append, []

    def second_fails(self, *a, **k):
        calls.append(1)
        return _no_space() if len(calls) == 2 else real(self, *a, **k)

    monkeypatch.setattr(shards.ShardWriter, "append", second_fails)
    args = ["build", gpt2_dir, text_jsonl, "--out", tmp_path / "idx", *BUILD]
    line = _full_disk_line(*_run(*args), "capture")
    assert "which needs about" in line and "MiB free for the rest" in line and "kept" in line, line
    monkeypatch.undo()
    assert _run(*args)[0] == 0


def test_the_covariance_sums_check_the_disk_before_hdf5_writes_them(tmp_path, monkeypatch):
    """Item 7: HDF5 hitting a full disk inside the sums' write left the shard unclosable: a segfault (rc 139)
    after the message. Now ENOSPC is raised before HDF5 writes anything, and the file closes cleanly."""
    import types

    import h5py
    import torch

    from gradindex import diskspace
    from gradindex.store.covariance import write_covariance

    kfac = types.SimpleNamespace(A={"l": torch.ones(64, 64)}, S={"l": torch.ones(64, 64)}, tokens={"l": 3},
                                 layers=["l"])
    monkeypatch.setattr(diskspace, "free_bytes", lambda p: 1000)
    with h5py.File(tmp_path / "shard.h5", "w") as f:
        with pytest.raises(OSError) as e:
            write_covariance(f, kfac)
        assert e.value.errno == errno.ENOSPC and "covariance" not in f


def test_a_full_disk_during_the_fit_says_disk_full_not_numpys_partial_write(gpt2_dir, text_jsonl, tmp_path,
                                                                            monkeypatch):
    """Item 7: ``Error: 2774016 requested and 524288 written`` (NumPy's tofile on a full disk) never said the
    disk was full."""
    from gradindex.precondition import rotated

    def partial(*a, **k):
        raise OSError("2774016 requested and 524288 written")

    monkeypatch.setattr(rotated.RotatedRows, "put", partial)
    args = ["build", gpt2_dir, text_jsonl, "--out", tmp_path / "idx", *BUILD]
    line = _full_disk_line(*_run(*args), "fit and transcode")
    assert "requested and" not in line and "captured rows are kept" in line, line
    monkeypatch.undo()
    assert _run(*args)[0] == 0


def test_a_full_disk_during_gradindex_index_is_one_line_not_a_faiss_traceback(gpt2_dir, text_jsonl, tmp_path,
                                                                              monkeypatch):
    """Item 7: ``gradindex index --index-type Flat`` on a full disk ended in FAISS's RuntimeError traceback."""
    import faiss

    d = tmp_path / "idx"
    assert _run("build", gpt2_dir, text_jsonl, "--out", d, *BUILD, "--no-index")[0] == 0

    def faiss_full(*a, **k):
        raise RuntimeError("Error in faiss::FileIOWriter::operator()(...) at faiss/impl/io.cpp:98: Error: "
                           "'ret == (n)' failed: write error in /x: 0 != 1 (No space left on device)")

    monkeypatch.setattr(faiss, "write_index", faiss_full)
    line = _full_disk_line(*_run("index", d, "--index-type", "Flat", "--quiet"), "FAISS stage")
    assert "which needs about" in line and "kept" in line, line
    monkeypatch.undo()
    code, out = _run("index", d, "--index-type", "Flat", "--quiet")
    assert code == 0, out


@pytest.mark.parametrize("bug", [TypeError("unsupported operand"), OSError(errno.EIO, "I/O error"), MemoryError()])
def test_a_bug_keeps_its_traceback_instead_of_reading_as_bad_input(tmp_path, monkeypatch, bug):
    """Issue 32 item 6: ``USER_ERRORS`` turned any ``TypeError``/``OSError``/``MemoryError`` into ``Error: ...``,
    exit 2, so a bug read as bad input."""
    from gradindex.spec import manifest

    def broken(*a, **k):
        raise bug

    monkeypatch.setattr(manifest, "read_manifest", broken)
    r = CliRunner().invoke(main, ["index", str(tmp_path)])
    assert r.exit_code == 1 and isinstance(r.exception, type(bug)), r.output
    assert "Error:" not in r.output


@pytest.mark.parametrize("error", [OSError(errno.ENOSPC, "No space left on device"),
                                   FileNotFoundError("no file 'x'"), ValueError("bad value")])
def test_the_library_s_own_errors_and_expected_os_conditions_stay_one_line(tmp_path, monkeypatch, error):
    from gradindex.errors import CorruptFileError
    from gradindex.spec import manifest

    def refused(*a, **k):
        raise error

    monkeypatch.setattr(manifest, "read_manifest", refused)
    line = _error_line(*_run("index", tmp_path))
    assert ("disk is full" in line) == (getattr(error, "errno", None) == errno.ENOSPC), line
    assert issubclass(CorruptFileError, OSError)


LEAK = """
import sys, warnings
import transformers
from gradindex import model
from gradindex.cli import main
real = model.load_causal_lm
def leaky(*a, **k):
    transformers.utils.logging.get_logger("transformers.modeling_utils").warning("LEAK-LOG")
    exec("import warnings; warnings.warn('LEAK-WARN', FutureWarning)", {"__name__": "transformers.fake"})
    return real(*a, **k)
model.load_causal_lm = leaky
sys.argv[0] = "gradindex"
main()
"""


@pytest.mark.parametrize("verbose", [False, True])
def test_transformers_warnings_stay_out_of_the_cli_output_unless_verbose(gpt2_dir, verbose):
    """Item 13: transformers' log warnings and deprecation warnings leaked into the commands' output."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("TRANSFORMERS_")}
    args = [sys.executable, "-c", LEAK, *(["-v"] if verbose else []), "layers", str(gpt2_dir)]
    r = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert ("LEAK-LOG" in r.stderr) == verbose and ("LEAK-WARN" in r.stderr) == verbose, r.stderr
    assert "layers selected" in r.stdout


def test_a_resume_with_another_storage_names_the_storage_option(gpt2_dir, text_jsonl, tmp_path):
    """Item 13: a default (transcoded) index resumed with ``--storage int8`` named only "row transcode"."""
    d = tmp_path / "idx"
    assert _run("build", gpt2_dir, text_jsonl, "--out", d, *BUILD, "--no-index")[0] == 0
    line = _error_line(*_run("build", gpt2_dir, text_jsonl, "--out", d, *BUILD, "--no-index", "--storage", "int8"))
    first = line.split("cannot be resumed: ")[1].split(";")[0]
    assert '--storage (index: "int4", now: "int8")' in first and "--overwrite" in line, line


def test_a_resume_on_other_data_names_the_first_differing_row(gpt2_dir, text_jsonl, tmp_path):
    """Item 13: "data set differs" named no row."""
    import json

    d = tmp_path / "idx"
    assert _run("build", gpt2_dir, text_jsonl, "--out", d, *BUILD, "--no-index")[0] == 0
    rows = text_jsonl.read_text().splitlines()
    rows[7] = json.dumps({"text": "a changed row"})
    other = tmp_path / "other.jsonl"
    other.write_text("\n".join(rows) + "\n")
    line = _error_line(*_run("build", gpt2_dir, other, "--out", d, *BUILD, "--no-index"))
    assert "data set differs" in line and "first at row 7" in line, line


@pytest.mark.parametrize("content", ["", "\n\n"])
def test_an_empty_queries_file_says_so_not_nothing_to_index(default_index, tmp_path, content):
    """Item 13: ``query --queries empty.jsonl`` said "nothing to index"."""
    q = tmp_path / "empty.jsonl"
    q.write_text(content)
    line = _error_line(*_run("query", default_index, "--queries", q, "--device", "cpu"))
    assert "query file" in line and "nothing to index" not in line and "one query a line" in line, line


@pytest.mark.parametrize("index_type", ["auto", "Flat"])
def test_the_advised_repair_command_leaves_an_index_that_answers_queries(gpt2_dir, text_jsonl, tmp_path, index_type):
    """Item 9: the repair command printed in errors added ``--no-index``, so the query that followed failed
    with ``no FAISS indices ... (index.json is missing)``."""
    import json
    import shlex

    d = tmp_path / "idx"
    assert _run("build", gpt2_dir, text_jsonl, "--out", d, *BUILD, "--index-type", index_type)[0] == 0
    shard = d / "store" / "shard-00001.h5"
    shard.write_bytes(shard.read_bytes()[:-100])
    report = json.loads(CliRunner().invoke(main, ["verify", str(d), "--json"]).output)
    command = shlex.split(report["damaged"][0]["repair"])
    assert command[:2] == ["gradindex", "build"] and "--no-index" not in command, command
    if index_type != "auto":
        assert command[command.index("--index-type") + 1] == index_type
    code, out = _run(*command[1:], "--quiet")
    assert code == 0, out
    code, out = _run("query", d, "--text", "the cat sat", "-k", "2", "--device", "cpu")
    assert code == 0, out
