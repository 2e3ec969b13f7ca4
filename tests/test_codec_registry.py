"""Row codes are one registry: a code registered in this test file alone (no other module touched) is
stored by a build, named by a row spec, decoded by every reader, scanned by the store tier and counted
by the plan — checked against the float32 rows of the same build (its quantization bound) and a
brute-force inner product."""

from __future__ import annotations

import numpy as np
import pytest

from gradindex.spec.rows import CODE_BITS, RowSpec
from gradindex.store import codes as C


@pytest.fixture
def int16():
    """``int16``: a symmetric absmax code of 32767 levels in int16, one float32 scale per row (no functions:
    the registry's absmax encode and decode take its ``levels`` and ``dtype``)."""
    toy = C.register_codec(C.Codec("int16", "<i2", levels=32767))
    yield toy
    C.unregister_codec(toy.name)
    assert "int16" not in CODE_BITS


def test_a_registered_code_is_a_row_spec_and_round_trips(int16):
    spec = RowSpec.parse("P8x4,int16")
    assert str(spec) == "P8x4,int16" and spec.bytes_per_example({"a": (10, 3)}) == 2 * 32 + 4
    assert C.row_bytes("int16", 32) == 68 and C.bytes_per_number("int16") == 2 and C.has_scale("int16")
    x = np.random.default_rng(0).standard_normal((5, 33)).astype(np.float32)
    codes, scales = C.encode(x, "int16")
    assert codes.dtype == np.int16 and scales.shape == (5,)
    bound = np.abs(x).max(axis=1, keepdims=True) / 32767 / 2  # |x - x̂| <= s / 2
    assert (np.abs(C.decode(codes, scales, "int16", 33) - x) <= bound * (1 + 1e-5)).all()


def test_a_registered_code_is_built_scanned_and_queried(int16, tmp_path, gpt2_dir, text_jsonl):
    from gradindex.capture import ProjectionSpec
    from gradindex.data import load_records, tokenize_records
    from gradindex.index import IndexConfig, OpenIndex
    from gradindex.model import load_causal_lm
    from gradindex.pipeline import BuildConfig, build_index
    from gradindex.plan import plan_build
    from gradindex.query import QueryEngine
    from gradindex.store import Store

    model, tok = load_causal_lm(gpt2_dir, device="cpu")
    data = tokenize_records(load_records(text_jsonl), tok, 32)
    built = {}
    for storage in ("fp32", "int16"):
        cfg = BuildConfig.raw(projection=ProjectionSpec(k_a=6, k_g=5, seed=1), storage=storage, shard_size=16,
                              max_length=32)
        out = tmp_path / storage
        res, _ = build_index(model, tok, data, out, cfg, index=IndexConfig(factory="store"), progress=False,
                             model_id=str(gpt2_dir), data_id=str(text_jsonl))
        assert res.manifest["rows"] == f"P6x5,{storage}"
        built[storage] = out
    plans = {s: plan_build(model, BuildConfig.raw(projection=ProjectionSpec(k_a=6, k_g=5), storage=s), len(data))
             for s in ("fp32", "int16")}  # 8 layers of 30 numbers: 4 bytes each, or 2 and a 4-byte scale
    assert plans["fp32"].row_bytes - plans["int16"].row_bytes == 8 * (4 * 30 - (2 * 30 + 4))
    with Store(built["fp32"]) as a, Store(built["int16"]) as b:
        assert b.storage == "int16"
        for n in a.layers:
            x, y = (np.concatenate([blk[n] for _, blk in s.iter_blocks([n])]) for s in (a, b))
            top = np.abs(x).max(axis=1, keepdims=True)  # s / 2, plus the two captures' float32 rounding
            assert (np.abs(y - x) <= top / 32767 / 2 + 1e-6 * top).all(), n
            assert np.abs(y - x).max() > 0  # (codes, not the float32 rows)
        with OpenIndex(built["int16"]) as ix:  # the query's direct row reader decodes it too
            ids = np.array([3, 0, 17, 3])
            got = ix.rows.read(ids)
            for n in b.layers:
                np.testing.assert_array_equal(got[n], b.read_rows(ids, [n])[n])
    texts = ["the cat sat on a mat", "red sun over green hills"]
    with QueryEngine(built["int16"], device="cpu", use_gpu=False) as e:
        grads, _, _ = e.gradients(e.tokenize(texts))
        hits = e.search(grads, k=5, method="graddot")  # the store tier scans the int16 codes
    with Store(built["int16"]) as st:  # brute force over the decoded rows
        want = sum(grads[n].double().numpy() @ np.concatenate([blk[n] for _, blk in st.iter_blocks([n])]).T
                   for n in st.layers)
    for r, row in zip(hits, want, strict=True):
        assert [h.id for h in r.hits] == list(np.argsort(-row, kind="stable")[:5])
        np.testing.assert_allclose([h.score for h in r.hits], np.sort(row)[::-1][:5], rtol=1e-4)
