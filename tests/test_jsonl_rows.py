"""A query's hit texts from a JSONL file without `datasets` (issue 17: a one-off query's cost): the rows
equal what `datasets` reads, blank lines and CRLF included, and a file read differently falls back to it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import gradindex.query.jsonl as jsonl
from gradindex.cli import main
from gradindex.data import load_records
from gradindex.query.jsonl import JsonlRows

ROOT = Path(__file__).resolve().parents[1]


def _awkward_file(path: Path, n: int = 40) -> list[dict]:
    rows = [{"text": f"row {i} of the file, café {'x' * (i % 5)}", "n": i} for i in range(n)]
    with open(path, "w", encoding="utf-8", newline="") as f:
        for i, r in enumerate(rows):
            f.write(json.dumps(r, ensure_ascii=i % 2 == 0) + ("\r\n" if i % 7 == 0 else "\n"))
            if i % 9 == 0:
                f.write("\n" if i % 2 else "\r\n")  # blank lines: no record
        f.seek(f.tell() - 1)
        f.truncate()  # no newline after the last record
    return rows


def test_rows_equal_what_datasets_reads(tmp_path, monkeypatch):
    path = tmp_path / "d.jsonl"
    rows = _awkward_file(path)
    monkeypatch.setattr(jsonl, "BLOCK", 29)  # line breaks across blocks
    fast, ref = JsonlRows(path), load_records(path)
    assert len(fast) == len(ref) == len(rows)
    ids = [0, 39, 9, 10, 18, 7, 8]
    assert list(fast.select(ids)) == ref.select(ids).to_list() == [rows[i] for i in ids]


@pytest.fixture(scope="module")
def index(tmp_path_factory, gpt2_dir, text_jsonl):
    out = tmp_path_factory.mktemp("jsonl") / "index"
    r = CliRunner().invoke(main, ["build", str(gpt2_dir), str(text_jsonl), "--out", str(out), "--projection", "4",
                                  "--device", "cpu", "--quiet"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return out


def test_a_one_off_query_shows_texts_without_importing_datasets(index, text_jsonl):
    texts = [json.loads(line)["text"] for line in open(text_jsonl)]
    code = ("import json, sys\nfrom gradindex.cli import main\n"
            f"main(['query', {str(index)!r}, '--text', 'the cat sat on a mat', '-k', '4', '--json'], "
            "standalone_mode=False)\n"
            "print('loaded:', json.dumps([m for m in ('datasets', 'pandas') if m in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    hits, loaded = out.strip().splitlines()[-2:]
    assert json.loads(loaded.split(" ", 1)[1]) == []
    got = json.loads(hits)
    assert len(got) == 4 and all(g["text"] == texts[g["id"]] for g in got)


def test_rows_read_differently_fall_back_to_datasets(index, text_jsonl, monkeypatch):
    from gradindex.query import QueryEngine

    texts = [json.loads(line)["text"] for line in open(text_jsonl)]
    wrong = JsonlRows.select
    monkeypatch.setattr(JsonlRows, "select", lambda self, ids: wrong(self, [(int(i) + 1) % len(self) for i in ids]))
    with QueryEngine(index, device="cpu") as engine:
        r = engine.query("the cat sat on a mat", k=4)
    assert [h.text for h in r.hits] == [texts[h.id] for h in r.hits]
    assert isinstance(engine.texts._ds, type(load_records(text_jsonl)))  # it read the file as the build did
    assert np.all([h.text is not None for h in r.hits])
