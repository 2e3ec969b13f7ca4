"""Index kinds over the store's own codes: the exhaustive store scan and the two-tier sketch index."""

from __future__ import annotations

import json
import shutil
import time

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from gradindex.capture import ProjectionSpec
from gradindex.cli import main
from gradindex.data import load_records, tokenize_records
from gradindex.index import IndexConfig, OpenIndex, build_indices
from gradindex.index import sketch as sketch_mod
from gradindex.index.scan import CodeScanner, StoreScan
from gradindex.index.sketch import Sketch, SketchIndex, allocate, encode_sketch, split_levels
from gradindex.index.tiers import choose_kind, lookup_cost
from gradindex.index.tiers import sketch_files as tier_mod
from gradindex.model import load_causal_lm
from gradindex.pipeline import BuildConfig, build_index
from gradindex.query import QueryEngine
from gradindex.store import Store
from gradindex.store.codes import decode, encode
from gradindex.store.rows import RowReader


def _copy(src, tmp_path, name="index"):
    dst = tmp_path / name
    shutil.copytree(src, dst)
    shutil.rmtree(dst / "faiss", ignore_errors=True)
    return dst


def _rows(d) -> dict[str, np.ndarray]:
    with Store(d) as s:
        return {n: v.astype(np.float64) for n, v in s.read_rows(np.arange(len(s))).items()}


def _queries(d, texts) -> dict[str, np.ndarray]:
    with QueryEngine(d, device="cpu") as e:
        g, _, _ = e.gradients(e.tokenize(texts))
    return {n: v.numpy().astype(np.float64) for n, v in g.items()}


QUERIES = ["the cat sat on a mat", "dog ran far away from home", "blue sky with red sun over green hills",
           "old town river at noon"]


@pytest.fixture(scope="module", params=["int8", "fp16"])
def coded_store(request, tmp_path_factory, gpt2_dir, text_jsonl):
    """A 40-example store of a real model in 3 shards, rows of 8x8 (and 8x9: odd) numbers coded as ``param``."""
    model, tok = load_causal_lm(gpt2_dir, device="cpu")
    data = tokenize_records(load_records(text_jsonl), tok, 48)
    out = tmp_path_factory.mktemp(f"coded-{request.param}") / "index"
    cfg = BuildConfig.raw(projection=ProjectionSpec(k_a=9, k_g=8, seed=2), shard_size=16, storage=request.param,
                      max_length=48)
    build_index(model, tok, data, out, cfg, model_id=str(gpt2_dir), progress=False)
    return out


def test_store_scan_equals_the_decoded_rows(coded_store, default_index):
    """The FAISS kernels read the store's codes as the store decodes them (int8, fp16 here; int4 the default)."""
    for d in (coded_store, default_index):
        rows = _rows(d)
        rng = np.random.default_rng(0)
        u = {n: rng.standard_normal((3, x.shape[1])).astype(np.float32) for n, x in rows.items()}
        with Store(d) as st:
            got = StoreScan(RowReader(st), block_bytes=4096).scores(u, list(rows))  # several blocks per shard
        want = sum(u[n].astype(np.float64) @ x.T for n, x in rows.items())
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_store_scan_shares_layers_among_threads(default_index, monkeypatch):
    """One query, several threads: the layers are shared out (each thread its own scanners), the same scores."""
    import faiss

    rows = _rows(default_index)
    u = {n: np.random.default_rng(3).standard_normal((1, x.shape[1])).astype(np.float32) for n, x in rows.items()}
    want = sum(u[n].astype(np.float64) @ x.T for n, x in rows.items())
    with Store(default_index) as st:
        scan = StoreScan(RowReader(st), block_bytes=4096)
        one = scan.scores(u, list(rows))
        monkeypatch.setattr(faiss, "omp_get_max_threads", lambda: 3)
        three = scan.scores(u, list(rows))
    assert len(scan._scanners) == 3
    np.testing.assert_allclose(three, one, rtol=1e-12, atol=1e-12 * np.abs(one).max())
    assert np.abs(three - want).max() <= 1e-5 * np.abs(want).max()


