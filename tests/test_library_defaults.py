"""The library's ``method=None`` is the index's default method, as on the command line.

On an index built with the defaults (rows stored in the EK-FAC eigenbasis) a ``graddot`` default
used to make ``QueryEngine.query_batch``, ``search``, ``scores``, ``explain``, ``score_matrix``,
``find_duplicates`` and ``build_report`` refuse their own defaults.
"""

from __future__ import annotations

import numpy as np

from gradindex.apps.dedup import DedupConfig, find_duplicates
from gradindex.apps.explain import Explainer
from gradindex.query import QueryEngine
from gradindex.query.scores import score_matrix
from gradindex.spec.manifest import read_manifest, row_basis

Q = ("the quick brown", " fox jumps")


def test_method_none_is_the_index_default(default_index):
    """A query's default is ``ekfac-selfnorm`` (issue 31; tests/test_default_selfnorm.py checks its scores); explain
    and dedup keep their own (``ekfac``, ``graddot`` first)."""
    assert row_basis(read_manifest(default_index)) == "ekfac"
    with QueryEngine(default_index, device="cpu") as e:
        assert e.resolve_method() == "ekfac-selfnorm" and e.resolve_method("graddot") == "graddot"
        got = e.query(Q, k=3)
        want = e.query(Q, k=3, method="ekfac-selfnorm")
        assert got.method == "ekfac-selfnorm" and [h.id for h in got.hits] == [h.id for h in want.hits]
        grads = e.gradients(e.tokenize([Q]))[0]
        np.testing.assert_allclose(e.scores([Q]), e.scores([Q], method="ekfac-selfnorm"))
        np.testing.assert_allclose(score_matrix(default_index, grads, device="cpu"),
                                   score_matrix(default_index, grads, "ekfac-selfnorm", device="cpu"))
        assert [h.id for h in e.search(grads, k=3)[0].hits] == [h.id for h in want.hits]
        plain = e.scores([Q], method="ekfac")[0]
        ex = Explainer(e).explain(Q, got.hits[0].id)[0]
        assert ex.method == "ekfac" and np.isclose(ex.score, plain[got.hits[0].id], rtol=1e-4)
    res = find_duplicates(default_index, DedupConfig())
    ref = find_duplicates(default_index, DedupConfig(method="ekfac"))
    assert [g.ids for g in res.groups] == [g.ids for g in ref.groups]


def _tree(d) -> dict[str, bytes]:
    """Every file under an index directory, by relative path (the lock files aside)."""
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*"))
            if p.is_file() and not p.name.endswith(".lock")}


def _without_moments(d: dict) -> dict:
    """A manifest or stage record with its timings, dates, generation id and paths left out."""
    drop = ("generation", "seconds", "created", "created_at", "timings", "model_id", "data_id", "date", "time")
    return {k: _without_moments(v) if isinstance(v, dict) else v for k, v in d.items()
            if k not in drop and not k.endswith("_seconds") and not k.endswith("_at")}


def test_plain_build_config_builds_what_gradindex_build_does(tmp_path, gpt2_dir, text_jsonl):
    """``gradindex build MODEL DATA --out A`` (no options) and ``build_index(..., BuildConfig(), IndexConfig())``
    write the same files: every file but the manifests and stage records byte for byte, those equal once
    timings, dates, generation ids and paths are left out."""
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
    data = tokenize_records(load_records(text_jsonl), tok, BuildConfig().max_length)
    build_index(model, tok, data, lib, BuildConfig(), IndexConfig(),
                model_id=str(gpt2_dir.resolve()), data_id=str(text_jsonl.resolve()), progress=False)

    a, b = _tree(cli), _tree(lib)
    assert sorted(a) == sorted(b) and any(n.startswith("store/") for n in a) and "faiss/index.json" in a
    for name in sorted(a, key=lambda n: n.endswith(".json")):  # (checksums.json last: a data file is named first)
        if name.endswith(".json"):
            assert _without_moments(json.loads(a[name])) == _without_moments(json.loads(b[name])), name
        else:
            assert a[name] == b[name], name
    m = read_manifest(cli)
    assert m["build"]["basis"]["kind"] == "ekfac" and m["build"]["storage"] == "int4"  # what the defaults are
    assert BuildConfig().precondition == "ekfac" and BuildConfig().rows.transcode
    assert BuildConfig(optimizer_state="s.safetensors").precondition == "none"
    assert BuildConfig(projection=BuildConfig().projection.__class__(k_a=8, k_g=8)).rows.projection == "fixed"


def test_every_build_option_is_one_config_field_with_the_library_default():
    """``gradindex build``'s options map one to one onto BuildConfig: each field is one option of that name
    (the projection: --projection, --projection-kind, --seed), and each option's default is the field's."""
    from dataclasses import fields

    from gradindex.cli.build import OPTION_FIELDS, build, settings
    from gradindex.spec.build import BuildOptions
    from gradindex.store.builder import BuildConfig

    names = {f.name for f in fields(BuildOptions)}
    assert set(OPTION_FIELDS) == names
    assert {f.name for f in fields(BuildConfig)} == names | {"rows", "projection_kind", "seed"}
    params = {p.name: p for p in build.params}
    for f in fields(BuildOptions):
        if f.name not in ("layers", "optimizer_state"):  # (a repeatable option and a path: empty, checked below)
            assert params[f.name].default == f.default, f.name
    spec = BuildConfig().projection
    assert (params["projection_kind"].default, params["seed"].default) == (spec.kind, spec.seed)
    ctx = build.make_context("build", ["MODEL", "DATA", "--out", "OUT"])
    assert BuildConfig(**settings(ctx.params).config) == BuildConfig()


def test_the_recorded_build_command_rebuilds_the_same_config(default_index):
    """The command ``build_command`` regenerates from a manifest parses back into the config that built it."""
    import shlex
    from dataclasses import asdict

    from gradindex.cli.build import build, settings
    from gradindex.spec.manifest import build_command
    from gradindex.store.builder import BuildConfig

    m = read_manifest(default_index)
    args = shlex.split(build_command(default_index, m, extra=""))[2:]
    ctx = build.make_context("build", args)
    cfg = BuildConfig(**settings(ctx.params).config)
    got = {k: v for k, v in asdict(cfg).items() if k not in ("rows", "projection_kind", "seed")}
    assert got == {**m["config"], "layers": ()} and str(cfg.rows) == m["rows"]
