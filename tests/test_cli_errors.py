"""Bad input through the CLI: one line ``Error: ...``, exit code 2, no traceback, nothing silently wrong.

Covers issue 7 item 15 (tracebacks) and item 9 (zero-gradient rows written with exit 0): each case
failed before (a traceback, or exit 0 with a store of zero rows).
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
from click.testing import CliRunner

from gradindex.cli import main


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _no_tokenizer(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        if not f.name.startswith("tokenizer") and f.name not in ("vocab.json", "merges.txt", "special_tokens_map.json"):
            shutil.copy(f, dst / f.name)
    return dst


def _corrupt_weights(src, dst):
    shutil.copytree(src, dst)
    w = dst / "model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    return dst


# case -> (how to change the build command, the words the one-line error must hold)
BUILD_CASES = {
    "ids_out_of_vocab": (lambda a, t: {"data": _jsonl(t / "d.jsonl", [{"input_ids": [1, 2, 3]},
                                                                        {"input_ids": [1, 99999, 3]}])},
                         r"row 1: token id 99999 is outside the model's vocabulary \(0\.\.\d+\)"),
    "ids_negative": (lambda a, t: {"data": _jsonl(t / "d.jsonl", [{"input_ids": [1, -5, 3]}])},
                     r"row 0: token id -5 is outside the model's vocabulary"),
    "projection_huge": (lambda a, t: {"args": ["--projection", "100000"]},
                        r"--projection 100000 stores 80,000,000,000 numbers per example.*use a smaller --projection"),
    "device_tpu": (lambda a, t: {"args": ["--device", "tpu"]}, r"device 'tpu' is not one of auto, cpu, cuda"),
    "corrupt_weights": (lambda a, t: {"model": _corrupt_weights(a, t / "m")},
                        r"could not load the weights in .*corrupt: save the model there again"),
    "ivf_more_lists_than_rows": (lambda a, t: {"args": ["--index-type", "IVF1024,Flat"]},
                                 r"--index-type IVF1024,Flat has 1024 lists, more than the 40 examples"),
    "mixed_jsonl": (lambda a, t: {"data": _jsonl(t / "d.jsonl", [{"text": "the cat sat"},
                                                                   {"prompt": "a dog", "completion": " ran"}])},
                    r"the data mixes formats: row 0 has 'text', row 1 has 'prompt\+completion'"),
    "non_utf8": (lambda a, t: {"data": (t / "d.jsonl", (t / "d.jsonl").write_bytes(
                     b'{"text": "the cat sat"}\n{"text": "caf\xe9 at noon"}\n'))[0]},
                 r"d\.jsonl' is not UTF-8: line 2 \(row 1\)"),
    # item 9: rows whose gradient would silently be zero
    "no_tokenizer": (lambda a, t: {"model": _no_tokenizer(a, t / "m")},
                     r"row 0: a text of \d+ characters became no tokens: the tokenizer is missing"),
    "empty_completion": (lambda a, t: {"data": _jsonl(t / "d.jsonl", [{"prompt": "the cat", "completion": " sat"},
                                                                        {"prompt": "a dog", "completion": ""}])},
                         r"1 row\(s\) have no target token .*rows 1; row 1: an empty completion"),
    "null_text": (lambda a, t: {"data": _jsonl(t / "d.jsonl", [{"text": "the cat sat"}, {"text": None}])},
                  r"row 1: the 'text' field is missing or null"),
    "missing_text": (lambda a, t: {"data": _jsonl(t / "d.jsonl", [{"text": "the cat sat"}, {"id": 3}])},
                     r"row 1: the 'text' field is missing or null"),
    "list_text": (lambda a, t: {"data": _jsonl(t / "d.jsonl", [{"text": "the cat sat"}, {"text": ["a", "b"]}])},
                  r"row 1: the 'text' field is a list, not a string"),
}


def _assert_one_line_error(res, pattern):
    assert res.exit_code == 2, (res.exit_code, res.output, res.exception)
    assert "Traceback" not in res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("Error: ")]
    assert len(errors) == 1, res.output
    assert re.search(pattern, errors[0]), errors[0]


@pytest.mark.parametrize("case", list(BUILD_CASES))
def test_bad_build_input_is_one_line_error(case, gpt2_dir, text_jsonl, tmp_path):
    change, pattern = BUILD_CASES[case]
    got = change(gpt2_dir, tmp_path)
    out = tmp_path / "idx"
    args = ["build", got.get("model", gpt2_dir), got.get("data", text_jsonl), "--out", out, "--quiet",
            "--projection", "4", *got.get("args", [])]
    res = CliRunner().invoke(main, [str(a) for a in args])
    _assert_one_line_error(res, pattern)
    # nothing half-written that a corrected re-run would trip over (refused before the capture pass)
    assert not (out / "store").exists() or not any((out / "store").iterdir())


@pytest.mark.parametrize("shape", ["[]", '{"build": 3}', '{"status": "complete", "build": {"layers": [1]}}'])
@pytest.mark.parametrize("command", ["info", "query", "index"])
def test_manifest_of_the_wrong_shape_is_one_line_error(shape, command, tmp_path):
    d = tmp_path / "idx"
    d.mkdir()
    (d / "manifest.json").write_text(shape)
    args = [command, d] + (["--text", "the cat sat", "--device", "cpu"] if command == "query" else [])
    res = CliRunner().invoke(main, [str(a) for a in args])
    _assert_one_line_error(res, r"manifest\.json' is not a gradindex manifest")
