"""Bad input through the CLI: one line ``Error: ...``, exit code 2, no traceback, nothing silently wrong.

Covers issue 7 item 15 (tracebacks) and item 9 (zero-gradient rows written with exit 0): each case
failed before (a traceback, or exit 0 with a store of zero rows).
"""

from __future__ import annotations

import re
import shutil

import pytest
from click.testing import CliRunner

from gradindex.cli import main
from tests.conftest import write_jsonl as _jsonl


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
    "ids_float": (lambda a, t: {"data": _jsonl(t / "d.jsonl", [{"input_ids": [1.5, 2.7, 3]}])},
                  r"row 0: 'input_ids' holds 1\.5, not an integer token id"),
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
    # malformed or empty data files: the line, or "no rows", not a datasets traceback summary
    "jsonl_torn_line": (lambda a, t: {"data": (t / "d.jsonl", (t / "d.jsonl").write_text(
                            '{"text": "the cat sat"}\n{"text": "a dog\n'))[0]},
                        r"d\.jsonl' line 2, column \d+ is not valid JSON"),
    "jsonl_not_an_object": (lambda a, t: {"data": (t / "d.jsonl", (t / "d.jsonl").write_text(
                                '{"text": "the cat sat"}\n["a", "b"]\n'))[0]},
                            r"d\.jsonl' line 2 is a JSON list, not an object"),
    "jsonl_blank_lines_only": (lambda a, t: {"data": (t / "d.jsonl", (t / "d.jsonl").write_text("\n\n"))[0]},
                               r"d\.jsonl' has no rows; nothing to index"),
    "csv_header_only": (lambda a, t: {"data": (t / "d.csv", (t / "d.csv").write_text("text\n"))[0]},
                        r"d\.csv' has no rows; nothing to index"),
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


def test_datasets_logs_nothing_of_its_own_for_a_torn_file(tmp_path, capfd):
    from gradindex.data import load_records

    p = tmp_path / "d.jsonl"
    p.write_text('{"text": "a"}\n{"text": "b')
    with pytest.raises(ValueError, match="line 2"):
        load_records(p)
    assert "Failed to load JSON" not in capfd.readouterr().err


@pytest.mark.parametrize("args, option", [(["-k", "-3"], "-k"), (["-k", "0"], "-k"), (["--lowest", "-1"], "--lowest"),
                                          (["--candidates", "0"], "--candidates")])
def test_query_counts_out_of_range_name_the_option(args, option, tmp_path):
    res = CliRunner().invoke(main, ["query", str(tmp_path), "--text", "the cat sat", *args])
    assert res.exit_code == 2 and f"Invalid value for '{option}'" in res.output and "not in the range" in res.output


@pytest.fixture(scope="module")
def eigen_index(gpt2_dir, text_jsonl, tmp_path_factory):
    """The CLI's default index (EK-FAC eigenbasis, int4) of the tiny GPT-2."""
    out = tmp_path_factory.mktemp("eigen") / "idx"
    res = CliRunner().invoke(main, ["build", str(gpt2_dir), str(text_jsonl), "--out", str(out), "--quiet",
                                    "--max-length", "64", "--shard-size", "16"])
    assert res.exit_code == 0, res.output
    return out


def test_precondition_refuses_an_index_already_in_the_eigenbasis(eigen_index):
    before = (eigen_index / "manifest.json").read_text()
    res = CliRunner().invoke(main, ["precondition", str(eigen_index), "--method", "ekfac", "--quiet"])
    _assert_one_line_error(res, r"already in the EK-FAC whitened eigenbasis .* build the index with --transcode none")
    assert (eigen_index / "manifest.json").read_text() == before  # the fit the rows came from is untouched


def test_raw_method_on_the_eigenbasis_names_the_build_option(eigen_index):
    res = CliRunner().invoke(main, ["query", str(eigen_index), "--text", "the cat sat", "--method", "graddot",
                                    "--device", "cpu"])
    _assert_one_line_error(res, r"method 'graddot' does not apply .* rebuild with --transcode none")


