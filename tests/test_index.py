"""Per-layer FAISS indices: what they hold, defaults, resumable builds, and refusals."""

from __future__ import annotations

import json
import shutil

import faiss
import numpy as np
import pytest
import torch

from gradindex.capture import ProjectionSpec
from gradindex.data import load_records, tokenize_records
from gradindex.index import (
    IndexConfig,
    IndexSet,
    IndexSpace,
    RowReader,
    build_indices,
    default_factory,
    layer_file,
)
from gradindex.index.tiers import faiss_layers as index_build
from gradindex.model import load_causal_lm
from gradindex.pipeline import BuildConfig, build_index
from gradindex.spec.manifest import IndexMismatchError, read_manifest, write_manifest
from gradindex.store import Store
from gradindex.store.opened import OpenStore


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory, gpt2_dir, text_jsonl):
    """A 40-example store over 8 layers of 16 numbers, in 3 shards, with K-FAC and EK-FAC fitted."""
    model, tok = load_causal_lm(gpt2_dir, device="cpu")
    data = tokenize_records(load_records(text_jsonl), tok, 512)
    out = tmp_path_factory.mktemp("idx") / "index"
    cfg = BuildConfig.raw(projection=ProjectionSpec(k_a=4, k_g=4, seed=1), shard_size=16, precondition="ekfac")
    build_index(model, tok, data, out, cfg, model_id=str(gpt2_dir), data_id=str(text_jsonl), progress=False)
    return out


def _copy(src, tmp_path):
    dst = tmp_path / "index"
    shutil.copytree(src, dst)
    shutil.rmtree(dst / "faiss", ignore_errors=True)
    return dst


def _vectors(index_dir, layer) -> np.ndarray:
    idx = faiss.read_index(str(layer_file(index_dir, layer)))
    return idx.reconstruct_n(0, idx.ntotal)


def _store_rows(index_dir) -> dict[str, np.ndarray]:
    with Store(index_dir) as s:
        return s.read_rows(np.arange(len(s)))


def test_default_factory_follows_examples_and_dimension():
    assert default_factory(40, 16) == "Flat"
    assert default_factory(65_536, 256) == "Flat"  # 2^24 floats: still exhaustive
    assert default_factory(100_000, 256) == "IVF256,PQ128x4fs"
    assert default_factory(1_000_000, 256) == "IVF1024,PQ128x4fs"
    assert default_factory(10_000_000, 256) == "IVF4096,PQ128x4fs"
    assert default_factory(1_000_000, 7) == "Flat"  # 7M floats
    assert default_factory(5_000_000, 7) == "IVF2048,SQ8"  # odd
    # Few examples: Flat, however wide the layer, while its vectors fit in 2 GiB (memory rule).
    assert default_factory(512, 16_384) == default_factory(512, 66_049) == "Flat"
    assert default_factory(5_000, 4096) == default_factory(49_999, 8192) == "Flat"
    assert default_factory(40_000, 16_384) == "IVF256,PQ8192x4fs"  # 2.6 GB of float32
    assert default_factory(50_000, 4096) == "IVF256,PQ2048x4fs"


def test_default_index_writes_no_copy_of_the_store(store_dir, tmp_path):
    d = _copy(store_dir, tmp_path)
    res = build_indices(d, IndexConfig(), progress=False)
    assert res.meta["kind"] == "store" and {e["factory"] for e in res.meta["layers"].values()} == {"store"}
    assert sorted(p.name for p in (d / "faiss").iterdir()) == ["index.json", "norms.npy"]
    assert read_manifest(d)["index"]["factories"] == ["store"]


def test_flat_indices_hold_the_store_rows(store_dir, tmp_path):
    d = _copy(store_dir, tmp_path)
    res = build_indices(d, IndexConfig(factory="Flat"), progress=False)
    rows = _store_rows(d)
    assert set(res.meta["layers"]) == set(rows) and len(rows) == 8
    for n, x in rows.items():
        assert res.meta["layers"][n]["factory"] == "Flat"
        np.testing.assert_array_equal(_vectors(d, n), x)
    norms = np.load(d / "faiss" / "norms.npy")
    np.testing.assert_allclose(norms.sum(1), sum((x.astype(np.float64) ** 2).sum(1) for x in rows.values()),
                               rtol=1e-5)
    assert read_manifest(d)["index"]["factories"] == ["Flat"]


