"""The README's usage commands, run exactly as written (issue 7 item 3).

Convention: the fenced ``bash`` block right after the line ``<!-- tests/test_readme.py runs every
line of the next block -->`` is run line by line with ``bash -c``, from a folder that holds
``scripts/`` (the real one) and a ``demo_out/`` laid out as ``scripts/demo.py`` leaves it, with a
small model. ``scripts/gradindex`` runs with ``GRADINDEX_PYTHON`` set to this interpreter (its
set-up step is tested in tests/test_setup.py).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import make_texts

ROOT = Path(__file__).resolve().parents[1]
MARK = "<!-- tests/test_readme.py runs every line of the next block -->"
PY_MARK = "<!-- tests/test_readme.py runs the next block -->"


def readme_commands(readme: str) -> list[str]:
    """Every command line of the marked ``bash`` blocks (comments and blank lines dropped)."""
    lines = readme.splitlines()
    out = []
    for i, line in enumerate(lines):
        if line.strip() != MARK:
            continue
        assert lines[i + 1].strip() == "```bash", f"README line {i + 2}: the mark must precede a ```bash block"
        j = i + 2
        while lines[j].strip() != "```":
            if lines[j].strip() and not lines[j].lstrip().startswith("#"):
                out.append(lines[j].strip())
            j += 1
    return out


def python_blocks(readme: str) -> list[str]:
    """The marked ``python`` blocks."""
    lines = readme.splitlines()
    out = []
    for i, line in enumerate(lines):
        if line.strip() == PY_MARK:
            assert lines[i + 1].strip() == "```python", f"README line {i + 2}: the mark must precede a ```python block"
            end = lines.index("```", i + 2)
            out.append("\n".join(lines[i + 2:end]))
    return out


def _demo():
    spec = importlib.util.spec_from_file_location("gradindex_demo", ROOT / "scripts" / "demo.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_marker_finds_the_commands():
    cmds = readme_commands((ROOT / "README.md").read_text())
    assert len(cmds) >= 4 and all(c.startswith("scripts/gradindex ") for c in cmds)
    assert {c.split()[1] for c in cmds} >= {"build", "info", "query"}
    assert readme_commands(f"x\n{MARK}\n```bash\n# c\na b\n\nc d\n```\n") == ["a b", "c d"]


def test_readme_stays_a_newcomers_page():
    """Issue 32 item 6: at most 100 lines (the quality tables live in docs/quality.md, the options in
    docs/building.md), and it says why its lookups use ``ekfac-selfnorm``."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 100
    assert "(docs/quality.md)" in readme and "(docs/building.md)" in readme
    assert "The examples use **`ekfac-selfnorm`** for lookups" in readme


def _demo_out(tmp_path, tokenizer):
    """``tmp_path/demo_out`` as the demo leaves it, with a small model (and the real ``scripts/``)."""
    from fixtures.tiny import save_model_dir, tiny_gpt2

    demo = _demo()
    work = tmp_path / demo.WORKDIR
    docs = make_texts(24, seed=5)
    for row, (p, c) in enumerate(demo.FACTS):
        docs.insert(3 * row + 1, f"{p}{c} Remember it well.")
    demo.write_data(work, docs)
    save_model_dir(tiny_gpt2(vocab_size=len(tokenizer), n_layer=1, n_embd=16, n_head=2, n_positions=128),
                   tokenizer, work / "model")
    (tmp_path / "scripts").symlink_to(ROOT / "scripts")
    return demo


def test_readme_python_runs_as_written(tmp_path, tokenizer, monkeypatch):
    _demo_out(tmp_path, tokenizer)
    blocks = python_blocks((ROOT / "README.md").read_text())
    assert blocks, "README.md has no marked python block"
    monkeypatch.chdir(tmp_path)
    for code in blocks:
        exec(compile(code, "README.md", "exec"), {"__name__": "readme"})
    from gradindex.spec.manifest import read_manifest

    assert read_manifest(tmp_path / "my-store")["status"] == "complete"


def test_readme_python_runs_from_a_folder_beside_the_clone(tmp_path, tokenizer, monkeypatch):
    """Issue 33 item 13: the block saved as a script and run from outside the clone (where scripts/demo.sh
    left ``demo_out/``) found no ``demo_out/model``; it now falls back to the clone gradindex runs from."""
    import gradindex

    clone, beside = tmp_path / "clone", tmp_path / "beside"
    clone.mkdir(), beside.mkdir()
    _demo_out(clone, tokenizer)
    monkeypatch.setattr(gradindex, "__file__", str(clone / "gradindex" / "__init__.py"))  # an editable install's
    monkeypatch.chdir(beside)
    for code in python_blocks((ROOT / "README.md").read_text()):
        exec(compile(code, "README.md", "exec"), {"__name__": "__main__"})
    from gradindex.spec.manifest import read_manifest

    assert read_manifest(beside / "my-store")["status"] == "complete"


@pytest.mark.slow
def test_readme_commands_run_as_written(tmp_path, tokenizer):
    demo = _demo_out(tmp_path, tokenizer)
    env = {**os.environ, "GRADINDEX_PYTHON": sys.executable, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    cmds = readme_commands((ROOT / "README.md").read_text())
    assert len(cmds) >= 4, "README.md has no marked bash block"
    for cmd in cmds:
        res = subprocess.run(["bash", "-c", cmd], cwd=tmp_path, env=env, capture_output=True, text=True)
        assert res.returncode == 0, f"{cmd}\n{res.stdout}\n{res.stderr}"
        assert "Traceback" not in res.stderr, res.stderr
        if " query " in cmd and "--json" in cmd:
            hits = [json.loads(line) for line in res.stdout.splitlines()]
            assert len(hits) == len(demo.FACTS) and all(h for h in hits)
        elif " query " in cmd:
            assert "query 1: The secret password" in res.stdout and "most influential" in res.stdout
