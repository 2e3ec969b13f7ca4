"""Quantized row storage: codes and their error bounds, sizes on disk, readers, scores against float32."""

from __future__ import annotations

import json

import faiss
import h5py
import numpy as np
import pytest
from conftest import make_texts

from gradindex.capture import ProjectionSpec
from gradindex.data import load_records, tokenize_records
from gradindex.index import IndexConfig, RowReader, build_indices, layer_file
from gradindex.model import load_causal_lm
from gradindex.pipeline import BuildConfig, build_index
from gradindex.query import QueryEngine
from gradindex.query.scores import score_matrix
from gradindex.spec.manifest import IndexMismatchError
from gradindex.store import Store
from gradindex.store.builder import build_store
from gradindex.store.codes import STORAGES, decode, encode

LEVELS = {"int8": 127, "int4": 7}
"""Largest code magnitude of each integer storage (docs/formats.md)."""

PLANTED = "noon noon river river hills hills fish fish bread bread noon noon river river"
PLANTED_ID = 23


def _rows(rng, n: int, d: int) -> np.ndarray:
    x = rng.standard_normal((n, d)).astype(np.float32) * rng.lognormal(0, 3, (n, 1)).astype(np.float32)
    x[3] = 0.0  # an all-zero row
    x[5, :] = 0.0
    x[5, -1] = -7.5  # a row whose only value is its absmax
    return x


