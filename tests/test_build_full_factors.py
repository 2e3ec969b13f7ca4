"""A budget-bound build asked for the exact stage's fit (``BuildConfig(rerank_fit=True)``, ``gradindex build
--rerank-fit``; the default build before issue 30) sums the full-space ``A`` and ``S`` in its capture pass
(issue 17): its full-space fit skips the factor pass and replays the capture's head gradients, and writes
the same curvature as the separate passes (``gradindex precondition --space full`` on a default build, which
sums nothing), also for a sampled fit set (more examples than ``RERANK_FIT_EXAMPLES``)."""

from __future__ import annotations

import shutil

import h5py
import numpy as np
import pytest

import gradindex.plan as plan
from gradindex.capture import ProjectionSpec
from gradindex.data import load_records, tokenize_records
from gradindex.model import load_causal_lm
from gradindex.pipeline import BuildConfig, build_index
from gradindex.precondition import FitConfig, fit_preconditioner
from gradindex.precondition import fullspace as fs
from gradindex.spec.manifest import build_command, read_manifest

DAMPING = 0.1


def _build(out, gpt2_dir, text_jsonl, rerank_fit=True, shard_size=64, rerank_correction=0):
    model, tok = load_causal_lm(gpt2_dir, device="cpu")
    data = tokenize_records(load_records(text_jsonl), tok, 64)
    cfg = BuildConfig(projection=ProjectionSpec(), budget="1/64", precondition="ekfac", transcode="ekfac",
                      storage="int4", damping=DAMPING, shard_size=shard_size, max_length=64,
                      rerank_correction=rerank_correction,
                      **({} if rerank_fit is None else {"rerank_fit": rerank_fit}))  # (None: the default)
    build_index(model, tok, data, out, cfg, model_id=str(gpt2_dir), data_id=str(text_jsonl), progress=False)
    return out


def _rel(a, b) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def _same_curvature(a, b) -> None:
    """The same factors (``Q diag(λ) Qᵀ``, sign-free) and eigenvalues within float tolerance."""
    for m in ("kfac", "ekfac"):
        pa, pb = fs.load_full_preconditioner(a, m).curvature, fs.load_full_preconditioner(b, m).curvature
        with h5py.File(fs.full_path(a, m), "r") as fa, h5py.File(fs.full_path(b, m), "r") as fb:
            assert sorted(fa["layers"]) == sorted(fb["layers"]) == sorted(pa)
            for n in fa["layers"]:
                x, y = fa["layers"][n], fb["layers"][n]
                for key in ("lambda_A", "lambda_S"):  # the same sums up to float32 summation order
                    assert _rel(x[key][:], y[key][:]) < 1e-5, (m, n, key)
                for q, lam in (("Q_A", "lambda_A"), ("Q_S", "lambda_S")):  # (K-FAC's bases: EK-FAC's file)
                    fx = pa[n][q] @ np.diag(x[lam][:]) @ pa[n][q].T
                    fy = pb[n][q] @ np.diag(y[lam][:]) @ pb[n][q].T
                    assert _rel(fx, fy) < 1e-5, (m, n, q)
                # eigenvalues in the (sign-free) eigenbasis: the same multiset
                assert _rel(np.sort(pa[n]["Lambda"].ravel()), np.sort(pb[n]["Lambda"].ravel())) < 1e-4, (m, n)


@pytest.fixture(scope="module")
def separate(tmp_path_factory, gpt2_dir, text_jsonl):
    """The same build with no full-space fit (the default), then the fit's own two passes."""
    d = _build(tmp_path_factory.mktemp("sep") / "idx", gpt2_dir, text_jsonl, rerank_fit=False)
    assert "full_space" not in read_manifest(d)
    fit_preconditioner(d, FitConfig(method="ekfac", damping=DAMPING, space="full"))
    return d


