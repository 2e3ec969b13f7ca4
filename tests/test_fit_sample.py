"""A sampled build (issue 17): EK-FAC fitted on a seeded sample, every row coded in its whitened eigenbasis in
the capture pass. Its rows, fits and answers against the fused build whose fit takes the same sample; kills
resumed to the same index; a build of at most ``fit_sample`` examples exactly as before."""

from __future__ import annotations

import dataclasses
import json

import h5py
import numpy as np
import pytest

from gradindex.capture import ProjectionSpec
from gradindex.data import load_records, tokenize_records
from gradindex.model import load_causal_lm
from gradindex.pipeline import BuildConfig, build_index
from gradindex.precondition import sampled
from gradindex.precondition.files import precond_path
from gradindex.precondition.fit import FitConfig
from gradindex.precondition.fused import fit_and_transcode
from gradindex.spec.manifest import build_command, read_manifest, row_basis
from gradindex.store import Store
from gradindex.store.builder import build_store

S = 16
SAMPLED = BuildConfig(projection=ProjectionSpec(), budget="auto", storage="int4", precondition="ekfac",
                      shard_size=16, max_length=48, transcode="ekfac", fit_sample=S, sample_above=S)


@pytest.fixture(scope="module")
def inputs(gpt2_dir, text_jsonl):
    model, tok = load_causal_lm(gpt2_dir, device="cpu")
    return model, tok, tokenize_records(load_records(text_jsonl), tok, 48)


@pytest.fixture(scope="module")
def reference(inputs, tmp_path_factory):
    """The fused build (capture, fit, transcode) with its fit restricted to the same sample."""
    model, tok, data = inputs
    d = tmp_path_factory.mktemp("ref") / "idx"
    build_store(model, tok, data, d, dataclasses.replace(SAMPLED, fit_sample=0), progress=False)
    fit_and_transcode(d, FitConfig(method="ekfac", damping=SAMPLED.damping, fit_examples=S, seed=0), "int4", model,
                      tok, data, sample_correction=True)
    return d


@pytest.fixture(scope="module")
def built(inputs, tmp_path_factory):
    model, tok, data = inputs
    d = tmp_path_factory.mktemp("sampled") / "idx"
    build_index(model, tok, data, d, SAMPLED, progress=False)
    return d


def _codes(d) -> dict[str, np.ndarray]:
    with Store(d) as st:
        return {n: st.read_rows(np.arange(len(st)), [n])[n] for n in st.layers}


def _fit(d, method: str) -> dict:
    with h5py.File(precond_path(d, method), "r") as f:
        return {"si": f["self_influence_layers"][:],
                **{f"{n}/{k}": g[k][:] for n, g in f["layers"].items() for k in ("Lambda", "A", "S")}}


def test_sampled_build_rows_and_fits_are_the_fused_build_on_the_same_sample(inputs, built, reference):
    m = read_manifest(built)
    assert len(inputs[2]) > S and row_basis(m) == "ekfac" and m["status"] == "complete"
    assert m["transcode"]["fit_sample"] == {"size": S, "seed": 0}
    assert m["preconditioners"]["ekfac"]["fit"]["sample"] == {"size": S, "seed": 0}
    assert not (built / sampled.SAMPLE_DIR).exists() and sorted(m["preconditioners"]) == ["ekfac", "kfac"]
    got, want = _codes(built), _codes(reference)
    for n, w in want.items():  # int4 codes equal but for float round-off at a rounding edge; scales to round-off
        g = got[n]
        scale_g, scale_w = np.abs(g).max(1, keepdims=True), np.abs(w).max(1, keepdims=True)
        np.testing.assert_allclose(scale_g, scale_w, rtol=1e-3, err_msg=n)
        codes_g, codes_w = np.rint(7 * g / scale_g), np.rint(7 * w / scale_w)
        assert (codes_g == codes_w).mean() > 0.995 and np.abs(codes_g - codes_w).max() <= 1, n
    for method in ("kfac", "ekfac"):
        g, w = _fit(built, method), _fit(reference, method)
        for k in w:
            np.testing.assert_allclose(g[k], w[k], rtol=2e-4, atol=1e-7 * np.abs(w[k]).max(), err_msg=f"{method} {k}")