@pytest.mark.parametrize("whiten", ["kfac", "ekfac"])
def test_whitened_index_holds_h_inverse_sqrt_rows(store_dir, tmp_path, whiten):
    from gradindex.precondition import load_preconditioner

    d = _copy(store_dir, tmp_path)
    build_indices(d, IndexConfig(space=IndexSpace(whiten=whiten, damping=0.3)), progress=False)
    P = load_preconditioner(d, whiten)
    for n, x in _store_rows(d).items():
        expect = P.apply(n, torch.from_numpy(x).double(), power=-0.5, damping=0.3).numpy()
        np.testing.assert_allclose(_vectors(d, n), expect, rtol=1e-4, atol=1e-5 * np.abs(expect).max())


def test_normalized_index_rows_have_unit_norm_over_all_layers(store_dir, tmp_path):
    d = _copy(store_dir, tmp_path)
    res = build_indices(d, IndexConfig(space=IndexSpace(normalize=True)), progress=False)
    total = sum((_vectors(d, n).astype(np.float64) ** 2).sum(1) for n in res.meta["layers"])
    np.testing.assert_allclose(total, 1.0, rtol=1e-5)


def test_ivf_index_trains_on_a_sample_and_holds_every_row(store_dir, tmp_path):
    d = _copy(store_dir, tmp_path)
    res = build_indices(d, IndexConfig(factory="IVF4,Flat", train_size=30), progress=False)
    rows = _store_rows(d)
    for n, x in rows.items():
        idx = faiss.read_index(str(layer_file(d, n)))
        ivf = faiss.extract_index_ivf(idx)
        assert ivf.nlist == 4 and idx.ntotal == 40 and res.meta["layers"][n]["search"]["nprobe"] >= 1
        ivf.make_direct_map()
        np.testing.assert_array_equal(idx.reconstruct_n(0, 40), x)  # FAISS ids are store rows