def test_default_build_sums_no_full_space_factors_and_keeps_no_head_gradients(tmp_path, gpt2_dir, text_jsonl,
                                                                              monkeypatch):
    """Issue 30: the default build (budget-bound here) makes no full-space fit, so its capture sums no
    full-space ``A``/``S`` and keeps no head gradients (what raised the build's peak RSS); asked, it does."""
    from gradindex.capture import FullSums

    calls = {"sums": 0, "heads": 0}
    real_sums, real_put = FullSums.visit, fs.HeadGrads.put

    def sums(self, *a, **k):
        calls["sums"] += 1
        return real_sums(self, *a, **k)

    def put(self, *a, **k):
        calls["heads"] += 1
        return real_put(self, *a, **k)

    monkeypatch.setattr(FullSums, "visit", sums)
    monkeypatch.setattr(fs.HeadGrads, "put", put)
    d = _build(tmp_path / "idx", gpt2_dir, text_jsonl, rerank_fit=None)
    m = read_manifest(d)
    assert not m["config"]["rerank_fit"] and "full_space" not in m and not list((d / "precond").glob("*-full*"))
    assert calls == {"sums": 0, "heads": 0} and "--rerank-fit" not in build_command(d, m)
    _build(tmp_path / "asked", gpt2_dir, text_jsonl)
    assert calls["sums"] > 0 and calls["heads"] == 5  # (40 examples, batches of 8)


def test_rerank_fit_build_sums_the_factors_in_the_capture(tmp_path, gpt2_dir, text_jsonl, separate, monkeypatch):
    calls = []
    real = fs.batch_gradients

    def counting(*args, **kw):
        calls.append(kw.get("head_grad") is not None)
        return real(*args, **kw)

    monkeypatch.setattr(fs, "batch_gradients", counting)
    d = _build(tmp_path / "idx", gpt2_dir, text_jsonl)
    fit = read_manifest(d)["full_space"]["ekfac"]["fit"]
    assert fit["source"] == "build pass + model pass" and "factor_pass" not in fit["phase_seconds"]
    assert fit["examples"] == 40 and calls == [True] * 5  # one correction pass, every batch's head replayed
    _same_curvature(d, separate)


def test_rerank_fit_build_corrects_on_a_sample(tmp_path, gpt2_dir, text_jsonl, separate, monkeypatch):
    """``--rerank-correction 16`` (the default 128 of a larger set): the factors from all 40 examples of the
    capture pass, ``Λ*`` from a model pass over a seeded sample of 16 only, as the fit's own passes give it;
    the capture keeps no head gradients (the sample's batches are not the capture's)."""
    from test_fullspace import count_head_use

    calls = count_head_use(monkeypatch)
    d = _build(tmp_path / "idx", gpt2_dir, text_jsonl, rerank_correction=16)
    m = read_manifest(d)
    fit = m["full_space"]["ekfac"]["fit"]
    assert fit["source"] == "build pass + model pass" and fit["examples"] == 40 and fit["correction_examples"] == 16
    assert calls == [(False, False)] * 2  # one correction pass over 16 examples, batches of 8, heads computed
    assert "--rerank-correction 16" in build_command(d, m) and "--rerank-fit" in build_command(d, m)
    every = fs.read_layers(fs.full_path(separate, "ekfac"), ("Lambda",))
    ref = tmp_path / "ref"
    shutil.copytree(separate, ref)
    fit_preconditioner(ref, FitConfig(method="ekfac", damping=DAMPING, space="full", correction_examples=16))
    _same_curvature(d, ref)
    mine = fs.read_layers(fs.full_path(d, "ekfac"), ("Lambda",))
    assert all(_rel(np.sort(mine[n]["Lambda"].ravel()), np.sort(every[n]["Lambda"].ravel())) > 1e-2 for n in mine)


def test_sampled_fit_set_sums_only_its_examples(tmp_path, gpt2_dir, text_jsonl, monkeypatch):
    monkeypatch.setattr(plan, "RERANK_FIT_EXAMPLES", 24)  # 40 examples: a seeded sample of 24
    d = _build(tmp_path / "idx", gpt2_dir, text_jsonl)
    fit = read_manifest(d)["full_space"]["ekfac"]["fit"]
    assert fit["source"] == "build pass + model pass" and fit["examples"] == 24
    ref = _build(tmp_path / "ref", gpt2_dir, text_jsonl, rerank_fit=False)
    fit_preconditioner(ref, FitConfig(method="ekfac", damping=DAMPING, space="full", fit_examples=24))
    assert read_manifest(ref)["full_space"]["ekfac"]["fit"]["source"] == "model pass"
    _same_curvature(d, ref)