def test_sampled_index_answers_queries_as_the_reference(built, reference, gpt2_dir):
    from gradindex.index import build_indices
    from gradindex.query import QueryEngine

    queries = ["the cat sat on a mat", "red sun over green hills", "a dog ran in the park"]
    got = {}
    for name, d in (("built", built), ("reference", reference)):
        if not (d / "faiss").exists():
            build_indices(d, progress=False)
        with QueryEngine(d, gpt2_dir, device="cpu") as e:
            got[name] = e.query_batch(queries, k=10, texts=False)
    for a, b in zip(got["built"], got["reference"], strict=True):
        ids_a, ids_b = [h.id for h in a.hits], [h.id for h in b.hits]
        assert len(set(ids_a) & set(ids_b)) >= 9 and ids_a[:3] == ids_b[:3]
        np.testing.assert_allclose([h.score for h in a.hits[:3]], [h.score for h in b.hits[:3]], rtol=2e-2)


def _same_index(a, b) -> None:
    for n, w in _codes(b).items():
        np.testing.assert_array_equal(_codes(a)[n], w)
    for method in ("kfac", "ekfac"):
        for k, v in _fit(b, method).items():
            np.testing.assert_array_equal(_fit(a, method)[k], v)


@pytest.mark.parametrize("kill_at", ["after the sample fit", 2, 5])
def test_a_killed_sampled_build_resumes_to_the_same_index(inputs, built, tmp_path, monkeypatch, kill_at):
    """Killed after the sample's fit (its checkpoint), or at the ``kill_at``-th batch of the main pass (batches
    of 8 in shards of 16: mid-shard at 2, in the third shard at 5): the re-run ends with the same index."""
    model, tok, data = inputs
    calls = {"n": 0}
    real_rows, real_fit = sampled.EigenCoder.rows, sampled.fit_on_sample

    def dying(self, s, grads):
        calls["n"] += 1
        if calls["n"] == kill_at:
            raise KeyboardInterrupt("killed")
        return real_rows(self, s, grads)

    def fit_then_die(*a, **k):
        real_fit(*a, **k)
        raise KeyboardInterrupt("killed")

    import gradindex.pipeline as pipeline

    monkeypatch.setattr(sampled.EigenCoder, "rows", dying)
    if kill_at == "after the sample fit":
        monkeypatch.setattr(pipeline, "fit_on_sample", fit_then_die)
    with pytest.raises(KeyboardInterrupt):
        build_index(model, tok, data, tmp_path / "idx", SAMPLED, progress=False)
    assert (tmp_path / "idx" / sampled.SAMPLE_DIR / sampled.CHECKPOINT).exists()
    monkeypatch.setattr(sampled.EigenCoder, "rows", real_rows)
    monkeypatch.setattr(pipeline, "fit_on_sample", real_fit)
    monkeypatch.setattr(sampled, "store_fit", lambda *a, **k: pytest.fail("the sample was fitted again"))
    build_index(model, tok, data, tmp_path / "idx", SAMPLED, progress=False)
    _same_index(tmp_path / "idx", built)
    assert not (tmp_path / "idx" / sampled.SAMPLE_DIR).exists()


def test_not_more_examples_than_the_sample_builds_as_before(inputs, tmp_path):
    """N <= fit_sample: the fused build over every example (fit_sample 0), the same rows and fits."""
    model, tok, data = inputs
    build_index(model, tok, data, tmp_path / "a", dataclasses.replace(SAMPLED, fit_sample=len(data)), progress=False)
    build_index(model, tok, data, tmp_path / "b", dataclasses.replace(SAMPLED, fit_sample=0), progress=False)
    _same_index(tmp_path / "a", tmp_path / "b")
    a, b = read_manifest(tmp_path / "a"), read_manifest(tmp_path / "b")
    assert "fit_sample" not in a["transcode"] and a["build"] == b["build"]