def test_killed_index_build_resumes_where_it_stopped(store_dir, tmp_path, monkeypatch):
    d = _copy(store_dir, tmp_path)
    cfg = IndexConfig(factory="IVF4,Flat", block=8, checkpoint_seconds=0.0)
    real, calls = index_build.index_vectors, {"n": 0}

    def dying(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 12:  # mid-way through the second layer
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(index_build, "index_vectors", dying)
    with pytest.raises(KeyboardInterrupt):
        build_indices(d, cfg, progress=False)
    monkeypatch.setattr(index_build, "index_vectors", real)
    partial = list((d / "faiss.new").glob("*.partial"))
    assert len(partial) == 1 and faiss.read_index(str(partial[0])).ntotal > 0
    res = build_indices(d, cfg, progress=False)
    assert 0 < res.rows_added < 8 * 40  # the first layer and part of the second were kept
    assert not list((d / "faiss").glob("*.partial")) and not (d / "faiss.new").exists()
    fresh = _copy(store_dir, tmp_path / "fresh")
    build_indices(fresh, cfg, progress=False)
    for n in res.meta["layers"]:
        a, b = faiss.read_index(str(layer_file(d, n))), faiss.read_index(str(layer_file(fresh, n)))
        for idx in (a, b):
            faiss.extract_index_ivf(idx).make_direct_map()
        np.testing.assert_array_equal(a.reconstruct_n(0, 40), b.reconstruct_n(0, 40))


def test_rebuild_is_skipped_when_up_to_date_and_done_when_settings_change(store_dir, tmp_path):
    d = _copy(store_dir, tmp_path)
    build_indices(d, IndexConfig(), progress=False)
    again = build_indices(d, IndexConfig(), progress=False)
    assert again.up_to_date and again.rows_added == 0
    norms = (d / "faiss" / "norms.npy").stat().st_ino
    other = build_indices(d, IndexConfig(factory="HNSW8"), progress=False)
    assert not other.up_to_date and other.rows_added == 8 * 40
    assert (d / "faiss" / "norms.npy").stat().st_ino == norms  # still valid: linked into the new set, not redone
    assert {e["factory"] for e in other.meta["layers"].values()} == {"HNSW8"}


def test_bad_factory_string_names_it(store_dir, tmp_path):
    with pytest.raises(ValueError, match=r"'IVF4,PQ5x4'.*16-dimensional.*'Flat'"):  # (16 PQ centroids: trainable)
        build_indices(_copy(store_dir, tmp_path), IndexConfig(factory="IVF4,PQ5x4"), progress=False)


def test_incomplete_store_is_refused(store_dir, tmp_path):
    d = _copy(store_dir, tmp_path)
    m = read_manifest(d)
    m["status"] = "building"
    write_manifest(d, m)
    with pytest.raises(ValueError, match="not complete.*finish it with `gradindex build .* --out .*index "
                                         ".*--shard-size 16 .*` \\(it resumes\\)"):
        build_indices(d, IndexConfig(), progress=False)


@pytest.fixture(scope="module")
def indexed(store_dir, tmp_path_factory):
    d = _copy(store_dir, tmp_path_factory.mktemp("indexed"))
    build_indices(d, IndexConfig(factory="Flat"), progress=False)  # FAISS files, whose damage is checked
    return d


def _open(d):
    return IndexSet(OpenStore(d))


def test_missing_or_corrupt_index_file_names_the_file_and_the_fix(indexed, tmp_path):
    d = tmp_path / "index"
    shutil.copytree(indexed, d)
    layer = next(iter(read_manifest(d)["build"]["layers"]))
    f = layer_file(d, layer)
    data = f.read_bytes()
    f.write_bytes(b"\0" * len(data))
    with pytest.raises(OSError, match=rf"damaged.*{f.name}.*content differs.*gradindex index"):
        _open(d)
    f.write_bytes(data[:100])
    with pytest.raises(OSError, match=rf"{f.name} \(100 bytes, \d+ were written.*gradindex index"):
        _open(d)
    f.unlink()
    with pytest.raises(FileNotFoundError, match=rf"{f.name}.*missing.*gradindex index"):
        _open(d)
    shutil.rmtree(d / "faiss")
    with pytest.raises(FileNotFoundError, match=r"no FAISS indices.*gradindex index"):
        _open(d)
    (d / "faiss.new").mkdir()  # a first build that was killed
    with pytest.raises(ValueError, match=r"first index build .*faiss.new.* did not finish; resume it with `gradindex"):
        _open(d)


def test_indices_built_from_another_store_are_refused(indexed, tmp_path):
    d = tmp_path / "index"
    shutil.copytree(indexed, d)
    m = read_manifest(d)
    m["build"]["model_fingerprint"] = "0" * 32
    m["build"]["projection"]["seed"] = 7
    write_manifest(d, m)
    msg = r"another store: model differs.*projection differs.*gradindex index"
    with pytest.raises(IndexMismatchError, match=msg):
        _open(d)
    meta = json.loads((d / "faiss" / "index.json").read_text())
    meta["status"] = "building"
    (d / "faiss" / "index.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="did not finish; resume it with `gradindex index"):
        _open(d)


def test_row_reader_reads_any_rows_like_h5py(indexed):
    with Store(indexed) as s:
        r = RowReader(s)
        assert r.direct
        ids = np.array([39, 0, 17, 16, 15, 17, 3])
        got, expect = r.read(ids), s.read_rows(ids)
        for n in s.layers:
            np.testing.assert_array_equal(got[n], expect[n])
        with pytest.raises(IndexError, match=r"\[0, 40\)"):
            r.read(np.array([40]))
        assert all(v.shape == (0, s.dims[n]) for n, v in r.read(np.array([], np.int64)).items())


def test_ivf_pq_training_prints_no_faiss_warnings(store_dir, tmp_path, capfd):
    """40 rows train 4 lists and 8 PQ sub-quantizers of 16 centroids: FAISS warns per k-means
    (147,691 lines for one real build) unless told the small sample is intended."""
    d = _copy(store_dir, tmp_path)
    capfd.readouterr()
    res = build_indices(d, IndexConfig(factory="IVF4,PQ8x4fs", train_size=40), progress=False)
    assert {e["factory"] for e in res.meta["layers"].values()} == {"IVF4,PQ8x4fs"}
    err = capfd.readouterr().err
    assert "WARNING" not in err, err[:500]


def test_index_type_that_cannot_train_is_refused_before_capturing(gpt2_dir, text_jsonl, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from gradindex import pipeline
    from gradindex.cli import main

    monkeypatch.setattr(pipeline, "build_store", lambda *a, **k: pytest.fail("the capture pass ran"))
    out = tmp_path / "idx"
    r = CliRunner().invoke(main, ["build", str(gpt2_dir), str(text_jsonl), "--out", str(out), "--index-type",
                                  "IVF4096,Flat", "--device", "cpu", "--quiet"])
    assert r.exit_code != 0 and r.exception is not None and isinstance(r.exception, SystemExit), r.output
    assert "IVF4096,Flat has 4096 lists, more than the 40 examples" in r.output  # the CLI's check, before loading
    assert "Traceback" not in r.output and not (out / "store").exists()


@pytest.mark.parametrize("index_type", ["IVF8,Flat", "ivf-sketch"])
def test_a_train_size_below_the_lists_is_refused_before_any_work(gpt2_dir, text_jsonl, default_index, tmp_path,
                                                                  monkeypatch, index_type):
    """FAISS's k-means stopped on it with a traceback, after build's capture and fit (and compact's transcode)."""
    import shutil

    from click.testing import CliRunner

    from gradindex import pipeline
    from gradindex.checksum import read_checksums
    from gradindex.cli import main
    from tests.conftest import refused

    monkeypatch.setattr(pipeline, "build_store", lambda *a, **k: pytest.fail("the capture pass ran"))
    out = tmp_path / "idx"
    small = ["--index-type", index_type, "--train-size", "3"]  # (ivf-sketch: 5 lists over 40 rows)
    r = CliRunner().invoke(main, ["build", str(gpt2_dir), str(text_jsonl), "--out", str(out), *small, "--device",
                                  "cpu", "--quiet"])
    refused(r.exit_code, r.output, out, "--train-size 3 is fewer than the", "lists of --index-type",
            "give --train-size")
    d = tmp_path / "copy"
    shutil.copytree(default_index, d)
    before = read_checksums(d)
    r = CliRunner().invoke(main, ["index", str(d), *small, "--quiet"])
    refused(r.exit_code, r.output, None, "--train-size 3 is fewer than the")
    assert read_checksums(d) == before
    r = CliRunner().invoke(main, ["compact", str(d), "--out", str(tmp_path / "c"), *small, "--quiet"])
    refused(r.exit_code, r.output, tmp_path / "c", "--train-size 3 is fewer than the")


def test_store_keeps_at_most_open_shards_files_open(indexed, monkeypatch):
    """Each open HDF5 file holds ~0.8 MB of caches: a store keeps only the most recently used shards open
    (least recently used closed first), and reads the same rows."""
    import gradindex.store.shards as shards

    with Store(indexed) as s:
        want = s.read_rows(np.arange(40))
    monkeypatch.setattr(shards, "OPEN_SHARDS", 2)
    with Store(indexed) as s:
        assert len(s.paths) == 3
        for ids in (np.arange(40), np.array([39, 0, 17, 38, 1])):
            got = s.read_rows(ids)
            assert all(np.array_equal(got[n], want[n][ids]) for n in s.layers)
            assert len(s._files) <= 2
        blocks = {n: np.concatenate([b[n] for _, b in s.iter_blocks([n], block=7)]) for n in s.layers}
        assert all(np.array_equal(blocks[n], want[n]) for n in s.layers) and len(s._files) <= 2


def test_a_factory_string_that_does_not_fit_suggests_one_that_does():
    """The suggestion was 'IVF1024,PQ64', which fails the same way on a dimension 64 does not divide."""
    import re

    import faiss

    from gradindex.index.factory import make_index

    with pytest.raises(ValueError, match="does not work for 1551-dimensional vectors") as e:
        make_index("IVF4,PQ4", 1551)
    (pq,) = re.findall(r"'IVF256,(PQ\d+)'", str(e.value))
    assert pq == "PQ47" and faiss.index_factory(1551, f"IVF256,{pq}", faiss.METRIC_INNER_PRODUCT).d == 1551
