"""The library's ``method=None`` is the index's default method, as on the command line.

On an index built with the defaults (rows stored in the EK-FAC eigenbasis) a ``graddot`` default
used to make ``QueryEngine.query_batch``, ``search``, ``scores``, ``explain``, ``score_matrix``,
``find_duplicates`` and ``build_report`` refuse their own defaults.
"""

from __future__ import annotations

import numpy as np

from gradindex.apps.dedup import DedupConfig, find_duplicates
from gradindex.apps.explain import Explainer
from gradindex.manifest import read_manifest, row_basis
from gradindex.query import QueryEngine
from gradindex.query.scores import score_matrix

Q = ("the quick brown", " fox jumps")


def test_method_none_is_the_index_default(default_index):
    assert row_basis(read_manifest(default_index)) == "ekfac"
    with QueryEngine(default_index, device="cpu") as e:
        assert e.resolve_method() == "ekfac" and e.resolve_method("graddot") == "graddot"
        got = e.query(Q, k=3)
        want = e.query(Q, k=3, method="ekfac")
        assert got.method == "ekfac" and [h.id for h in got.hits] == [h.id for h in want.hits]
        grads = e.gradients(e.tokenize([Q]))[0]
        np.testing.assert_allclose(e.scores([Q]), e.scores([Q], method="ekfac"))
        np.testing.assert_allclose(score_matrix(default_index, grads, device="cpu"),
                                   score_matrix(default_index, grads, "ekfac", device="cpu"))
        assert [h.id for h in e.search(grads, k=3)[0].hits] == [h.id for h in want.hits]
        ex = Explainer(e).explain(Q, got.hits[0].id)[0]
        assert ex.method == "ekfac" and np.isclose(ex.score, got.hits[0].score, rtol=1e-4)
    res = find_duplicates(default_index, DedupConfig())
    ref = find_duplicates(default_index, DedupConfig(method="ekfac"))
    assert [g.ids for g in res.groups] == [g.ids for g in ref.groups]


def test_build_config_defaults_build_what_gradindex_build_does(tmp_path, gpt2_dir, text_jsonl):
    """``gradindex build MODEL DATA --out A`` (no options) and ``build_index(..., BuildConfig.defaults(),
    IndexConfig())`` write the same bytes: every data file's content hash (checksums.json) and the
    manifest's build identity and config are equal; only timings, dates and paths may differ."""
    import json

    from click.testing import CliRunner

    from gradindex.cli import main
    from gradindex.data import load_records, tokenize_records
    from gradindex.index import IndexConfig
    from gradindex.model import load_causal_lm
    from gradindex.pipeline import BuildConfig, build_index

    cli, lib = tmp_path / "cli", tmp_path / "lib"
    res = CliRunner().invoke(main, ["build", str(gpt2_dir), str(text_jsonl), "--out", str(cli), "--quiet",
                                    "--device", "cpu"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    model, tok = load_causal_lm(gpt2_dir, device="cpu")
    data = tokenize_records(load_records(text_jsonl), tok, BuildConfig.defaults().max_length)
    build_index(model, tok, data, lib, BuildConfig.defaults(), IndexConfig(),
                model_id=str(gpt2_dir.resolve()), data_id=str(text_jsonl.resolve()), progress=False)

    def files(d):
        recs = json.loads((d / "checksums.json").read_text())["files"]
        return {n: (e["bytes"], e["blake2b"]) for n, e in recs.items()}

    assert files(cli) == files(lib) and any(n.startswith("store/") for n in files(cli))
    a, b = read_manifest(cli), read_manifest(lib)
    assert a["build"] == b["build"] and a["config"] == b["config"] and a["counts"] == b["counts"]
    assert a["build"]["basis"]["kind"] == "ekfac" and a["build"]["storage"] == "int4"  # what the defaults are
    assert BuildConfig.defaults().precondition == "ekfac" and BuildConfig.defaults().transcode == "ekfac"
    assert BuildConfig.defaults(optimizer_state="s.safetensors").precondition == "none"