def test_int4_scanner_reads_odd_rows():
    x = np.random.default_rng(1).standard_normal((50, 33)).astype(np.float32)
    codes, scales = encode(x, "int4")
    u = np.random.default_rng(2).standard_normal((2, 34)).astype(np.float32)
    u[:, 33] = 0.0
    sc = CodeScanner("int4", 34)
    uq, f = sc.prepare(u)
    got = sc.scores(codes, scales, uq, f)
    want = u[:, :33].astype(np.float64) @ decode(codes, scales, "int4", 33).T.astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_sketch_inner_products_are_within_the_jl_bound(default_index):
    """CountSketch of real whitened rows: unbiased, mean squared error within ``2 Σ_l ‖x_l‖²‖y_l‖²/m_l``
    (the variance bound), Chebyshev's tail; int8 codes add little."""
    rows = {n: x.astype(np.float32) for n, x in _rows(default_index).items()}
    dims = {n: x.shape[1] for n, x in rows.items()}
    energy = {n: float((x.astype(np.float64) ** 2).sum(1).mean()) for n, x in rows.items()}
    parts = allocate(dims, energy, 256)
    assert sum(parts.values()) == 256 and all(parts[n] < dims[n] for n in dims)
    exact = sum(x.astype(np.float64) @ x.T.astype(np.float64) for x in rows.values())  # [N, N]
    sq = {n: (x.astype(np.float64) ** 2).sum(1) for n, x in rows.items()}
    bound = 2 * sum(np.outer(sq[n], sq[n]) / parts[n] for n in rows)  # variance bound per pair
    iu = np.triu_indices(len(exact), 1)
    z, zq = [], []
    for seed in range(8):
        sk = Sketch(seed, dims, parts)
        y = sk.apply(rows)
        codes, scales = encode_sketch(y)
        yhat = (codes.view(np.int8) ^ np.int8(-128)).astype(np.float64) * scales[:, None]
        z.append(((y.astype(np.float64) @ y.T.astype(np.float64) - exact) / np.sqrt(bound))[iu])
        zq.append(((yhat @ yhat.T - exact) / np.sqrt(bound))[iu])
    z, zq = np.concatenate(z), np.concatenate(zq)
    assert abs(z.mean()) < 0.1  # unbiased (the bound's scale)
    assert (z ** 2).mean() <= 1.0  # E[err²] <= the variance bound
    assert (np.abs(z) > 3).mean() <= 1 / 9  # Chebyshev
    assert (zq ** 2).mean() <= 1.05 * (z ** 2).mean() + 0.01