def test_a_model_of_another_architecture_does_not_fit_the_index(eigen_index, llama_dir):
    res = CliRunner().invoke(main, ["query", str(eigen_index), "--text", "the cat sat", "--model", str(llama_dir),
                                    "--device", "cpu"])
    _assert_one_line_error(res, r"this model does not fit the index .* query with the model the index was built")


def test_dedup_makes_the_folder_of_out_before_searching(eigen_index, tmp_path):
    out = tmp_path / "new" / "dups.jsonl"
    res = CliRunner().invoke(main, ["dedup", str(eigen_index), "--out", str(out), "--quiet", "--no-text"])
    assert res.exit_code == 0, res.output
    assert out.is_file() and not out.with_name("dups.jsonl.tmp").exists()
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    res = CliRunner().invoke(main, ["dedup", str(eigen_index), "--out", str(blocked / "dups.jsonl"), "--quiet"])
    _assert_one_line_error(res, r"--out .*a-file/dups\.jsonl cannot be written .* \(nothing was searched\)")


def test_ctrl_c_during_a_build_says_how_to_resume(gpt2_dir, text_jsonl, tmp_path, monkeypatch):
    import gradindex.pipeline

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(gradindex.pipeline, "build_index", interrupted)
    res = CliRunner().invoke(main, ["build", str(gpt2_dir), str(text_jsonl), "--out", str(tmp_path / "i"), "--quiet"])
    assert res.exit_code == 130, (res.exit_code, res.output)
    assert "interrupted" in res.output and "re-run the same command" in res.output


@pytest.mark.parametrize("damage", ["flipped byte", "deleted"])
def test_a_damaged_shard_of_an_eigenbasis_index_is_recomputed(damage, eigen_index, gpt2_dir, text_jsonl, tmp_path):
    """Before: `build ... --repair` (what `verify` names) printed "0 computed now" and left the shard damaged."""
    import numpy as np

    from gradindex.store import Store

    idx = tmp_path / "idx"
    shutil.copytree(eigen_index, idx)
    shard = idx / "store" / "shard-00001.h5"
    with Store(idx) as st:
        ids = np.arange(st.first_ids[1], st.first_ids[1] + st.sizes[1])
        want = st.read_rows(ids)
    if damage == "deleted":
        shard.unlink()
    else:
        b = bytearray(shard.read_bytes())
        b[len(b) // 2] ^= 0xFF
        shard.write_bytes(b)
    verify = CliRunner().invoke(main, ["verify", str(idx)])
    assert verify.exit_code == 1 and "--repair" in verify.output
    repair = verify.output.split("repair: ", 1)[1].splitlines()[0].split()[1:]  # the command verify names
    res = CliRunner().invoke(main, [*repair, "--quiet"])
    assert res.exit_code == 0 and "(16 computed now)" in res.output, res.output
    assert CliRunner().invoke(main, ["verify", str(idx)]).exit_code == 0
    # the codes the transcode wrote, recomputed from the captured rows (rounded as it read them); the build coded
    # its float16 copy of the rotated rows (precondition/rotated.py), so a number on a rounding boundary of its
    # int4 code may land one step off
    with Store(idx) as st:
        got = st.read_rows(ids)
    for n, w in want.items():
        step = np.abs(w).max(1, keepdims=True) / 7
        assert (np.abs(got[n] - w) <= 1.01 * step + 1e-7).all(), n
        assert np.isclose(got[n], w, rtol=1e-3, atol=1e-7).mean() > 0.99, n


def test_an_index_given_as_the_model_names_the_model_it_was_built_from(eigen_index, gpt2_dir):
    res = CliRunner().invoke(main, ["layers", str(eigen_index)])
    _assert_one_line_error(res, rf"is a gradindex index, built from the model in '{re.escape(str(gpt2_dir))}'")
