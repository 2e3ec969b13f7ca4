"""Issue 21 (hardening), items without a better home: what a new user hits on the default index."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from gradindex.cli import main
from gradindex.methods import methods_of
from gradindex.query import QueryEngine


def test_graddot_refusal_on_the_default_index_lists_every_method_it_answers(default_index):
    """Item 15: the refusal said ``['ekfac']``; the index also answers ``ekfac-selfnorm``."""
    with QueryEngine(default_index, device="cpu") as e:
        answers = methods_of(e.manifest, default_index, selfnorm=True)
        assert answers == ["ekfac", "ekfac-selfnorm"]
        with pytest.raises(ValueError, match="use one of ekfac, ekfac-selfnorm ") as err:
            e.query("the cat sat on a mat", method="graddot")
    assert "does not apply to this index" in str(err.value)
    res = CliRunner().invoke(main, ["query", str(default_index), "--text", "the cat sat", "--method", "graddot",
                                    "--device", "cpu"])
    assert res.exit_code == 2 and "use one of ekfac, ekfac-selfnorm" in res.output, res.output


def test_explain_prints_the_residual_between_the_score_and_its_token_terms_and_its_cause(default_index):
    """Item 5: on an int4 index the training tokens' terms do not sum to the score; say by how much and why."""
    import json

    from gradindex.apps.explain import Explainer

    with QueryEngine(default_index, device="cpu") as e:
        ids = [h.id for h in e.query("the cat sat on a mat", k=2).hits]
        exps = Explainer(e).explain("the cat sat on a mat", ids)
    args = ["explain", str(default_index), "--query", "the cat sat on a mat", "--device", "cpu"]
    for i in ids:
        args += ["--id", str(i)]
    text = CliRunner().invoke(main, args)
    js = CliRunner().invoke(main, args + ["--json"])
    assert text.exit_code == 0 and js.exit_code == 0, text.output + js.output
    for x, line in zip(exps, js.stdout.splitlines(), strict=True):
        d = json.loads(line)
        assert d["residual"] == pytest.approx(d["score"] - sum(d["train"]["scores"]), rel=1e-9, abs=1e-12)
        assert d["residual"] != 0 and "int4-coded" in d["residual_cause"]  # the rows are int4 codes
        assert sum(d["query"]["scores"]) == pytest.approx(d["score"], rel=1e-5)  # against the coded row
        assert f"residual {x.residual:+.6g}" in text.stdout
    assert text.stdout.count("the score minus the training tokens' sum; the stored row is int4-coded") == len(ids)


def _without_faiss(*args: str) -> subprocess.CompletedProcess:
    code = "import sys; sys.modules['faiss'] = None\nfrom gradindex.cli import main\nmain(sys.argv[1:])"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})


def test_without_faiss_a_build_is_refused_before_any_work_in_one_line(gpt2_dir, text_jsonl, default_index,
                                                                       tmp_path):
    """Item 12: it died after the capture with a 31-line ModuleNotFoundError traceback."""
    out = tmp_path / "index"
    r = _without_faiss("build", str(gpt2_dir), str(text_jsonl), "--out", str(out), "--device", "cpu")
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "gradindex[cpu]" in lines[0] and "gradindex[gpu]" in lines[0] and "`gradindex build` needs FAISS" in lines[0]
    assert not out.exists()  # nothing captured, nothing written
    for cmd in (["query", str(default_index), "--text", "the cat sat"], ["serve", str(default_index)]):
        r = _without_faiss(*cmd)
        assert r.returncode == 2 and "gradindex[cpu]" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert _without_faiss("build", "--help").returncode == 0
    info = _without_faiss("info", str(default_index))
    assert info.returncode == 0 and "ekfac" in info.stdout, info.stderr
    lib = subprocess.run([sys.executable, "-c", "import sys; sys.modules['faiss'] = None\nimport gradindex.index"],
                         capture_output=True, text=True, timeout=300)
    assert "ModuleNotFoundError: FAISS is not installed" in lib.stderr and "gradindex[cpu]" in lib.stderr


class _Spy:
    """A tokenizer that records the length of every text it is given."""

    def __init__(self, tok):
        self.tok, self.seen = tok, []
        self.eos_token_id = tok.eos_token_id

    def __call__(self, text, **kw):
        self.seen.append(len(text))
        return self.tok(text, **kw)


