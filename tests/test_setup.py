"""scripts/setup.sh re-installs only when something changed (issue 7 item 6), and the CLI wrapper
reaches the CLI from any folder (item 3). A fake ``.venv`` records every pip call instead of running it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

FAKE_PYTHON = """#!/usr/bin/env bash
echo "$@" >> "$(dirname "$0")/../calls.log"
case "$*" in *"pip show"*) exit 1 ;; esac
exit 0
"""


def _repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "setup.sh", repo / "scripts" / "setup.sh")
    shutil.copy(ROOT / "pyproject.toml", repo / "pyproject.toml")
    bin_ = repo / ".venv" / "bin"
    bin_.mkdir(parents=True)
    (bin_ / "python").write_text(FAKE_PYTHON)
    (bin_ / "python").chmod(0o755)
    (bin_ / "activate").write_text(f'export PATH="{bin_}:$PATH"\n')
    return repo


def _setup(repo: Path, **env) -> list[str]:
    log = repo / ".venv" / "calls.log"
    log.unlink(missing_ok=True)
    res = subprocess.run(["bash", "scripts/setup.sh"], cwd=repo, capture_output=True, text=True,
                         env={**os.environ, "PYTHON": sys.executable, "GRADINDEX_FAISS": "cpu", **env})
    assert res.returncode == 0, res.stderr
    return log.read_text().splitlines() if log.exists() else []


def test_setup_installs_once_and_again_only_when_pyproject_or_faiss_changes(tmp_path):
    repo = _repo(tmp_path)
    first = _setup(repo)
    assert any("pip install" in c and ".[dev,cpu]" in c for c in first), first
    assert _setup(repo) == []  # nothing changed: no pip at all
    with open(repo / "pyproject.toml", "a") as f:
        f.write("\n# changed\n")
    assert any(".[dev,cpu]" in c for c in _setup(repo))
    assert _setup(repo) == []
    assert any(".[dev,gpu]" in c for c in _setup(repo, GRADINDEX_FAISS="gpu"))


def test_the_wrapper_runs_the_cli_from_another_folder(tmp_path):
    env = {**os.environ, "GRADINDEX_PYTHON": sys.executable}
    res = subprocess.run([str(ROOT / "scripts" / "gradindex"), "--version"], cwd=tmp_path, env=env,
                         capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout.startswith("gradindex, version"), res.stderr