def _unpack_int4_reference(codes: np.ndarray, d: int) -> np.ndarray:
    """Independent nibble unpacking, one element at a time."""
    out = np.zeros((len(codes), d), dtype=np.int64)
    for i in range(len(codes)):
        for j in range(d):
            byte = int(codes[i, j // 2])
            out[i, j] = (byte >> 4 if j % 2 else byte & 15) - 8
    return out


@pytest.mark.parametrize("storage", ["int8", "int4"])
@pytest.mark.parametrize("d", [1, 16, 33])
def test_integer_codes_round_trip_within_half_a_step(storage, d):
    rng = np.random.default_rng(d)
    x = _rows(rng, 64, d)
    codes, s = encode(x, storage)
    q = LEVELS[storage]
    np.testing.assert_allclose(s, np.abs(x).max(axis=1) / q, rtol=1e-6)
    if storage == "int4":
        assert codes.dtype == np.uint8 and codes.shape == (64, (d + 1) // 2)
        c = _unpack_int4_reference(codes, d)
    else:
        assert codes.dtype == np.int8 and codes.shape == (64, d)
        c = codes.astype(np.int64)
    assert np.abs(c).max() <= q
    xh = decode(codes, s, storage, d)
    assert xh.dtype == np.float32 and xh.shape == x.shape
    np.testing.assert_allclose(xh, c * s[:, None], rtol=1e-6)
    err = np.abs(x - xh)
    bound = s[:, None] / 2 * (1 + 1e-5) + 1e-30
    assert (err <= bound).all(), float((err / bound).max())
    assert not xh[3].any()
    assert xh[5, -1] == pytest.approx(-7.5, rel=1e-6)  # the absmax is exact
    if d > 8:  # the bound is tight: random rows use most of the half step
        assert (err / bound).max() > 0.8


def test_fp16_codes_round_trip_within_half_an_ulp():
    x = _rows(np.random.default_rng(0), 32, 20) * 1e-3
    codes, s = encode(x, "fp16")
    assert codes.dtype == np.float16 and s is None
    xh = decode(codes, s, "fp16", 20)
    normal = np.abs(x) >= 6.2e-5
    assert (np.abs(x - xh)[normal] <= np.abs(x)[normal] * 2.0**-11).all()


def _data(tok, tmp_path):
    texts = make_texts(40, seed=7)
    texts[PLANTED_ID] = PLANTED
    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return p, tokenize_records(load_records(p), tok, 64)


@pytest.fixture(scope="module")
def stores(tmp_path_factory, gpt2_dir):
    """The same unprojected build in every storage, with a flat index (for queries)."""
    model, tok = load_causal_lm(gpt2_dir, device="cpu")
    root = tmp_path_factory.mktemp("storage")
    path, data = _data(tok, root)
    out = {}
    for storage in STORAGES:
        cfg = BuildConfig.raw(projection=ProjectionSpec.parse("none"), shard_size=16, storage=storage)
        build_index(model, tok, data, root / storage, cfg, index=IndexConfig(factory="Flat"),
                    model_id=str(gpt2_dir), data_id=str(path), progress=False)
        out[storage] = root / storage
    return out


def _bytes(d) -> tuple[int, int]:
    """(bytes of the store files, bytes of their datasets' storage)."""
    files = data = 0
    for p in (d / "store").glob("shard-*.h5"):
        files += p.stat().st_size
        with h5py.File(p, "r") as f:
            sets: list[h5py.Dataset] = []
            f.visititems(lambda _, o, out=sets: out.append(o) if isinstance(o, h5py.Dataset) else None)
            data += sum(ds.id.get_storage_size() for ds in sets)
    return files, data


def test_store_files_shrink_with_the_codes(stores):
    size = {s: _bytes(stores[s]) for s in STORAGES}
    data = {s: size["fp32"][1] / size[s][1] for s in STORAGES}
    files = {s: size["fp32"][0] / size[s][0] for s in STORAGES}
    # rows: 2x / 4x / 8x less, less the 4-byte scale per row and layer and the per-example columns
    assert 1.99 <= data["fp16"] <= 2.0 and 3.97 <= data["int8"] <= 4.0 and 7.9 <= data["int4"] <= 8.0, data
    # files: HDF5's own metadata is a fixed ~3 KB per dataset and shard (here 3 shards of 16 rows)
    for s in STORAGES:
        assert size[s][0] - size[s][1] < 3 * 80_000, size
    assert files["fp16"] > 1.9 and files["int8"] > 3.4 and files["int4"] > 5.8, files


@pytest.mark.parametrize("storage", ["fp16", "int8", "int4"])
def test_readers_decode_rows_within_the_code_bound(stores, storage):
    with Store(stores["fp32"]) as ref, Store(stores[storage]) as st:
        assert st.storage == storage and st.dims == ref.dims
        ids = np.array([39, 0, 17, 17, 5, 31])
        x = ref.read_rows(np.arange(40))
        by_rows = st.read_rows(ids)
        by_blocks = {n: np.concatenate([b[n] for _, b in st.iter_blocks([n], block=7)]) for n in st.layers}
        reader = RowReader(st)
        assert reader.direct
        fast = reader.read(ids)
        for n in st.layers:
            np.testing.assert_array_equal(by_blocks[n][ids], by_rows[n])
            np.testing.assert_array_equal(fast[n], by_rows[n])
            err = np.abs(by_blocks[n] - x[n])
            if storage == "fp16":
                assert (err <= np.abs(x[n]) * 2.0**-11 + 6e-8).all()
            else:
                s = np.abs(x[n]).max(axis=1, keepdims=True) / LEVELS[storage]
                assert (err <= s / 2 * (1 + 1e-5)).all()
                assert (err > 0).any()


def _ranks(v: np.ndarray) -> np.ndarray:
    r = np.empty(len(v))
    r[np.argsort(v, kind="stable")] = np.arange(len(v))
    return r


def _spearman(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.corrcoef(_ranks(a), _ranks(b))[0, 1])


@pytest.mark.parametrize("storage", ["fp16", "int8", "int4"])
def test_quantized_scores_rank_like_float32(stores, storage):
    queries = [PLANTED, "the cat sat on a mat", "dog ran far away from home", "red sun over green hills"]
    with QueryEngine(stores["fp32"], device="cpu") as e:
        q, _, _ = e.gradients(e.tokenize(queries))
        top_ref = [r.hits[0].id for r in e.query_batch(queries, k=3)]
    ref = score_matrix(stores["fp32"], q, device="cpu")
    got = score_matrix(stores[storage], q, device="cpu")
    rho = [_spearman(a, b) for a, b in zip(ref, got, strict=True)]
    assert min(rho) >= 0.99, rho
    # a wrong decode (here: the codes without their scales) is caught by the same measure
    if storage != "fp16":
        with Store(stores[storage]) as st:
            raw = {n: np.concatenate([b[n] for _, b in st.iter_blocks([n])]) for n in st.layers}
            scale = {n: np.abs(raw[n]).max(axis=1) for n in raw}
        unscaled = sum(q[n].double().numpy() @ (raw[n] / np.where(scale[n] > 0, scale[n], 1)[:, None]).T
                       for n in raw)
        assert min(_spearman(a, b) for a, b in zip(ref, unscaled, strict=True)) < 0.99
    with QueryEngine(stores[storage], device="cpu") as e:
        res = e.query_batch(queries, k=3)
    assert top_ref[0] == PLANTED_ID
    assert [r.hits[0].id for r in res] == top_ref


@pytest.mark.parametrize("factory", ["SQfp16", "SQ8", "SQ4", "IVF4,SQ8"])
def test_faiss_scalar_quantizers_use_inner_product_and_find_the_planted_example(stores, tmp_path, factory):
    import shutil

    d = tmp_path / "index"
    shutil.copytree(stores["int8"], d)
    res = build_indices(d, IndexConfig(factory=factory), progress=False, force=True)
    assert {e["factory"] for e in res.meta["layers"].values()} == {factory}
    with Store(d) as st:
        n = st.layers[0]
        x = st.read_rows(np.arange(len(st)), [n])[n]
    index = faiss.read_index(str(layer_file(d, n)))
    assert index.metric_type == faiss.METRIC_INNER_PRODUCT
    xr = index.reconstruct_n(0, index.ntotal)
    rel = np.abs(xr - x).max() / np.abs(x).max()
    assert rel < {"SQfp16": 1e-3, "SQ8": 0.02, "SQ4": 0.2, "IVF4,SQ8": 0.02}[factory], rel
    with QueryEngine(d, device="cpu") as e:
        hits = e.query(PLANTED, k=3).hits
    assert hits[0].id == PLANTED_ID


def test_resume_with_another_storage_is_refused(stores, gpt2_dir, tmp_path):
    model, tok = load_causal_lm(gpt2_dir, device="cpu")
    _, data = _data(tok, tmp_path)
    cfg = BuildConfig.raw(projection=ProjectionSpec.parse("none"), shard_size=16, storage="int4")
    with pytest.raises(IndexMismatchError, match="storage differs.*int8.*int4"):
        build_store(model, tok, data, stores["int8"], cfg, progress=False)
