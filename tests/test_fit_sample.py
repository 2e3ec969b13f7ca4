"""A sampled build (issue 17): EK-FAC fitted on a seeded sample, every row coded in its whitened eigenbasis in
the capture pass. Its rows, fits and answers against the fused build whose fit takes the same sample; kills
resumed to the same index; a build of at most ``fit_sample`` examples exactly as before."""

from __future__ import annotations

import dataclasses

import h5py
import numpy as np
import pytest

from gradindex.capture import ProjectionSpec
from gradindex.data import load_records, tokenize_records
from gradindex.manifest import read_manifest, row_basis
from gradindex.model import load_causal_lm
from gradindex.pipeline import BuildConfig, build_index
from gradindex.precondition import sampled
from gradindex.precondition.files import precond_path
from gradindex.precondition.fit import FitConfig
from gradindex.precondition.fused import fit_and_transcode
from gradindex.store import Store
from gradindex.store.builder import build_store

S = 16
SAMPLED = BuildConfig(projection=ProjectionSpec(), budget="auto", storage="int4", precondition="ekfac",
                      shard_size=16, max_length=48, transcode="ekfac", fit_sample=S)


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
