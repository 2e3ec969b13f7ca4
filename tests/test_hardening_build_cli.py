"""Issue 33 (build and CLI hardening): each case gave a traceback, a misleading line or silently other
numbers before; each is now one ``Error:`` line naming the problem and the fix, exit 2, nothing lost."""

from __future__ import annotations

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


def test_the_float32_range_is_accepted(gpt2_dir, text_jsonl, tmp_path):
    code, out = _run("build", gpt2_dir, text_jsonl, "--out", tmp_path / "idx", "--damping", "1e30", "--storage", "fp32",
                     "--transcode", "none", "--device", "cpu", "--quiet", "--max-length", "16", "--no-index")
    assert code == 0, out