@pytest.mark.parametrize("m", [1, 7, 300])
def test_sketch_scan_equals_the_decoded_codes_by_both_kernels(m, monkeypatch):
    """The int8 matrix product (two query levels) and the float kernel both give ``decode(codes) @ y``, bit for bit
    the same, over the whole index and over runs of positions; a shape torch refuses moves the index to the float
    kernel."""
    rng = np.random.default_rng(m)
    y = rng.standard_normal((2500, m)).astype(np.float32) * rng.lognormal(0, 1, (2500, 1)).astype(np.float32)
    codes, scales = encode_sketch(y)
    yhat = (codes.view(np.int8) ^ np.int8(-128)).astype(np.float64) * scales[:, None]
    q = rng.standard_normal((11, m)).astype(np.float32)
    want = q.astype(np.float64) @ yhat.T
    sk = Sketch(0, {"a": m}, {"a": m})
    levels, f = split_levels(q)
    assert levels.dtype == np.int8 and np.abs(levels).max() <= 127
    np.testing.assert_allclose(levels[:11] * f[:11, None] + levels[11:] * f[11:, None], q, atol=1e-4 * np.abs(q).max())
    runs = [(3, 1030), (1030, 1031), (2000, 2500)]  # across a float block's edge, one row, the tail
    at = np.concatenate([np.arange(lo, hi) for lo, hi in runs])
    got = {}
    for kernel in ("int8", "float"):
        monkeypatch.setenv(sketch_mod.KERNEL_ENV, kernel)
        ix = SketchIndex(sk, codes, scales, block=128)
        assert ix.kernel == ("float" if m == 1 else kernel)  # torch's int8 kernel is wrong at m = 1
        got[kernel] = ix.scores(q, batch=4)
        assert np.abs(got[kernel] - want).max() <= 2e-4 * np.abs(want).max()
        part = ix.unscaled(q, runs) * scales[at]
        np.testing.assert_array_equal(part, got[kernel][:, at])
    np.testing.assert_array_equal(got["int8"], got["float"])  # the same integers: a process's kernel changes no bit
    torch.set_default_dtype(torch.float64)  # a user's process may have changed it: the float kernel still works
    try:
        np.testing.assert_array_equal(SketchIndex(sk, codes, scales).scores(q), got["float"])
    finally:
        torch.set_default_dtype(torch.float32)
    monkeypatch.setenv(sketch_mod.KERNEL_ENV, "int8")
    ix = SketchIndex(sk, codes, scales)

    def refuse(*a):
        raise RuntimeError("this shape is refused")

    monkeypatch.setattr(torch, "_int_mm", refuse)
    assert np.abs(ix.scores(q) - want).max() <= 2e-4 * np.abs(want).max() and ix.kernel == "float"


def test_sketch_kernel_is_timed_once_and_named_by_the_environment(monkeypatch):
    """``auto`` takes int8 unless ``torch._int_mm`` is far slower than the float kernel (an AVX2-only EPYC:
    ~100x), decided once per process and thread count; a wrong name is refused, naming the choices."""
    monkeypatch.delenv(sketch_mod.KERNEL_ENV, raising=False)
    sketch_mod._timed_kernel.cache_clear()
    sketch_mod._int_mm_works(64)
    int8, fl = sketch_mod._int8_product, sketch_mod._float_product

    def slowly(product):
        def run(*a):
            time.sleep(0.05)
            return product(*a)
        return run

    monkeypatch.setattr(sketch_mod, "_int8_product", slowly(int8))
    assert sketch_mod.scan_kernel(64) == "float"
    monkeypatch.setattr(sketch_mod, "_int8_product", int8)
    assert sketch_mod.scan_kernel(64) == "float"  # cached: the timing is not repeated
    sketch_mod._timed_kernel.cache_clear()
    monkeypatch.setattr(sketch_mod, "_float_product", slowly(fl))
    assert sketch_mod.scan_kernel(64) == "int8"
    assert sketch_mod.scan_kernel(1) == "float"
    monkeypatch.setenv(sketch_mod.KERNEL_ENV, "faiss")
    with pytest.raises(ValueError, match="GRADINDEX_SKETCH_KERNEL='faiss'.*int8, float or auto"):
        sketch_mod.scan_kernel(64)
    sketch_mod._timed_kernel.cache_clear()


def test_store_kind_is_exact_and_writes_no_copy(default_index, tmp_path):
    d = _copy(default_index, tmp_path)
    res = build_indices(d, IndexConfig(), progress=False)  # auto at 40 examples: the store scan
    assert res.meta["kind"] == "store"
    assert sorted(p.name for p in (d / "faiss").iterdir()) == ["index.json", "norms.npy"]
    q, rows = _queries(d, QUERIES), _rows(d)
    truth = sum(q[n] @ rows[n].T for n in rows)
    with QueryEngine(d, device="cpu") as e:
        res = e.search(q, k=10, method="ekfac", texts=False)
    for j, r in enumerate(res):
        assert [h.id for h in r.hits] == np.argsort(-truth[j], kind="stable")[:10].tolist()
        np.testing.assert_allclose([h.score for h in r.hits], truth[j][[h.id for h in r.hits]], rtol=1e-9)


