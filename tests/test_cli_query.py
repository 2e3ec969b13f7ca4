"""`gradindex build` with its index stage, `index`, `query` and `info`, end to end on a tiny model."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from gradindex.cli import main
from gradindex.query import QueryEngine


def run(*args, ok: bool = True):
    res = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    assert (res.exit_code == 0) == ok, res.output
    return res


@pytest.fixture(scope="module")
def built(tmp_path_factory, gpt2_dir, text_jsonl):
    out = tmp_path_factory.mktemp("cli") / "index"
    res = run("build", gpt2_dir, text_jsonl, "--out", out, "--projection", "4", "--shard-size", "16",
              "--precondition", "ekfac", "--transcode", "none", "--storage", "fp32", "--device", "cpu", "--quiet")
    assert "indices built" in res.output and "store (exhaustive scan of the store's codes)" in res.output
    return out


def test_query_json_lists_ids_scores_and_texts_as_the_engine_does(built, text_jsonl):
    texts = [json.loads(line)["text"] for line in open(text_jsonl)]
    res = run("query", built, "--text", "the cat sat on a mat", "--text", "red sun over green hills",
              "-k", "5", "--method", "ekfac", "--lowest", "2", "--json")
    lines = res.stdout.strip().splitlines()
    assert len(lines) == 2
    with QueryEngine(built, device="cpu") as e:
        queries = ["the cat sat on a mat", "red sun over green hills"]
        ref = e.query_batch(queries, k=5, method="ekfac", lowest=2)
    for line, r in zip(lines, ref, strict=True):
        got = json.loads(line)
        top = [g for g in got if g["kind"] == "top"]
        assert [g["id"] for g in top] == [h.id for h in r.hits]
        np.testing.assert_allclose([g["score"] for g in top], [h.score for h in r.hits], rtol=1e-6)
        assert all(g["text"] == texts[g["id"]] for g in got)
        assert [g["id"] for g in got if g["kind"] == "lowest"] == [h.id for h in r.lowest]


def test_query_json_says_what_produced_each_result(built):
    """Each result row names its method and damping and carries the query's seconds per stage."""
    res = run("query", built, "--text", "the cat sat on a mat", "-k", "3", "--method", "kfac", "--damping", "0.01",
              "--lowest", "1", "--json")
    got = json.loads(res.stdout)
    with QueryEngine(built, device="cpu") as e:
        ref = e.query("the cat sat on a mat", k=3, method="kfac", damping=0.01, lowest=1)
    assert len(got) == 4 and {g["method"] for g in got} == {ref.method} and {g["damping"] for g in got} == {0.01}
    for g in got:
        assert set(g["seconds"]) == set(ref.seconds) and all(v >= 0 for v in g["seconds"].values())
        assert g["seconds"]["gradient"] > 0


def test_prompt_completion_and_query_files_in_any_build_format(built, tmp_path):
    pair = run("query", built, "--prompt", "some bread at noon", "--completion", " under blue sky", "-k", "3",
               "--json")
    qfile = tmp_path / "q.jsonl"
    qfile.write_text(json.dumps({"prompt": "some bread at noon", "completion": " under blue sky"}) + "\n")
    from_file = run("query", built, "--queries", qfile, "-k", "3", "--json")
    def results(out: str) -> list[dict]:
        return [{k: v for k, v in g.items() if k != "seconds"} for g in json.loads(out)]

    assert results(pair.stdout) == results(from_file.stdout)
    csv = tmp_path / "q.csv"
    csv.write_text("body\nthe cat sat on a mat\ndog ran far away\n")
    res = run("query", built, "--queries", csv, "--text-field", "body", "-k", "2", "--layers", "*.mlp.*")
    assert res.stdout.count("query ") == 2 and "4 layers" in res.stdout and "most influential" in res.stdout


def test_human_output_and_notes(built):
    res = run("query", built, "--text", "the cat sat on a mat", "-k", "50", "--method", "cosine")
    assert "note: k=50 is larger than the index (40 examples)" in res.stderr
    assert res.stdout.count("\n") >= 40 and "method cosine" in res.stdout
    res = run("query", built, "--text", "the cat sat on a mat", "-k", "3", "--lowest", "100", "--method", "cosine")
    assert "note: lowest=100 is larger than the index (40 examples)" in res.stderr, res.stderr  # (said k=100)


def test_info_summarizes_the_index(built):
    out = run("info", built).stdout
    for word in ("model", "40 examples", "8, 128 numbers per example", "graddot, cosine, kfac, ekfac", "store",
                 "store", "faiss", "[4x4]"):
        assert word in out, word
    s = json.loads(run("info", built, "--json").stdout)
    assert s["index"]["types"] == ["store"] and s["data"]["examples"] == 40 and s["bytes"]["faiss"] > 0  # norms
    assert s["methods"] == ["graddot", "cosine", "kfac", "ekfac", "graddot-selfnorm", "kfac-selfnorm",
                            "ekfac-selfnorm"]
    assert "ekfac-selfnorm" in out
    res = run("query", built, "--text", "the cat sat on a mat", "--method", "ekfac-selfnorm", "-k", "2", "--json")
    assert len(json.loads(res.stdout)) == 2  # every method info lists, query accepts


