"""Every documented CLI form runs, with and without ``--json``, on a model with few positions.

Issue 7 items 1 and 2: the default ``--max-length 512`` crashed mid-capture on a model with 128
positions (and left a half-built index whose re-run was refused with "data set differs"), and
``query --prompt P --completion C`` without ``--json`` crashed.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from gradindex.cli import main
from gradindex.spec.manifest import read_manifest, write_manifest

POSITIONS = 16


def run(*args, ok: bool = True):
    res = CliRunner().invoke(main, [str(a) for a in args])
    assert (res.exit_code == 0) == ok, (res.output, res.exception)
    assert "Traceback" not in res.output
    return res


@pytest.fixture(scope="module")
def short_model(tmp_path_factory, tokenizer):
    from fixtures.tiny import save_model_dir, tiny_gpt2

    model = tiny_gpt2(vocab_size=len(tokenizer), n_layer=1, n_embd=16, n_head=2, n_positions=POSITIONS)
    return save_model_dir(model, tokenizer, tmp_path_factory.mktemp("short"))


@pytest.fixture(scope="module")
def built(tmp_path_factory, short_model, text_jsonl):
    out = tmp_path_factory.mktemp("forms") / "index"
    args = ("build", short_model, text_jsonl, "--out", out, "--projection", "4", "--precondition", "ekfac",
            "--transcode", "none", "--storage", "fp32", "--device", "cpu",
            "--quiet")  # the default --max-length 512 > 16 positions
    res = run(*args)
    assert f"note: --max-length 512 is more than the model's {POSITIONS} positions: a longer example would index " \
           f"past its position embeddings; using --max-length {POSITIONS}" in res.stderr
    m = read_manifest(out)
    assert m["status"] == "complete" and m["build"]["max_length"] == POSITIONS and m["counts"]["truncated"] > 0
    again = run(*args)  # the same command again: up to date, not "data set differs"
    assert "0 computed now" in again.stdout and "differs" not in again.output
    return out


def test_the_tokenizers_shorter_model_max_length_caps_the_max_length_and_the_note_says_so(short_model, text_jsonl,
                                                                                           tmp_path):
    """Issue 21, item 15: the tokenizer's model_max_length (10) is below the model's positions (16)."""
    import shutil

    model = tmp_path / "m"
    shutil.copytree(short_model, model)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**cfg, "model_max_length": 10}))
    out = tmp_path / "i"
    res = run("build", model, text_jsonl, "--out", out, "--projection", "4", "--device", "cpu", "--quiet",
              "--no-index", "--precondition", "none", "--storage", "fp32")
    assert (f"note: --max-length 512 is more than the tokenizer's model_max_length 10, fewer than the model's "
            f"{POSITIONS} positions") in res.stderr, res.stderr
    from gradindex.store import Store

    assert read_manifest(out)["build"]["max_length"] == 10
    with Store(out) as s:
        assert int(s.column("num_tokens").max()) <= 10


def test_a_max_length_that_fits_is_kept(built, short_model, text_jsonl, tmp_path):
    res = run("build", short_model, text_jsonl, "--out", tmp_path / "i", "--projection", "4", "--max-length", "8",
              "--device", "cpu", "--quiet", "--no-index", "--precondition", "none", "--storage", "fp32")
    assert "note: --max-length" not in res.stderr and read_manifest(tmp_path / "i")["build"]["max_length"] == 8


def test_a_refused_resume_names_the_max_length_before_the_data(short_model, text_jsonl, tmp_path):
    out = tmp_path / "i"
    run("build", short_model, text_jsonl, "--out", out, "--projection", "4", "--max-length", "8", "--device", "cpu",
        "--quiet", "--no-index", "--precondition", "none", "--storage", "fp32")
    m = read_manifest(out)
    m["status"] = "building"  # as a build killed mid-capture leaves it
    write_manifest(out, m)
    res = run("build", short_model, text_jsonl, "--out", out, "--projection", "4", "--max-length", "12",
              "--device", "cpu", "--quiet", "--no-index", "--precondition", "none", "--storage", "fp32", ok=False)
    err = res.output.split("Error: ")[1]
    assert err.index("max length differs (index: 8, now: 12)") < err.index("data set differs")
    assert "because the max length differs" in err


QUERY_FORMS = {
    "prompt_completion": ["--prompt", "the cat sat on", "--completion", " a mat", "-k", "3", "--method", "ekfac"],
    "prompt_completion_selfnorm": ["--prompt", "the cat sat on", "--completion", " a mat", "--method",
                                   "ekfac-selfnorm", "-k", "5"],
    "texts": ["--text", "the cat sat on a mat", "--text", "red sun over green hills", "-k", "2"],
    "queries_file": ["--queries", "{qfile}", "--method", "cosine"],
    "lowest_and_layers": ["--text", "dog ran far away", "--lowest", "2", "--layers", "*.mlp.*", "--method", "kfac"],
}


@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
@pytest.mark.parametrize("form", list(QUERY_FORMS))
def test_every_query_form(form, as_json, built, tmp_path):
    qfile = tmp_path / "q.jsonl"
    qfile.write_text(json.dumps({"prompt": "the cat", "completion": " sat"}) + "\n"
                     + json.dumps({"prompt": "dog ran", "completion": " far away"}) + "\n")
    args = [a.format(qfile=qfile) for a in QUERY_FORMS[form]] + (["--json"] if as_json else [])
    res = run("query", built, *args, "--device", "cpu")
    n_queries = {"texts": 2, "queries_file": 2}.get(form, 1)
    if as_json:
        lines = res.stdout.strip().splitlines()
        assert len(lines) == n_queries
        for line in lines:
            hits = json.loads(line)
            assert hits and all({"rank", "id", "score", "kind"} <= set(h) for h in hits)
    else:
        assert res.stdout.count("query ") == n_queries and res.stdout.count("most influential") == n_queries
        if form.startswith("prompt"):
            assert "query 1: the cat sat on| a mat" in res.stdout
        if form == "lowest_and_layers":
            assert "most negative" in res.stdout


@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_info(built, as_json):
    res = run("info", built, *(["--json"] if as_json else []))
    if as_json:
        assert json.loads(res.stdout)["max_length"] == POSITIONS
    else:
        assert f"max length {POSITIONS}" in res.stdout and "graddot, cosine, kfac, ekfac" in res.stdout


def test_layers_index_and_precondition_forms(built, short_model, tmp_path):
    import shutil

    assert "* transformer.h.0.mlp.c_fc" in run("layers", short_model).stdout
    d = tmp_path / "copy"
    shutil.copytree(built, d)
    assert "indices built" in run("index", d, "--index-type", "HNSW8", "--whiten", "ekfac", "--force",
                                  "--quiet").stdout
    assert "methods now: graddot, cosine, kfac" in run("precondition", d, "--method", "kfac", "--quiet").stdout
    run("index", d, "--index-type", "IVF1024,PQ64x4fs", ok=False)  # docs/query.md's form on 40 rows: refused


def test_version_and_help():
    assert run("--version").stdout.startswith("gradindex, version ")
    for cmd in ([], ["build"], ["query"], ["index"], ["info"], ["layers"], ["precondition"]):
        assert "Usage: " in run(*cmd, "--help").stdout


def test_query_token_ids_outside_the_vocabulary_are_a_one_line_error(built, tmp_path):
    q = tmp_path / "ids.jsonl"
    q.write_text(json.dumps({"input_ids": [1, 2, 99999]}) + "\n")
    res = CliRunner().invoke(main, ["query", str(built), "--queries", str(q), "--device", "cpu"])
    assert res.exit_code == 2 and "Traceback" not in res.output, (res.output, res.exception)
    assert "Error: row 0: token id 99999 is outside the model's vocabulary" in res.output


def test_data_that_fits_keeps_max_length_and_long_queries_are_cut_at_the_positions(short_model, tmp_path):
    from conftest import make_texts

    data = tmp_path / "short.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in make_texts(12, seed=3, max_words=4)))
    out = tmp_path / "i"
    res = run("build", short_model, data, "--out", out, "--projection", "4", "--device", "cpu", "--quiet",
              "--precondition", "none", "--storage", "fp32")
    assert "note: --max-length" not in res.stderr and read_manifest(out)["build"]["max_length"] == 512
    long_query = " ".join(["the cat sat on a mat"] * 10)  # far more than 16 tokens
    res = run("query", out, "--text", long_query, "-k", "2", "--device", "cpu")
    assert "most influential" in res.stdout
    assert f"was longer than the index's max length ({POSITIONS} tokens)" in res.output, res.output  # (said 512)
