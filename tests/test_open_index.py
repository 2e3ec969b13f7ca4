"""An index is opened once: manifest.json is read once per open, never per search, and a build
passes its manifest from stage to stage instead of re-reading it."""

from __future__ import annotations

import builtins
import os
import pathlib

import numpy as np
import pytest

from gradindex.capture import ProjectionSpec
from gradindex.data import load_records, tokenize_records
from gradindex.index import IndexConfig, IndexSpace, OpenIndex
from gradindex.model import load_causal_lm
from gradindex.pipeline import BuildConfig, build_index
from gradindex.query import QueryEngine
from gradindex.query.scores import score_matrix
from gradindex.spec.manifest import forget_manifests


class ManifestIO:
    """Counts reads (any way of opening the file) and atomic writes of every ``manifest.json``."""

    def __init__(self, monkeypatch):
        self.reads = self.writes = 0
        read_text, real_open, replace = pathlib.Path.read_text, builtins.open, os.replace

        def counted_read_text(path, *a, **k):
            self.reads += path.name == "manifest.json"
            return read_text(path, *a, **k)

        def counted_open(file, mode="r", *a, **k):
            self.reads += str(file).endswith("manifest.json") and "r" in mode
            return real_open(file, mode, *a, **k)

        def counted_replace(src, dst, *a, **k):
            self.writes += str(dst).endswith("manifest.json")
            return replace(src, dst, *a, **k)

        monkeypatch.setattr(pathlib.Path, "read_text", counted_read_text)
        monkeypatch.setattr(builtins, "open", counted_open)
        monkeypatch.setattr(os, "replace", counted_replace)

    def take(self) -> tuple[int, int]:
        out = (self.reads, self.writes)
        self.reads = self.writes = 0
        return out


@pytest.fixture(scope="module")
def model_and_data(gpt2_dir, text_jsonl):
    model, tok = load_causal_lm(gpt2_dir, device="cpu")
    return model, tok, tokenize_records(load_records(text_jsonl), tok, 64)


@pytest.fixture(scope="module")
def built(tmp_path_factory, model_and_data, gpt2_dir, text_jsonl):
    """An EK-FAC build with whitened indices, run twice; the manifest I/O of each run."""
    model, tok, data = model_and_data
    cfg = BuildConfig.raw(projection=ProjectionSpec(k_a=4, k_g=4), max_length=64, shard_size=16, precondition="ekfac")
    out = tmp_path_factory.mktemp("open") / "idx"
    counts = []
    with pytest.MonkeyPatch.context() as mp:
        io = ManifestIO(mp)
        for _ in range(2):
            forget_manifests()  # each run as a fresh process would (this one keeps what it read or wrote)
            build_index(model, tok, data, out, cfg, IndexConfig(space=IndexSpace(whiten="ekfac")),
                        model_id=str(gpt2_dir), data_id=str(text_jsonl), progress=False)
            counts.append(io.take())
    return out, counts


def test_a_build_with_ekfac_and_indices_never_rereads_its_manifest(built):
    _, (first, again) = built
    # writes: store building, store complete, preconditioners fitted, indices registered
    assert first == (0, 4)
    assert again[0] == 1  # the resume check of the existing build


def test_an_engine_reads_the_manifest_once_and_never_per_search(built, model_and_data, monkeypatch):
    out, _ = built
    model, tok, _ = model_and_data
    io = ManifestIO(monkeypatch)
    forget_manifests()  # as a fresh process
    with QueryEngine(out, model=model, tokenizer=tok) as e:
        assert io.take() == (1, 0)
        for method in ("graddot", "cosine", "kfac", "ekfac", "ekfac-selfnorm", "graddot-selfnorm"):
            e.query_batch(["the cat sat on a mat", "red sun"], k=3, method=method, damping=0.2, lowest=1)
            e.scores(["red sun"], method=method)
        q, _, _ = e.gradients(e.tokenize(["red sun"]))
        s = score_matrix(e.index, q, "kfac-selfnorm")
        assert io.take() == (0, 0)
    assert OpenIndex(out).close() is None and io.take() == (0, 0)  # read already in this process: kept
    forget_manifests()
    with OpenIndex(out) as ix:
        np.testing.assert_array_equal(score_matrix(ix, q, "kfac-selfnorm"), s)
        assert ix.methods(selfnorm=True)[-1] == "ekfac-selfnorm"
    assert io.take() == (1, 0)
    forget_manifests()
    np.testing.assert_array_equal(score_matrix(out, q, "kfac-selfnorm"), s)  # a path: opened for the call
    assert io.take() == (1, 0)


def test_projection_spec_has_one_decoder_with_one_error():
    spec = ProjectionSpec(kind="rademacher", k_a=3, k_g=5, seed=9)
    assert ProjectionSpec.from_dict(spec.to_dict()) == spec
    for bad in ({**spec.to_dict(), "stream_version": 99}, {"kind": "sparse", "k_a": 1, "k_g": 1},
                {"k_a": 4, "colour": "blue"}):
        with pytest.raises(ValueError, match=r"^the index was built with .*; install the gradindex version"):
            ProjectionSpec.from_dict(bad)


def test_a_search_parses_its_method_once(built, model_and_data, monkeypatch):
    """Counted inside gradindex.methods (``_parse``, which every ``parse_method`` calls wherever it was
    imported from), so a module that parses the method again fails this, whichever module it is."""
    import gradindex.methods

    out, _ = built
    model, tok, _ = model_and_data
    calls = []
    real = gradindex.methods._parse

    def counted(method):
        calls.append(method)
        return real(method)

    monkeypatch.setattr(gradindex.methods, "_parse", counted)
    with QueryEngine(out, model=model, tokenizer=tok) as e:
        q, _, _ = e.gradients(e.tokenize(["red sun"]))
        for method in ("ekfac-selfnorm", "kfac", "cosine"):
            e.search(q, k=3, method=method, lowest=1)  # loads the preconditioner, self-influence
            calls.clear()
            e.search(q, k=3, method=method, lowest=1)
            assert calls == [method]