def test_two_tier_equals_brute_force_when_c_covers_the_truth(default_index, tmp_path):
    d = _copy(default_index, tmp_path)
    build_indices(d, IndexConfig(factory="sketch", sketch_bytes=260), progress=False)
    q, rows = _queries(d, QUERIES), _rows(d)
    layers = list(rows)
    with QueryEngine(d, device="cpu") as e:
        sk = e.indices.sketch
        assert sk.sketch.m == 256 and sk.nbytes() == 260 * e.n
        for chosen in (layers, layers[:3]):
            truth = sum(q[n] @ rows[n].T for n in chosen)
            for c, res in ((e.n, e.search(q, k=10, layers=chosen, candidates=e.n, method="ekfac", texts=False)),
                           (15, e.search(q, k=10, layers=chosen, candidates=15, method="ekfac", texts=False))):
                from gradindex.index import query_vectors

                _, u, _ = query_vectors(e.indices.space, e.pre, "graddot", 1e-3,
                                        {n: torch.from_numpy(q[n]).float() for n in chosen})
                approx = sk.scores(sk.sketch.apply(u, chosen))
                for j, r in enumerate(res):
                    ids = [h.id for h in r.hits]
                    np.testing.assert_allclose([h.score for h in r.hits], truth[j][ids], rtol=1e-9)  # exact re-rank
                    first = np.argsort(-approx[j], kind="stable")[:c]  # the first tier's top C ...
                    best = first[np.argsort(-truth[j][first], kind="stable")][:10]
                    assert ids == best.tolist()  # ... re-ranked exactly; with C = N: brute force
                    if c == e.n:
                        assert ids == np.argsort(-truth[j], kind="stable")[:10].tolist()


def test_a_wrong_sketch_kernel_setting_is_named_not_called_a_damaged_index(default_index, tmp_path, monkeypatch):
    d = _copy(default_index, tmp_path)
    build_indices(d, IndexConfig(factory="sketch", sketch_bytes=260), progress=False)
    monkeypatch.setenv(sketch_mod.KERNEL_ENV, "faiss")
    out = CliRunner().invoke(main, ["query", str(d), "--text", QUERIES[0], "--device", "cpu"])
    assert out.exit_code == 2 and "GRADINDEX_SKETCH_KERNEL='faiss' is not a sketch kernel" in out.output, out.output
    assert "unreadable" not in out.output and "rebuild" not in out.output


def test_sketch_build_resumes_after_a_kill(default_index, tmp_path, monkeypatch):
    clean = _copy(default_index, tmp_path, "clean")
    cfg = IndexConfig(factory="sketch", sketch_bytes=132, block=8, checkpoint_seconds=0.0)
    build_indices(clean, cfg, progress=False)
    d = _copy(default_index, tmp_path, "killed")
    calls = {"n": 0}
    real = tier_mod.encode_sketch

    def dying(y):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(y)

    monkeypatch.setattr(tier_mod, "encode_sketch", dying)
    with pytest.raises(KeyboardInterrupt):
        build_indices(d, cfg, progress=False)
    staged = json.loads((d / "faiss.new" / "index.json").read_text())
    assert staged["status"] == "building" and staged["sketch"]["rows"] == 16
    monkeypatch.setattr(tier_mod, "encode_sketch", real)
    build_indices(d, cfg, progress=False)
    for f in ("sketch.codes.npy", "sketch.scales.npy"):
        np.testing.assert_array_equal(np.load(d / "faiss" / f), np.load(clean / "faiss" / f))
    assert build_indices(d, cfg, progress=False).up_to_date


