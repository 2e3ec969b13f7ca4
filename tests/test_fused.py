"""The default build's fused fit + transcode: the numbers of the separate stages (and of a dense float64
reference), one read of the store (each row rotated once), and a kill mid-transcode resumed to the same index."""

from __future__ import annotations

import dataclasses

import h5py
import numpy as np
import pytest

from gradindex.capture import ProjectionSpec
from gradindex.data import load_records, tokenize_records
from gradindex.model import load_causal_lm
from gradindex.pipeline import BuildConfig, build_index
from gradindex.precondition import compact, ekfac, fit, fused, rotated
from gradindex.precondition.files import precond_path
from gradindex.spec.manifest import read_manifest, row_basis
from gradindex.store import Store

DEFAULT = BuildConfig(projection=ProjectionSpec(), budget="auto", storage="int4", precondition="ekfac",
                      shard_size=16, max_length=48, transcode="ekfac")
RAW = dataclasses.replace(DEFAULT, storage="fp16", transcode="none", budget=0, projection=ProjectionSpec.parse("none"))


@pytest.fixture(scope="module")
def inputs(gpt2_dir, text_jsonl):
    model, tok = load_causal_lm(gpt2_dir, device="cpu")
    return model, tok, tokenize_records(load_records(text_jsonl), tok, 48)


@pytest.fixture(scope="module")
def raw(inputs, tmp_path_factory):
    """The default build's capture as the separate stages leave it: float16 rows, EK-FAC fitted in two passes."""
    model, tok, data = inputs
    d = tmp_path_factory.mktemp("fused") / "raw"
    build_index(model, tok, data, d, RAW, progress=False)
    return d


def _file(d, method: str) -> dict:
    with h5py.File(precond_path(d, method), "r") as f:
        layers = {n: {k: g[k][:] for k in ("Q_S", "Q_A", "Lambda")} for n, g in f["layers"].items()}
        return {"si": f["self_influence_layers"][:], "layers": layers}


def _rows(d) -> dict[str, np.ndarray]:
    with Store(d) as st:
        return {n: st.read_rows(np.arange(len(st)), [n])[n] for n in st.layers}


def _build(inputs, out):
    model, tok, data = inputs
    return build_index(model, tok, data, out, DEFAULT, progress=False)


def test_fused_build_reads_the_store_once_and_writes_the_two_pass_fit(inputs, raw, tmp_path, monkeypatch):
    passes, reads, rotations = [], [], []
    real, real_blocks, real_rotate = ekfac.store_pass, Store.iter_blocks, ekfac.rotate
    monkeypatch.setattr(fit, "store_pass", lambda *a, **k: passes.append(k.get("desc")) or real(*a, **k))
    monkeypatch.setattr(Store, "iter_blocks",
                        lambda self, *a, **k: reads.append(passes[:]) or real_blocks(self, *a, **k))
    monkeypatch.setattr(ekfac, "rotate", lambda X, *a: rotations.append(len(X)) or real_rotate(X, *a))
    monkeypatch.setattr(compact, "stored_rows", lambda *a: pytest.fail("the transcode rotated a row again"))
    _build(inputs, tmp_path / "idx")
    assert passes == ["store pass (kfac)"]  # (the separate fit makes a second, "store pass (ekfac)")
    files = len(Store(tmp_path / "idx").paths)  # the rows are read once, by that pass, a store file at a time
    assert reads == [["store pass (kfac)"]] * files  # (the transcode reads the copy)
    n_layers = len(read_layer_dims(inputs))
    assert sum(rotations) == n_layers * len(Store(tmp_path / "idx"))  # every row of every layer rotated once
    assert not (tmp_path / "idx" / rotated.ROTATED_DIR).exists()  # the rotated copy is gone
    m = read_manifest(tmp_path / "idx")
    assert row_basis(m) == "ekfac" and sorted(m["preconditioners"]) == ["ekfac", "kfac"]
    for method, rtol in (("kfac", 1e-6), ("ekfac", 2e-4)):  # the curvature and self-influence of the two-pass fit
        got, want = _file(tmp_path / "idx", method), _file(raw, method)
        # (EK-FAC's self-influence is taken from the kept rotated rows: their float16 rounding, <= 2^-12 of a
        # row's largest number, moves it by ~1e-4 relative)
        np.testing.assert_allclose(got["si"], want["si"], rtol=rtol)
        for n, f in want["layers"].items():
            for k, v in f.items():
                np.testing.assert_array_equal(got["layers"][n][k], v)


def test_float32_rotations_match_the_dense_float64_reference(inputs, raw, tmp_path, monkeypatch):
    """Every layer rotated in float32: ``Λ*`` and both self-influences against dense Kronecker algebra in
    float64 on the captured rows, and the int4 rows within their quantization step of the exact whitened rows."""
    monkeypatch.setattr(fit, "AUTO_FLOAT32_NUMBERS", 0)
    _build(inputs, tmp_path / "idx")
    x = _rows(raw)  # the captured float16 rows, decoded
    finite = Store(raw).column("finite").astype(bool)
    kf, ek = _file(tmp_path / "idx", "kfac"), _file(tmp_path / "idx", "ekfac")
    m = read_manifest(tmp_path / "idx")
    coded = _rows(tmp_path / "idx")
    for j, n in enumerate(m["build"]["layers"]):
        f = ek["layers"][n]
        Q = np.kron(f["Q_S"], f["Q_A"])  # [D, D] columns: eigenvectors of S ⊗ A (row-major vec)
        R = x[n].astype(np.float64) @ Q  # [N, D] exact rotated rows
        lam = (R[finite] ** 2).mean(0)
        rel = np.abs(f["Lambda"].reshape(-1) - lam).max() / lam.max()
        assert 0 < rel < 1e-5, (n, rel)  # round-off only (float32), and float32 indeed used
        delta = DEFAULT.damping * lam.mean()
        np.testing.assert_allclose(ek["si"][:, j], (R ** 2 / (lam + delta)).sum(1), rtol=2e-4)  # (float16 copy)
        kl = kf["layers"][n]["Lambda"].reshape(-1)
        kd = DEFAULT.damping * kl.mean()
        np.testing.assert_allclose(kf["si"][:, j], (R ** 2 / np.maximum(kl + kd, kd / 2)).sum(1), rtol=1e-5)
        W = R / np.sqrt(lam + delta)  # the exact whitened rows
        step = np.abs(W).max(1, keepdims=True) / 7  # int4's per-row step
        # the kept float16 copy of R moves each number by at most 2^-12 of its row's largest one (times its scale)
        half = 2.0 ** -12 * np.abs(R).max(1, keepdims=True) / np.sqrt(lam + delta)
        assert (np.abs(coded[n] - W) <= 0.5 * step * (1 + 1e-3) + 2 * half + 1e-6).all(), n


