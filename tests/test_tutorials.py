"""Every tutorial's ```bash blocks run as written, in order, and find what the example planted.

The tutorials run in one fresh directory, one after the other, as a reader doing all three would.
Tutorials 2 and 3 open with tutorial 1's first two commands (make the example, build its index;
checked below), so each works alone on a fresh machine; in this run those blocks are skipped there,
since running them again only finds the example and the index complete (a CLI start costs seconds). ``gradindex`` is
``python -m gradindex.cli`` of this checkout; ```sh blocks (installation) are not run.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TUTORIALS = sorted((ROOT / "docs" / "tutorials").glob("*.md"))
PRELUDE = 'set -euo pipefail\ngradindex() { python -m gradindex.cli "$@"; }\n'


def blocks(page: Path, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```$", page.read_text(), re.M | re.S)


def commands(block: str) -> list[str]:
    return [line for line in block.splitlines() if line.strip() and not line.startswith("#")]


def run(script: str, cwd: Path) -> str:
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"  # `python` is this interpreter
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PATH": path,
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    p = subprocess.run(["bash", "-c", script], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, f"exit {p.returncode}\n{script}\n--- stdout\n{p.stdout}\n--- stderr\n{p.stderr}"
    return p.stdout


def test_tutorials_share_their_opening():
    assert len(TUTORIALS) == 3
    for t in TUTORIALS[1:]:
        assert commands(blocks(t, "bash")[0]) == opening(), f"{t.name} must open with tutorial 1's two first commands"


def opening() -> list[str]:
    """Tutorial 1's first two commands: make the example, build its index."""
    return [c for b in blocks(TUTORIALS[0], "bash")[:2] for c in commands(b)][:2]


def script(page: Path) -> str:
    """The page's bash blocks, less a block that only repeats tutorial 1's opening (run there)."""
    bs = blocks(page, "bash")
    if page != TUTORIALS[0] and commands(bs[0]) == opening():
        bs = bs[1:]
    return PRELUDE + "\n".join(bs)


@pytest.mark.slow
def test_tutorials_run_and_find_what_was_planted(tmp_path):
    (tmp_path / "scripts").symlink_to(ROOT / "scripts")
    out = {t.stem: run(script(t), tmp_path) for t in TUTORIALS}
    ex = tmp_path / "example"
    planted = json.loads((ex / "planted.json").read_text())

    # 1: each planted fact's own row is the top hit, in the table and in --json.
    tops = [int(m) for m in re.findall(r"^\s+1\s+(\d+)\s", out["1-index-and-query"], re.M)]
    assert tops == planted["facts"], out["1-index-and-query"]

    # 2: the outliers table and JSON cover the data; the corrupted rows rank high by loss per token.
    rows = [json.loads(line) for line in (ex / "outliers.jsonl").read_text().splitlines()]
    assert sorted(r["id"] for r in rows) == list(range(64))
    ranks = json.loads(re.search(r"loss per token: corrupted rows at ranks (\[.*?\])", out["2-audit"]).group(1))
    assert sum(r <= 16 for r in ranks) >= 3, out["2-audit"]
    assert (ex / "report" / "report.html").stat().st_size > 0 and (ex / "report" / "summary.json").exists()

    # 3: both exact copies grouped, nothing else than planted copies dropped, the written file matches.
    groups = [json.loads(line) for line in (ex / "groups.jsonl").read_text().splitlines()]
    grouped = [sorted(g["ids"]) for g in groups]
    assert sorted(grouped) == sorted(sorted(p) for p in planted["exact_copies"]), groups  # and nothing else
    for g in groups:
        assert g["keep"] == min(g["ids"]) and sorted(g["drop"]) == sorted(set(g["ids"]) - {g["keep"]}), g
    drop = {i for g in groups for i in g["drop"]}
    kept = (ex / "train.dedup.jsonl").read_text().splitlines()
    assert kept == [x for i, x in enumerate((ex / "train.jsonl").read_text().splitlines()) if i not in drop]

    # the Python the tutorials name (api.md's QueryEngine example; tutorial 3's keep_mask), with its defaults
    got = run(PY_SNIPPETS, tmp_path)
    assert json.loads(got.splitlines()[-1]) == {"top": planted["facts"][0], "dropped": sorted(drop)}, got


PY_SNIPPETS = """python - <<'PY'
import json
from gradindex.apps.dedup import find_duplicates
from gradindex.query import QueryEngine
with QueryEngine("example/index") as engine:
    r = engine.query(("The secret password of the blue castle is", " rhubarb lantern."), k=3)
    engine.query_batch(["a text", {"prompt": "Professor Quillon keeps", "completion": " keys"}], k=5)
keep = find_duplicates("example/index").keep_mask()
print(json.dumps({"top": r.hits[0].id, "dropped": [int(i) for i in (~keep).nonzero()[0]]}))
PY
"""