def test_old_faiss_indices_still_answer(default_index, tmp_path):
    d = _copy(default_index, tmp_path)
    build_indices(d, IndexConfig(factory="SQ4"), progress=False)  # the previous default's FAISS copy
    meta = json.loads((d / "faiss" / "index.json").read_text())
    meta.pop("kind")  # as an index.json written before the kinds
    (d / "faiss" / "index.json").write_text(json.dumps(meta))
    q, rows = _queries(d, QUERIES), _rows(d)
    truth = sum(q[n] @ rows[n].T for n in rows)
    with QueryEngine(d, device="cpu") as e:
        assert e.indices.kind == "faiss" and e.indices.sketch is None
        for j, r in enumerate(e.search(q, k=5, method="ekfac", texts=False)):
            assert [h.id for h in r.hits] == np.argsort(-truth[j], kind="stable")[:5].tolist()


def test_cli_builds_and_queries_the_sketch_index(default_index, tmp_path):
    d = _copy(default_index, tmp_path)
    r = CliRunner()
    res = r.invoke(main, ["index", str(d), "--index-type", "sketch", "--sketch-bytes", "516", "--quiet"])
    assert res.exit_code == 0, res.output
    assert "sketch" in res.output
    res = r.invoke(main, ["query", str(d), "--text", "the cat sat on a mat", "-k", "3", "--json", "--candidates",
                          "40", "--device", "cpu"])
    assert res.exit_code == 0, res.output
    assert len(json.loads(res.output.splitlines()[0])) == 3
    with OpenIndex(d) as ix:
        assert ix.load_indices().sketch.sketch.m == 512
    res = r.invoke(main, ["index", str(d), "--index-type", "store", "--whiten", "ekfac", "--quiet"])
    assert res.exit_code != 0 and "--index-type store" in res.output


def test_auto_kind_follows_n_row_size_and_memory():
    assert choose_kind(1_000, 400_000, "int4", ram_bytes=16 << 30) == "store"
    assert choose_kind(1_000_000, 400_000, "int4", ram_bytes=16 << 30) == "sketch"
    assert choose_kind(10_000, 25_000, "int4", ram_bytes=16 << 30) == "store"
    assert choose_kind(10_000, 25_000, "int4", ram_bytes=256 << 20) == "sketch"  # the store misses the page cache
    small, big = (lookup_cost(n, 400_000, "int4", "sketch", layers=8) for n in (10_000, 1_000_000))
    assert big.seconds > small.seconds and big.ram_bytes == 100 * small.ram_bytes
    store, sketch = (lookup_cost(1_000, 400_000, "int4", k) for k in ("store", "sketch"))
    assert store.ram_bytes < sketch.ram_bytes


def test_sketch_candidates_grow_with_n_and_the_engine_defaults_to_them(default_index, tmp_path, monkeypatch):
    from gradindex.index import cost

    assert [cost.sketch_candidates(n) for n in (50, 10_000, 200_000, 1_000_000, 5_000_000)] == [
        50, 500, 500, 1_000, 5_000]
    assert lookup_cost(1_000_000, 25_000, "int4", "sketch").scanned_bytes == \
        lookup_cost(1_000_000, 25_000, "int4", "sketch", candidates=1_000).scanned_bytes
    d = _copy(default_index, tmp_path)
    build_indices(d, IndexConfig(factory="sketch", sketch_bytes=68), progress=False)  # a coarse first tier
    q = _queries(d, QUERIES)
    monkeypatch.setattr(cost, "DEFAULT_CANDIDATES", 1)
    monkeypatch.setattr(cost, "CANDIDATE_SHARE", 0.3)
    with QueryEngine(d, device="cpu") as e:
        c = cost.sketch_candidates(e.n)
        assert c == -(-3 * e.n // 10)
        default = [[h.id for h in r.hits] for r in e.search(q, k=5, texts=False)]
        assert default == [[h.id for h in r.hits] for r in e.search(q, k=5, candidates=c, texts=False)]