@pytest.mark.parametrize("kill_at", [2, 5])
def test_a_kill_during_the_fused_transcode_resumes_to_the_same_index(inputs, tmp_path, monkeypatch, kill_at):
    """Killed at the ``kill_at``-th block written (blocks of 4 rows: mid-shard at 2, a later shard at 5), the
    re-run keeps the written blocks and ends with the rows and self-influence of an unbroken build."""
    monkeypatch.setattr(ekfac, "BLOCK_BYTES", 4 * 4 * sum(read_layer_dims(inputs)))  # 4 rows a block
    _build(inputs, tmp_path / "whole")
    calls = {"n": 0}
    real = compact.ShardWriter.append

    def dying(self, *a, **k):
        calls["n"] += compact.STAGING in str(self.final)  # (the capture appends through the same class)
        if calls["n"] == kill_at:
            raise KeyboardInterrupt("killed")
        return real(self, *a, **k)

    monkeypatch.setattr(compact.ShardWriter, "append", dying)
    with pytest.raises(KeyboardInterrupt):
        _build(inputs, tmp_path / "idx")
    staged = sorted((tmp_path / "idx" / compact.STAGING / "store").iterdir())
    assert staged, "nothing was written before the kill"
    monkeypatch.setattr(compact.ShardWriter, "append", real)
    _build(inputs, tmp_path / "idx")
    got, want = _rows(tmp_path / "idx"), _rows(tmp_path / "whole")
    for n in want:
        np.testing.assert_array_equal(got[n], want[n])
    for method in ("kfac", "ekfac"):
        np.testing.assert_array_equal(_file(tmp_path / "idx", method)["si"], _file(tmp_path / "whole", method)["si"])
    assert not (tmp_path / "idx" / compact.STAGING).exists()


def read_layer_dims(inputs) -> list[int]:
    """Numbers per row of each hooked layer of the default build (every layer stored whole)."""
    from gradindex.capture import GradientCapture, RowSpace

    model, _, _ = inputs
    space = RowSpace(ProjectionSpec.parse("none")).bind(GradientCapture(model, ()).infos)
    return [space.dim(n) for n in space.infos]


def _shard_data(d, k: int) -> dict[str, bytes]:
    """Every dataset of shard ``k`` (codes, scales, ids, columns) as bytes."""
    out = {}
    with h5py.File(d / "store" / f"shard-{k:05d}.h5", "r") as f:
        f.visititems(lambda name, x: out.update({name: x[()].tobytes()}) if isinstance(x, h5py.Dataset) else None)
    return out


def test_without_disk_room_for_the_rotated_copy_the_transcode_rotates_again(inputs, tmp_path, monkeypatch):
    """A disk that holds the coded rows but not the float16 copy beside them: no copy is written, the
    transcode reads and rotates the store's rows, and the index is bitwise the build that kept one
    (issue 33 item 4: the two paths gave int4 codes a level apart at rounding boundaries)."""
    _build(inputs, tmp_path / "copy")
    free = []
    monkeypatch.setattr(fused, "free_bytes", lambda d: free.append(d) or 0)
    made = []
    monkeypatch.setattr(rotated.RotatedRows, "attach", lambda self, *a: made.append(1))
    _build(inputs, tmp_path / "tight")
    assert free and not made  # the disk was asked, and no copy written
    for k in range(len(Store(tmp_path / "copy").paths)):
        assert _shard_data(tmp_path / "tight", k) == _shard_data(tmp_path / "copy", k), k
    for method in ("kfac", "ekfac"):
        np.testing.assert_array_equal(_file(tmp_path / "tight", method)["si"], _file(tmp_path / "copy", method)["si"])


@pytest.mark.parametrize("damage", ["delete", "flip"])
def test_a_repaired_shard_of_a_transcoded_index_is_bitwise_the_built_one(inputs, tmp_path, damage):
    """``--repair`` captures a lost shard again and codes it as the fused transcode did: the same bytes
    (issue 33 item 4: it restored a shard whose scores differed slightly)."""
    model, tok, data = inputs
    d = tmp_path / "idx"
    _build(inputs, d)
    want = _shard_data(d, 1)
    shard = d / "store" / "shard-00001.h5"
    if damage == "delete":
        shard.unlink()
    else:
        with h5py.File(shard, "r") as f:
            off = f["grads"][next(iter(f["grads"]))].id.get_chunk_info(0).byte_offset
        with open(shard, "r+b") as f:
            f.seek(off + 3)
            b = f.read(1)
            f.seek(off + 3)
            f.write(bytes([b[0] ^ 0x01]))
    build_index(model, tok, data, d, DEFAULT, progress=False, repair=True)
    assert _shard_data(d, 1) == want