def test_sums_of_another_sample_are_not_taken(tmp_path, gpt2_dir, text_jsonl):
    from gradindex.precondition.factors import sample_rows
    from gradindex.store.builder import build_store

    model, tok = load_causal_lm(gpt2_dir, device="cpu")
    data = tokenize_records(load_records(text_jsonl), tok, 64)
    cfg = BuildConfig.raw(projection=ProjectionSpec(k_a=4, k_g=4, seed=1), shard_size=16, max_length=64,
                          precondition="ekfac")
    build_store(model, tok, data, tmp_path / "idx", cfg, model_id=str(gpt2_dir), data_id=str(text_jsonl),
                progress=False, full_fit_rows=sample_rows(40, 24, 0))
    same = fit_preconditioner(tmp_path / "idx", FitConfig(method="kfac", space="full", fit_examples=24))
    assert same["kfac"]["fit"]["source"] == "build pass + model pass"
    other = fit_preconditioner(tmp_path / "idx", FitConfig(method="kfac", space="full", fit_examples=24, seed=5))
    assert other["kfac"]["fit"]["source"] == "model pass"
    every = fit_preconditioner(tmp_path / "idx", FitConfig(method="kfac", space="full"))
    assert every["kfac"]["fit"]["source"] == "model pass"


def test_build_killed_in_the_transcode_keeps_the_sums_and_resumes(tmp_path, gpt2_dir, text_jsonl, separate,
                                                                   monkeypatch):
    """The capture's sums are the full-space fit's checkpoint before the transcode drops them: a build killed
    there resumes, and its fit still skips the factor pass and gives the same curvature."""
    import gradindex.precondition.fused as fused

    real = fused.compact_rows

    def dying(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(fused, "compact_rows", dying)
    with pytest.raises(KeyboardInterrupt):
        _build(tmp_path / "idx", gpt2_dir, text_jsonl)
    assert (tmp_path / "idx" / "precond" / fs.STATE).exists()
    monkeypatch.setattr(fused, "compact_rows", real)
    d = _build(tmp_path / "idx", gpt2_dir, text_jsonl)
    man = read_manifest(d)
    assert man["transcode"] and man["full_space"]["ekfac"]["fit"]["source"] == "build pass + model pass"
    assert not (d / "precond" / fs.STATE).exists()
    _same_curvature(d, separate)


def test_build_killed_in_the_correction_pass_resumes(tmp_path, gpt2_dir, text_jsonl, separate, monkeypatch):
    """Killed part-way through the full-space fit's correction pass (after the transcode: the shards no
    longer hold the sums), the re-run resumes from the checkpoint, still counted a build-pass fit."""
    from test_fullspace import _EagerState

    monkeypatch.setattr(fs, "_State", _EagerState)
    calls = {"n": 0}
    real = fs._CorrectionSums.__call__

    def dying(self, name, a, g):
        calls["n"] += 1
        if calls["n"] > 20:
            raise KeyboardInterrupt
        real(self, name, a, g)

    monkeypatch.setattr(fs._CorrectionSums, "__call__", dying)
    with pytest.raises(KeyboardInterrupt):
        _build(tmp_path / "idx", gpt2_dir, text_jsonl)
    state = np.load(tmp_path / "idx" / "precond" / fs.STATE)
    assert str(state["stage"]) == "correction" and 0 < int(state["done"]) < 40
    assert read_manifest(tmp_path / "idx")["transcode"]
    monkeypatch.setattr(fs._CorrectionSums, "__call__", real)
    d = _build(tmp_path / "idx", gpt2_dir, text_jsonl)
    assert read_manifest(d)["full_space"]["ekfac"]["fit"]["source"] == "build pass + model pass"
    _same_curvature(d, separate)


def test_sums_in_many_shards_are_left_to_the_fit(tmp_path, gpt2_dir, text_jsonl, separate):
    """Every shard holding fit examples would store its own copy of the sums: over three small shards
    (more than twice one copy, and more than half the captured rows) the fit makes its own factor pass."""
    d = _build(tmp_path / "idx", gpt2_dir, text_jsonl, shard_size=16)
    fit = read_manifest(d)["full_space"]["ekfac"]["fit"]
    assert fit["source"] == "model pass" and "factor_pass" in fit["phase_seconds"]
    _same_curvature(d, separate)