def test_cli_build_with_fit_sample_then_query(gpt2_dir, text_jsonl, tmp_path):
    from click.testing import CliRunner

    from gradindex.cli import main

    def run(*args):
        res = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
        assert res.exit_code == 0, res.output
        return res

    out = tmp_path / "idx"
    res = run("build", gpt2_dir, text_jsonl, "--out", out, "--shard-size", "16", "--max-length", "48",
              "--fit-sample", S, "--sample-above", S, "--device", "cpu", "--quiet")
    assert f"fitted on a sample of {S}" in res.output
    m = read_manifest(out)
    assert m["transcode"]["fit_sample"] == {"size": S, "seed": 0} and m["config"]["fit_sample"] == S
    assert f"--fit-sample {S} --sample-above {S}" in build_command(out, m)
    res = run("query", out, "--text", "the cat sat on a mat", "-k", "3", "--json")
    assert len(json.loads(res.stdout.strip().splitlines()[0])) >= 3
    res = run("build", gpt2_dir, text_jsonl, "--out", out, "--shard-size", "16", "--max-length", "48",
              "--fit-sample", S, "--sample-above", S, "--device", "cpu", "--quiet")  # a re-run: nothing recomputed
    assert read_manifest(out)["generation"] == m["generation"]


def test_auto_fits_on_every_example_up_to_8x_the_sample(inputs, tmp_path):
    """``sample_above`` auto: N <= 8 x fit_sample fits on every example (the cheaper route there), as
    ``fit_sample=0`` does; above it, the sample."""
    model, tok, data = inputs
    assert S < len(data) <= sampled.FIT_EVERY_UP_TO * S
    cfg = dataclasses.replace(SAMPLED, sample_above=0)
    assert "8 x --fit-sample" in sampled.sampled_reason(cfg, len(data))
    assert sampled.sampled_reason(cfg, sampled.FIT_EVERY_UP_TO * S + 1) == ""
    build_index(model, tok, data, tmp_path / "a", cfg, progress=False)
    build_index(model, tok, data, tmp_path / "b", dataclasses.replace(SAMPLED, fit_sample=0), progress=False)
    _same_index(tmp_path / "a", tmp_path / "b")
    assert "fit_sample" not in read_manifest(tmp_path / "a")["transcode"]


def test_auto_samples_where_the_disk_cannot_hold_the_fit_on_every_example(inputs, tmp_path, monkeypatch):
    """A fresh build whose fit on every example would not fit the free disk takes the sample (and says so);
    a resumed build keeps the route it started on, whatever the disk holds now."""
    from gradindex import pipeline
    from gradindex.plan import plan_build

    model, tok, data = inputs
    cfg = dataclasses.replace(SAMPLED, sample_above=0)
    need = plan_build(model, cfg, len(data), False).peak_disk
    out = tmp_path / "idx"
    monkeypatch.setattr(pipeline, "free_bytes", lambda _: need)
    assert pipeline.routed_plan(model, cfg, len(data), out, False)[0] is cfg
    monkeypatch.setattr(pipeline, "free_bytes", lambda _: need - 1)
    assert pipeline.routed_plan(model, cfg, len(data), out, False)[0].sample_above == S
    (out / sampled.SAMPLE_DIR).mkdir(parents=True)  # a sampled build under way: resumed as one
    monkeypatch.setattr(pipeline, "free_bytes", lambda _: 1 << 60)
    assert pipeline.routed_plan(model, cfg, len(data), out, False)[0].sample_above == S
    assert pipeline.routed_plan(model, cfg, len(data), out, True)[0] is cfg  # (--overwrite: a fresh build)
    (out / sampled.SAMPLE_DIR).rmdir()
    monkeypatch.setattr(pipeline, "free_bytes", lambda _: need - 1)
    build_index(model, tok, data, out, cfg, progress=False)
    m = read_manifest(out)
    assert m["transcode"]["fit_sample"] == {"size": S, "seed": 0} and m["config"]["sample_above"] == S