def test_a_long_text_is_cut_by_characters_before_it_is_tokenized(tokenizer):
    """Item 17: a 10 MB single-line record was tokenized whole (144 s, 2.47 GB) before the cut to max length."""
    from conftest import make_texts

    from gradindex.data import records_from_texts, tokenize_records

    long = " ".join(make_texts(3000, seed=5))  # ~250 KB, one line
    huge = long * 40  # ~10 MB
    spy = _Spy(tokenizer)
    got = tokenize_records(records_from_texts([long, "the cat sat", huge]), spy, 64)
    whole = tokenizer(long, add_special_tokens=False)["input_ids"]
    assert got.input_ids[0] == whole[:64] and got.truncated == (True, False, True)
    assert got.input_ids[2] == tokenizer(huge[:100_000], add_special_tokens=False)["input_ids"][:64]
    assert max(spy.seen) <= 64 * 16, spy.seen  # only a prefix of each long text reached the tokenizer
    words = "x" * 5000  # one long word: few tokens per character, the prefix grows until it has enough
    got = tokenize_records(records_from_texts([words]), _Spy(tokenizer), 64)
    assert got.input_ids[0] == tokenizer(words, add_special_tokens=False)["input_ids"][:64]
    pc = tokenize_records(__import__("datasets").Dataset.from_list([{"prompt": "dog ran", "completion": long}]),
                          spy, 64)
    full = tokenizer("dog ran", add_special_tokens=False)["input_ids"] + whole
    assert pc.input_ids[0] == full[:64]


def test_an_open_engine_and_server_refuse_an_index_that_build_overwrite_replaced(gpt2_dir, text_jsonl, tmp_path):
    """Item 4: 150 of 150 queries answered from the deleted index after `build --overwrite`."""
    from fastapi.testclient import TestClient

    from gradindex.apps.serve import create_app
    from gradindex.index import IndexReplacedError
    from gradindex.spec.manifest import read_manifest

    out = tmp_path / "idx"
    build = ["build", str(gpt2_dir), str(text_jsonl), "--out", str(out), "--projection", "4", "--device", "cpu",
             "--quiet", "--precondition", "ekfac", "--transcode", "none", "--storage", "fp32", "--max-length", "32"]
    r = CliRunner()
    assert r.invoke(main, build).exit_code == 0
    first = read_manifest(out)["generation"]
    with QueryEngine(out, device="cpu") as e:
        client = TestClient(create_app(e))
        before = e.query("the cat sat on a mat", k=3)
        assert client.post("/query", json={"text": "the cat sat", "k": 2}).status_code == 200
        # an update of the same build (the index stage again) is not a replacement
        assert r.invoke(main, ["index", str(out), "--force", "--quiet"]).exit_code == 0
        again = e.query("the cat sat on a mat", k=3)
        assert [h.id for h in again.hits] == [h.id for h in before.hits]
        # the same command with another max length and --overwrite: another index in the same place
        res = r.invoke(main, [*build[:-1], "24", "--overwrite"])
        assert res.exit_code == 0, res.output
        assert read_manifest(out)["generation"] != first
        with pytest.raises(IndexReplacedError, match="replaced by a new build since it was opened"):
            e.query("the cat sat on a mat", k=3)
        with pytest.raises(IndexReplacedError):
            e.scores(["the cat sat on a mat"])
        got = client.post("/query", json={"text": "the cat sat", "k": 2})
        assert got.status_code == 503 and "restart the server" in got.json()["detail"], got.text
        assert client.get("/health").json()["status"].startswith("stale: ")
    with QueryEngine(out, device="cpu") as e:  # reopened: the new index answers
        assert len(e.query("the cat sat on a mat", k=3).hits) == 3


def test_cli_query_says_loading_and_searching_on_a_terminal_only(default_index):
    """Item 16: a CLI query was silent for 6-20 s (imports and model load)."""
    import pty

    master, slave = pty.openpty()
    args = [sys.executable, "-m", "gradindex.cli", "query", str(default_index), "--text", "the cat sat", "-k", "2",
            "--device", "cpu"]
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=slave, text=True,
                         env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    os.close(slave)
    err = b""
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        err += chunk
    out = p.communicate(timeout=300)[0]
    os.close(master)
    text = err.decode()
    assert p.returncode == 0, text + out
    assert text.index(f"loading model and index {default_index} ...") < text.index("searching 40 examples for 1 query")
    assert "query 1: the cat sat" in out and "loading" not in out  # the results on stdout, progress on stderr
    piped = CliRunner().invoke(main, args[3:])
    assert piped.exit_code == 0 and "loading model" not in piped.output
