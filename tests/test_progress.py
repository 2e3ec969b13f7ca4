"""Progress off a terminal: whole lines (no carriage returns, no blank lines), periodic on long work."""

from __future__ import annotations

import tqdm.std
from click.testing import CliRunner

from gradindex import progress
from gradindex.cli import main
from gradindex.progress import LineProgress, progress_bar


def test_a_piped_build_log_has_whole_lines_only(gpt2_dir, text_jsonl, tmp_path):
    r = CliRunner().invoke(main, ["build", str(gpt2_dir), str(text_jsonl), "--out", str(tmp_path / "i"),
                                  "--max-length", "48", "--shard-size", "16", "--device", "cpu"])
    assert r.exit_code == 0, r.output
    out = r.output
    assert "\r" not in out and "\x1b" not in out, repr(out)
    lines = out.splitlines()
    assert lines and all(line.strip() for line in lines), repr(out)
    assert any(line.startswith("capture: 40/40 ex in ") for line in lines), out
    assert any(line.startswith("transcode: 40/40 ex in ") for line in lines), out
    assert lines[-1].startswith("indices built"), out  # (the store tier writes no index: no bar of its own)


def test_line_progress_reports_every_interval_and_at_the_end(capsys):
    with LineProgress(total=10, desc="capture", unit="ex", interval=0.0) as bar:
        for _ in range(4):
            bar.update(2)
        bar.set_postfix_str("layer.1")
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("capture: 2/10 ex (20%) after ") and "left" in err[0] and "ex/s" in err[0]
    assert err[3].startswith("capture: 8/10 ex (80%) after ") and len(err) == 5
    assert err[-1].startswith("capture: 8/10 ex in ") and "layer.1" not in err[-1]
    assert list(LineProgress(range(3), desc="norms", leave=False, interval=1e9)) == [0, 1, 2]
    assert capsys.readouterr().err == ""  # leave=False, nothing due: silent


def test_a_terminal_gets_tqdm_and_a_pipe_gets_lines(monkeypatch):
    monkeypatch.setattr(progress, "_interactive", lambda: True)
    with progress_bar(total=3, desc="x") as bar:
        assert isinstance(bar, tqdm.std.tqdm)
    monkeypatch.setattr(progress, "_interactive", lambda: False)
    assert isinstance(progress_bar(total=3), LineProgress)
    assert isinstance(progress_bar(total=3, disable=True), tqdm.std.tqdm)


def test_work_done_before_a_resume_counts_in_the_total_not_the_rate(capsys):
    """A resumed capture's shards already on disk were counted as done now: "4,000/4,000 ex in 0.0 s, 10,580,835
    ex/s"."""
    with LineProgress(total=10, desc="capture", unit="ex", interval=1e9) as bar:
        progress.skip(bar, 10)
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("capture: 10/10 ex in ") and "ex/s" not in line, line
    bar = tqdm.std.tqdm(total=10, disable=True)
    progress.skip(bar, 4)  # (a silent bar: no error)