def test_info_names_whitened_rows_and_the_basis_file(default_index):
    """Issue 33 item 14: on the default index (rows in the EK-FAC eigenbasis, indices built without
    whitening) ``info`` said the index space was "raw", and its "on disk" line left out ``basis.h5``."""
    out = run("info", str(default_index)).stdout
    line = next(x for x in out.splitlines() if x.startswith("indices "))
    assert "the rows as stored (ekfac-whitened)" in line and "raw" not in line, line
    s = json.loads(run("info", str(default_index), "--json").stdout)
    assert s["bytes"]["basis"] == (default_index / "basis.h5").stat().st_size > 0
    disk = next(x for x in out.splitlines() if x.startswith("on disk "))
    assert ", basis " in disk, disk


def test_index_command_rebuilds_and_queries_still_agree(built, tmp_path):
    import shutil

    d = tmp_path / "copy"
    shutil.copytree(built, d)
    out = run("index", d, "--index-type", "IVF4,Flat", "--whiten", "ekfac", "--quiet").stdout
    assert "IVF4,Flat" in out and "whitened ekfac" in out
    assert "up to date" in run("index", d, "--index-type", "IVF4,Flat", "--whiten", "ekfac", "--quiet").stdout
    a = json.loads(run("query", built, "--text", "the cat sat on a mat", "--method", "ekfac", "-k", "5",
                       "--json").stdout)
    b = json.loads(run("query", d, "--text", "the cat sat on a mat", "--method", "ekfac", "-k", "5",
                       "--candidates", "40", "--nprobe", "4", "--json").stdout)
    assert [x["id"] for x in a] == [x["id"] for x in b]


def test_errors_name_the_problem_and_the_fix(built, tmp_path, gpt2_dir, text_jsonl):
    import shutil

    assert "nothing to query" in run("query", built, ok=False).output
    assert "--prompt and --completion go together" in run("query", built, "--prompt", "x", ok=False).output
    d = tmp_path / "copy"
    shutil.copytree(built, d)
    victim = d / "faiss" / "norms.npy"  # the store kind's only file
    victim.write_bytes(b"junk")
    err = run("query", d, "--text", "the cat sat", ok=False).output
    assert victim.name in err and f"gradindex index {d}" in err
    err = run("build", gpt2_dir, text_jsonl, "--out", tmp_path / "w", "--whiten", "kfac", "--precondition", "none",
              ok=False).output
    assert "--whiten kfac needs that preconditioner" in err
    err = run("build", gpt2_dir, text_jsonl, "--out", tmp_path / "w", "--whiten", "kfac", ok=False).output
    assert "already whitened" in err and "--transcode none" in err
    nix = run("build", gpt2_dir, text_jsonl, "--out", tmp_path / "n", "--projection", "4", "--no-index",
              "--precondition", "none", "--device", "cpu", "--quiet").output
    assert "indices" not in nix
    assert "no FAISS indices" in run("query", tmp_path / "n", "--text", "the cat sat", ok=False).output


def test_table_numbers_have_no_exponent_in_the_usual_range():
    from gradindex.cli.common import number

    assert [number(x) for x in (10000.118, 6937.18, 426.74, 2.0461, -293.71, 0.63271)] == \
        ["10000", "6937", "426.7", "2.046", "-293.7", "0.6327"]
    assert [number(x) for x in (1e-5, 3e9, 0.0)] == ["1.000e-05", "3.000e+09", "0"]


def test_a_query_file_mixing_forms_is_answered_record_by_record(built, tmp_path):
    """Issue 21, item 13: text, prompt + completion and token-id records in one query file."""
    recs = [{"text": "the cat sat on a mat"}, {"prompt": "some bread at noon", "completion": " under blue sky"},
            {"input_ids": [5, 9, 12, 40, 7]}, {"text": "dog ran far away from home"}]
    qfile = tmp_path / "mixed.jsonl"
    qfile.write_text("".join(json.dumps(r) + "\n" for r in recs))
    out = run("query", built, "--queries", qfile, "-k", "3", "--json").stdout
    got = [json.loads(line) for line in out.splitlines()]
    with QueryEngine(built, device="cpu") as e:
        ref = [e.query(r, k=3) for r in recs]  # each record alone
    assert len(got) == len(recs)
    for g, r in zip(got, ref, strict=True):
        assert [x["id"] for x in g] == [h.id for h in r.hits]
        np.testing.assert_allclose([x["score"] for x in g], [h.score for h in r.hits], rtol=1e-6)


@pytest.mark.parametrize("damping", ["inf", "nan", "0", "-0.5"])
def test_non_finite_or_non_positive_damping_is_refused(built, damping):
    """Issue 21, item 5: `--damping inf` on a raw index answered all-zero scores."""
    res = run("query", built, "--text", "the cat sat on a mat", "--method", "ekfac", "--damping", damping, ok=False)
    assert res.exit_code == 2 and "outside the valid range" in res.output, res.output
    with QueryEngine(built, device="cpu") as e, pytest.raises(ValueError, match="damping must be a finite number > 0"):
        e.query("the cat sat on a mat", method="ekfac", damping=float(damping))


def test_float_token_ids_in_a_query_file_are_refused(built, tmp_path):
    """Issue 21, item 5: [1.5, 2.7, 3] was truncated to [1, 2, 3] and answered."""
    qfile = tmp_path / "ids.jsonl"
    qfile.write_text(json.dumps({"input_ids": [1.5, 2.7, 3]}) + "\n")
    res = run("query", built, "--queries", qfile, ok=False)
    assert res.exit_code == 2 and "'input_ids' holds 1.5, not an integer token id" in res.output, res.output
    qfile.write_text(json.dumps({"input_ids": [1, 2.0, 3]}) + "\n")  # a whole float is its integer
    assert run("query", built, "--queries", qfile, "--json").stdout
